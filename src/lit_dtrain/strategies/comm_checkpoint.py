"""What a resume can keep of a :class:`~lit_dtrain.strategies.compressed_ddp.CompressedDDPStrategy` checkpoint's
comm state (written under ``checkpoint["lit_dtrain_comm"]``): the preset that wrote it, and the message that a
resume under another strategy, which does not read that state, warns with (what is dropped and what is lost)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

CHECKPOINT_KEY = "lit_dtrain_comm"

def ranks_phrase(n) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def written_preset(state: Mapping) -> str:
    """The ``conf/strategy/ddp_compressed/<name>`` preset (named as its codec or rule) that wrote ``state``."""
    if not isinstance(state, Mapping):
        return "?"
    if state.get("local_update") is not None:
        return str(state["local_update"].get("name", "?"))
    per_rank = list(state.get("per_rank") or [{}])
    compressor = (per_rank[0] or {}).get("compressor")
    return "none" if compressor is None else str(compressor.get("name", "?"))


def dropped_comm_state_message(checkpoint: Mapping, strategy: Any, path: Any = None) -> str | None:
    """What resuming ``checkpoint`` under ``strategy`` drops of a :class:`CompressedDDPStrategy` run, or None.

    The compressed strategy writes its state under ``checkpoint["lit_dtrain_comm"]`` and alone reads it back;
    Lightning's own strategies (``strategy=ddp``, ``auto``, ``fsdp``) ignore the entry without a word. A switch of
    strategy on a resume can be deliberate (a WSD decay branch under plain DDP), so this is a warning, whereas the
    compressed strategy refuses a checkpoint of another world size or preset with an error: it would have to apply
    state it cannot use, while another strategy only leaves it behind. The message names the state, what is lost
    with it and the preset (``conf/strategy/ddp_compressed/<name>.yaml``, named as its codec) that keeps it.
    """
    from lit_dtrain.strategies.compressed_ddp import CompressedDDPStrategy  # (it imports this module)

    state = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(state, Mapping) or isinstance(strategy, CompressedDDPStrategy):
        return None
    per_rank = list(state.get("per_rank") or [{}])
    world = state.get("world_size", len(per_rank))
    ranks = ranks_phrase(world)
    rank0 = per_rank[0] or {}
    local = state.get("local_update")
    preset = written_preset(state)
    if local is not None:
        held = [f"{preset} counters and period"]
        if local.get("outer_params"):
            held.append("DiLoCo's outer parameters and momentum")
        if (rank0.get("local_update") or {}).get("residuals"):
            held.append("its pseudo-gradient compressor's error-feedback residuals")
        if "params" in rank0:
            held.append("every rank's own parameters and optimizer state")
        since = int(local.get("steps_since_sync", 0))
        lost = ("every rank resumes from rank 0's parameters and optimizer state, "
                + (f"which are not the synchronized model ({since} step{'s' if since != 1 else ''} since the last sync)"
                   if since else "written right after a sync"))
    else:
        compressor = rank0.get("compressor") or {}
        held, lost = [], "only the comm/* counters restart"
        if compressor.get("residuals"):
            held.append(f"error-feedback residuals of {ranks}")
            lost = "the gradient that compression held back in the residuals is never applied"
        if compressor.get("q_memory"):
            held.append("PowerSGD Q matrices (its warm start)")
        held.append("comm counters")
    return (f"{CHECKPOINT_KEY}: {path or 'the checkpoint'} was written under CompressedDDPStrategy "
            f"(strategy=ddp_compressed/{preset}, {ranks}) and holds its {', '.join(held)}; this run's "
            f"{type(strategy).__name__} does not read that state, so it is dropped: {lost}. Expected when switching "
            f"strategy on purpose (e.g. a decay branch under plain DDP); to keep it, resume with "
            f"strategy=ddp_compressed/{preset} on the same {ranks}")


def warn_if_comm_state_dropped(checkpoint: Mapping, strategy: Any, path: Any = None) -> str | None:
    """Warn on rank 0 with :func:`dropped_comm_state_message` when there is something to say; returns it."""
    message = dropped_comm_state_message(checkpoint, strategy, path)
    if message is not None:
        rank_zero_warn(message)
    return message
