"""What a resume can keep of a :class:`~lit_dtrain.strategies.compressed_ddp.CompressedDDPStrategy` checkpoint's
comm state (written under ``checkpoint["lit_dtrain_comm"]``): the preset that wrote it, the message that a
resume under another strategy, which does not read that state, warns with (what is dropped and what is lost), and
the entry each rank takes on a resume on another number of ranks (:func:`rank_entry`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_dtrain.utils.words import counted

CHECKPOINT_KEY = "lit_dtrain_comm"


class UnsplittableStateError(ValueError):
    """Per-rank state of a checkpoint that a resume on another number of ranks cannot spread over its ranks."""


def refused_resume_message(path: Any, state: Mapping, error: ValueError) -> str:
    """The ConfigError of a checkpoint whose comm state this strategy cannot load: the file, why, and the ways out
    (the preset that wrote it, unless that is the one in use and the world size is what differs; strategy=ddp)."""
    preset = "" if isinstance(error, UnsplittableStateError) else (
        f". Resume it with the preset that wrote it ({preset_overrides(state)})")
    return (f"{path}: {error}{preset}, or with strategy=ddp, which drops this state with a warning that lists what "
            "is lost")

def _codecs(state: Mapping) -> tuple:
    """``(compressor, local-update rule, pseudo-gradient compressor)`` names of a saved comm state (None: none)."""
    rank0 = list(state.get("per_rank") or [{}])[0] or {}
    return tuple((entry or {}).get("name") if isinstance(entry, Mapping) else None
                 for entry in (rank0.get("compressor"), state.get("local_update"), rank0.get("local_update")))


def refuse_another_preset(strategy: Any, path: Any) -> None:
    """A ConfigError before the fit where the comm state of checkpoint ``path`` was written by another codec or
    local-update rule than ``strategy``'s (a ``CompressedDDPStrategy``; anything else is left to
    :func:`warn_if_comm_state_dropped`). The fit's load refuses it with the same line, but only after a resume had
    cut the run's ``metrics.csv`` and TensorBoard events at the checkpoint's step: ``strategy=ddp_compressed/topk``
    on a finished ``int8`` run's ``resume=auto`` dropped its final validation's rows, and trained nothing."""
    from lit_dtrain.checkpoint import safe_torch_load
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies.compressed_ddp import CompressedDDPStrategy  # (it imports this module)

    if not isinstance(strategy, CompressedDDPStrategy):
        return
    state = safe_torch_load(path, mmap=True, verify=False).get(CHECKPOINT_KEY)
    if not isinstance(state, Mapping):
        return
    lu = strategy.local_update
    saved, ours = _codecs(state), tuple(getattr(c, "name", None) for c in (
        strategy.compressor, lu, getattr(lu, "compressor", None)))
    if saved[2] is None or ours[2] is None:  # a pseudo-gradient codec added or left out: loaded, or warned
        saved, ours = saved[:2], ours[:2]
    if saved != ours:
        what = ["compressor", "local-update rule", "pseudo-gradient compressor"]
        why = "; ".join(f"{w} {s!r} (this run: {o!r})" for w, s, o in zip(what, saved, ours) if s != o)
        raise ConfigError(refused_resume_message(path, state, ValueError(f"its comm state was written by {why}")))


def ranks_phrase(n) -> str:
    return counted(n, "rank")


def written_preset(state: Mapping) -> str:
    """The ``conf/strategy/ddp_compressed/<name>`` preset (named as its codec or rule) that wrote ``state``."""
    if not isinstance(state, Mapping):
        return "?"
    if state.get("local_update") is not None:
        return str(state["local_update"].get("name", "?"))
    per_rank = list(state.get("per_rank") or [{}])
    compressor = (per_rank[0] or {}).get("compressor")
    return "none" if compressor is None else str(compressor.get("name", "?"))


# codecs without a preset of their own: the preset and override that build them
_BUILT_BY = {"int4_rs": "int8_rs strategy.compressor.bits=4"}


def preset_overrides(state: Mapping) -> str:
    """The overrides that select the preset of :func:`written_preset` (``int4_rs`` has none: ``int8_rs`` with
    ``bits=4``; 'strategy=ddp_compressed/int4_rs' was Hydra's 'Could not find'), with DiLoCo's pseudo-gradient
    compressor, which its preset leaves out (a DiLoCo int4 checkpoint refused under DiLoCo int8 was told to resume
    with 'strategy=ddp_compressed/diloco', the preset in use, which drops the int4 state)."""
    name = written_preset(state)
    overrides = f"strategy=ddp_compressed/{_BUILT_BY.get(name, name)}"
    inner = (list(state.get("per_rank") or [{}])[0] or {}).get("local_update") if isinstance(state, Mapping) else None
    return overrides + (f" strategy.local_update.compressor={inner.get('name', '?')}" if inner else "")


def dropped_comm_state_message(checkpoint: Mapping, strategy: Any, path: Any = None) -> str | None:
    """What resuming ``checkpoint`` under ``strategy`` drops of a :class:`CompressedDDPStrategy` run, or None.

    The compressed strategy writes its state under ``checkpoint["lit_dtrain_comm"]`` and alone reads it back;
    Lightning's own strategies (``strategy=ddp``, ``auto``, ``fsdp``) ignore the entry without a word. A switch of
    strategy on a resume can be deliberate (a WSD decay branch under plain DDP), so this is a warning, whereas the
    compressed strategy refuses a checkpoint of another preset with an error: it would have to apply state it
    cannot use, while another strategy only leaves it behind. The message names the state, what is lost
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
                + (f"which are not the synchronized model ({counted(since, 'step')} since the last sync)"
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
            f"({preset_overrides(state)}, {ranks}) and holds its {', '.join(held)}; this run's "
            f"{type(strategy).__name__} does not read that state, so it is dropped: {lost}. Expected when switching "
            f"strategy on purpose (e.g. a decay branch under plain DDP); to keep it, resume with "
            f"{preset_overrides(state)} on the same {ranks}")


def warn_if_comm_state_dropped(checkpoint: Mapping, strategy: Any, path: Any = None) -> str | None:
    """Warn on rank 0 with :func:`dropped_comm_state_message` when there is something to say; returns it."""
    message = dropped_comm_state_message(checkpoint, strategy, path)
    if message is not None:
        rank_zero_warn(message)
    return message


# --- a resume on another number of ranks --------------------------------------------------------------
_PER_RANK_CODEC_KEYS = ("residuals", "server_residuals")  # error feedback: what each rank has not sent yet


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _mean(tensors: Mapping[str, list], world: int) -> dict[str, torch.Tensor]:
    """Per name, the sum over the ranks (in rank order, in fp32, a rank without the name adding zero) over ``world``."""
    out = {}
    for name, held in tensors.items():
        total = held[0].float().clone()
        for t in held[1:]:
            total.add_(t.float())
        out[name] = total.div_(world).to(held[0].dtype)
    return out


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return float(sum(t.float().pow(2).sum() for t in tensors.values()) ** 0.5) if tensors else 0.0


def _shared_codec_state(states: list, what: str, notes: list[str]) -> dict | None:
    """One codec state for every rank of a resume on another number of ranks: rank 0's replicated state (counters,
    PowerSGD's Qs, top-k's buckets, the loss scale), and as error-feedback residual the mean of the saved ranks'.
    The mean residual is the gradient the codec still owes the model (sum_r e_r / W is what the uninterrupted
    run would have added), so giving it to every rank keeps it whole; each rank's deviation from it, which sums to
    zero over the ranks, is dropped. ``int8_rs``'s server residuals (shares laid out for W ranks) are dropped. A
    ValueError when the state other than residuals differs between ranks: per-rank state nothing here can split."""
    if states[0] is None:
        return None
    world = len(states)
    shared = {k: v for k, v in states[0].items() if k not in _PER_RANK_CODEC_KEYS}
    for r, state in enumerate(states[1:], 1):
        other = {k: v for k, v in (state or {}).items() if k not in _PER_RANK_CODEC_KEYS}
        differ = sorted(k for k in shared.keys() | other.keys() if not _same(shared.get(k), other.get(k)))
        if differ:
            raise UnsplittableStateError(
                f"{CHECKPOINT_KEY}: the {what} state {differ} differs between rank 0 and rank {r}: per-rank state "
                f"that cannot be spread over another number of ranks; resume on the {ranks_phrase(world)} that "
                "wrote it")
    held: dict[str, list] = {}
    for state in states:
        for name, t in (state.get("residuals") or {}).items():
            held.setdefault(name, []).append(t)
    if "residuals" in states[0]:
        shared["residuals"] = _mean(held, world)
    if held and world == 1:
        notes.append(f"the {what} error-feedback residual of 1 rank goes to every rank (norm "
                     f"{_norm(shared['residuals']):.3g}: the gradient still owed, kept whole)")
    elif held:
        deviation = _norm({f"{r}.{n}": t - shared["residuals"][n] for r, s in enumerate(states)
                           for n, t in (s.get("residuals") or {}).items()})
        notes.append(f"the {what} error-feedback residuals of {ranks_phrase(world)} are replaced on every rank by "
                     f"their mean (norm {_norm(shared['residuals']):.3g}: the gradient still owed, kept whole), "
                     f"dropping each rank's deviation from it (norm {deviation:.3g}, zero in sum)")
    if "server_residuals" in states[0]:
        shared["server_residuals"] = {}
        dropped = _norm({f"{r}.{n}": t for r, s in enumerate(states) for n, t in s["server_residuals"].items()})
        if dropped:
            notes.append(f"the {what} server residuals (shares laid out for {ranks_phrase(world)}, norm "
                         f"{dropped:.3g}) are dropped")
    return shared


def elastic_rank_entry(state: Mapping, world: int) -> tuple[dict, list[str]]:
    """The ``per_rank`` entry every rank of a ``world``-rank run takes from ``state``, written on another number of
    ranks, and what that changed, for the warning. Kept exactly: the replicated state (codec and local-update
    counters, PowerSGD's Qs, DiLoCo's outer parameters and momentum) and rank 0's ``comm/*`` counters. Under local
    updates every rank starts from the mean of the saved ranks' parameters (their own parameters when they are
    equal, right after a sync; mid-period, the point a sync now would move them to) and rank 0's optimizer state."""
    per_rank = list(state["per_rank"])
    if len(per_rank) != state["world_size"]:
        raise ValueError(f"{CHECKPOINT_KEY}: the checkpoint says {ranks_phrase(state['world_size'])} but holds the "
                         f"state of {len(per_rank)} (a damaged file?)")
    notes: list[str] = []
    entry = {"counters": per_rank[0]["counters"],
             "compressor": _shared_codec_state([p["compressor"] for p in per_rank], "compressor", notes),
             "local_update": _shared_codec_state([p["local_update"] for p in per_rank], "pseudo-gradient compressor",
                                                 notes)}
    if "params" in per_rank[0]:
        params = {name: [p["params"][name] for p in per_rank] for name in per_rank[0]["params"]}
        entry["params"] = _mean(params, len(per_rank))
        if not all(_same(held[0], t) for held in params.values() for t in held[1:]):
            rule = state.get("local_update") or {}
            since = int(rule.get("steps_since_sync", 0))
            # a DiLoCo sync moves them by an outer step from its outer parameters, not to their mean
            where = ("their average, not where an outer step now would move them; the outer parameters and momentum "
                     "are kept" if rule.get("name") == "diloco" else "the point a sync now would move them to")
            notes.append(f"every rank starts from the mean of the {ranks_phrase(len(per_rank))}' parameters, which "
                         f"differ {counted(since, 'step')} after the last sync ({where})")
        entry["optimizer_states"] = per_rank[0]["optimizer_states"]
        if len(per_rank) > 1:
            others = "rank 1's is" if len(per_rank) == 2 else f"those of ranks 1-{len(per_rank) - 1} are"
            notes.append(f"every rank takes rank 0's optimizer state ({others} dropped)")
    return entry, notes


def rank_entry(state: Mapping, rank: int, world: int) -> tuple[dict, str | None]:
    """This rank's ``per_rank`` entry of ``state``: its own on the world size that wrote it, else
    :func:`elastic_rank_entry`'s, with the warning (for rank 0, once the entry is applied) that names what the other
    world size changed."""
    if state["world_size"] == world:
        return state["per_rank"][rank], None
    entry, notes = elastic_rank_entry(state, world)
    return entry, (f"{CHECKPOINT_KEY}: the checkpoint was written on {ranks_phrase(state['world_size'])} and this run "
                   f"has {world}: the replicated codec and local-update state and rank 0's comm counters are kept; "
                   + ("; ".join(notes) if notes else "nothing else was held")
                   + ". A resume on the same number of ranks keeps everything")


# --- residuals the resumed codec does not apply ---------------------------------------------------------
def _residual_norm(state: Mapping) -> float:
    return _norm({f"{kind}.{name}": t for kind in _PER_RANK_CODEC_KEYS
                  for name, t in (state.get(kind) or {}).items()})


def without_unapplied_residuals(entry: Mapping, compressor: Any, local_update: Any) -> tuple[dict, list[str]]:
    """``entry`` (this rank's ``per_rank`` entry) without the error-feedback residuals this run's codecs never apply,
    and the warnings that say so: a codec resumed with ``error_feedback=False``, or DiLoCo resumed without the
    pseudo-gradient compressor that wrote them. Before, a codec without error feedback kept them, never applied them
    and saved them again in every checkpoint (a later resume that turned error feedback back on added them, stale,
    to its first step), and DiLoCo dropped them without a word."""
    entry, notes = dict(entry), []

    def drop(state: Mapping, what: str, reason: str, keep: str) -> dict:
        norm = _residual_norm(state)
        if norm:
            notes.append(f"{CHECKPOINT_KEY}: the checkpoint's {what} error-feedback residuals (rank 0's norm "
                         f"{norm:.3g}: the gradient compression held back) are dropped, since {reason}: that "
                         f"gradient is never applied. To keep it, resume with {keep}")
        return {k: ({} if k in _PER_RANK_CODEC_KEYS else v) for k, v in state.items()}

    saved = entry.get("compressor")
    if compressor is not None and saved and not compressor.error_feedback and saved.get("name") == compressor.name:
        entry["compressor"] = drop(saved, compressor.name, f"this run's {compressor.name} codec has "
                                   "error_feedback=False", "strategy.compressor.error_feedback=true")
    saved = entry.get("local_update")
    inner = getattr(local_update, "compressor", None)
    if local_update is not None and saved:
        name = saved.get("name", "?")
        if inner is None:
            entry["local_update"] = None
            drop(saved, f"{local_update.name} pseudo-gradient compressor ({name})",
                 f"this run's {local_update.name} has no pseudo-gradient compressor",
                 f"strategy.local_update.compressor={name} (with error_feedback=true)")
        elif not inner.error_feedback and name == inner.name:
            entry["local_update"] = drop(saved, f"{local_update.name} pseudo-gradient compressor ({name})",
                                         "this run's pseudo-gradient compressor has error_feedback=False",
                                         "strategy.local_update.compressor.error_feedback=true")
    return entry, notes


def warm_start_rank_notes(entry: Mapping, compressor: Any, local_update: Any,
                          shapes: Mapping[str, tuple] | None = None) -> list[str]:
    """The warnings for PowerSGD warm-start Qs in ``entry`` (this rank's ``per_rank`` entry) written at another
    ``matrix_approximation_rank`` than this run's: a Q whose shape no longer fits restarts from random (the
    error-feedback residuals, full-size, stay valid). Before, that happened without a word. A checkpoint from before
    the rank was saved gives it by its Qs' widest column count. ``shapes``: the model's parameter shapes by name, for
    which Qs still fit: one of a matrix no wider than both ranks (compressed only under ``min_compression_rate < 1``)
    keeps its ``(m, min(n, m, rank))`` shape, and the warning said that every Q restarts."""
    notes = []
    inner = getattr(local_update, "compressor", None)
    for saved, codec, key in ((entry.get("compressor"), compressor, "strategy.compressor"),
                              (entry.get("local_update"), inner, "strategy.local_update.compressor")):
        rank, qs = getattr(codec, "matrix_approximation_rank", None), (saved or {}).get("q_memory")
        if rank is None or not qs or saved.get("name") != codec.name or not codec.warm_start:
            continue
        saved_rank = saved.get("matrix_approximation_rank", max(q.shape[-1] for q in qs.values()))
        if saved_rank == rank:
            continue
        restart = [name for name, q in qs.items() if not _q_fits(q, saved_rank, rank, (shapes or {}).get(name))]
        if not restart:
            continue
        kept = len(qs) - len(restart)
        which = "each Q restarts" if not kept else (
            f"{len(restart)} of them restart (the other {kept}, of matrices at most {min(saved_rank, rank)} wide, fit "
            "both ranks and are kept)")  # (at most the new rank wide read 'at most 4' of 2 -> 4, where a 3 restarts)
        notes.append(f"{CHECKPOINT_KEY}: the checkpoint's PowerSGD warm-start Qs ({len(qs)} matrices) are of "
                     f"rank {saved_rank} and this run's {key}.matrix_approximation_rank is {rank}: {which} from "
                     f"random (the error-feedback residuals are kept). To keep them, resume with "
                     f"{key}.matrix_approximation_rank={saved_rank}")
    return notes


def _q_fits(q: torch.Tensor, saved_rank: int, rank: int, shape: tuple | None) -> bool:
    """Whether the warm-start ``q`` of shape ``(m, min(n, m, saved_rank))`` is the ``(m, min(n, m, rank))`` that
    PowerSGD at ``rank`` warm-starts from (``PowerSGD._initial_q``). Without the parameter's ``shape``, ``n`` is
    known only where ``q`` is narrower than ``saved_rank`` (then ``min(n, m)`` is its width) or ``m`` is that rank."""
    m, width = q.shape
    if shape is not None and len(shape) >= 2 and shape[0]:
        n = shape[0]
        return (m, width) == (math.prod(shape) // n, min(n, math.prod(shape) // n, rank))
    narrowest = width if width < saved_rank or m == saved_rank else None  # min(n, m), where q tells it
    return narrowest is not None and min(narrowest, rank) == width
