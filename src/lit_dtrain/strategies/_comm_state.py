"""The compressor and local-update state ``CompressedDDPStrategy`` writes under ``checkpoint["lit_dtrain_comm"]``
(:meth:`~lit_dtrain.strategies.compressed_ddp.CompressedDDPStrategy.comm_state_dict`) and hands each rank back at a
resume (``load_comm_state_dict``): every rank's counters and codec state gathered to rank 0, the replicated
local-update state, and under local updates every rank's own parameters and optimizer state. What a resume on
another number of ranks keeps, and the warnings, are in :mod:`.comm_checkpoint`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_dtrain.strategies.comm import CommSession
from lit_dtrain.strategies.comm_checkpoint import (
    CHECKPOINT_KEY,
    rank_entry,
    warm_start_rank_notes,
    without_unapplied_residuals,
)

_STATE_VERSION = 1


def _own_params(strategy) -> dict:
    return {n: p.detach().cpu().clone() for n, p in CommSession.named_params(strategy.lightning_module)}


def _cpu_copy(state):
    """``state`` with every tensor copied to the CPU: gathered live, rank r's state would be unpickled on rank 0 as
    cuda:r (a device a one-GPU-per-task job cannot see), and would alias the running tensors."""
    return apply_to_collection(state, torch.Tensor, lambda t: t.detach().cpu().clone())


@contextmanager
def kept_for_a_resume(strategy, step: int | None, counting: bool = False) -> Iterator[None]:
    """Around a sync that a fit going on past this point never makes, at step ``step`` (None: keep nothing): keep this
    rank's parameters and the local-update state from before it, for the checkpoints written at that step
    (:func:`gather_comm_state`); ``counting``: the sync comes inside the step's count
    (:meth:`LocalUpdate.after_optimizer_step`), which the kept state takes in. Such syncs: the one of the validation
    Lightning runs only because the fit was asked to stop after the step (``max_time``, ``EarlyStopping``,
    ``trainer.should_stop``), the one at the fit's last step (``sync_on_last_step``) when its period is not over, and
    the one in ``on_train_end``. A resume from a checkpoint
    written after one went on from the synchronized model (2 gloo ranks, local SGD period 4, stopped after step 6 of
    10, or finished at 6 and extended to 10: 0.0029 off the straight run's weights, DiLoCo 0.027). The checkpoint's
    ``state_dict`` keeps the synchronized model, which the validation evaluated and the fit ends with."""
    lu = strategy.local_update
    if step is None:  # nothing to keep: a sync the fit going on makes too
        yield
        return
    state = _cpu_copy(lu.state_dict())
    if counting:
        state["step"], state["steps_since_sync"] = state["step"] + 1, state["steps_since_sync"] + 1
    kept = {"step": step, "local_update": state, "params": _own_params(strategy),
            "local_update_rank": _cpu_copy(lu.rank_local_state_dict())}
    syncs = lu.num_syncs
    yield
    # it stands while no other sync runs; none when no sync ran here (a period ended within a manual batch)
    strategy._state_before_early_sync = {**kept, "num_syncs": lu.num_syncs} if lu.num_syncs > syncs else None


def _kept_state(strategy) -> dict | None:
    """The state :func:`kept_for_a_resume` kept, while the fit is still at its step and no sync ran since."""
    kept, lu = getattr(strategy, "_state_before_early_sync", None), strategy.local_update
    if kept is None or lu is None or kept.get("num_syncs") != lu.num_syncs:
        return None
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    return kept if trainer is not None and trainer.global_step == kept["step"] else None


def gather_comm_state(strategy) -> dict:
    """Collective (call on every rank): each rank's counters and compressor state, plus the replicated
    local-update state (counters, period, DiLoCo outer parameters and momentum) from this rank. After a sync that a
    fit going on never makes (a stop's validation, the last step), the state from before that sync
    (:func:`kept_for_a_resume`), with the sync counts of now (the counts are of what was done)."""
    lu = strategy.local_update
    own = strategy.comm_local_state_dict()
    kept = _kept_state(strategy)
    if kept is not None:
        counts = {"num_syncs": lu.num_syncs, "num_early_syncs": lu.num_early_syncs}
        own = {**own, "local_update": {**kept["local_update"], **counts},
               "local_update_rank": kept["local_update_rank"]}
    local = {
        "counters": strategy.session.counters_state_dict(),  # per rank: comm time differs between ranks
        "compressor": own["compressor"],
        "local_update": own["local_update_rank"],
    }
    if lu is not None and strategy.lightning_module is not None:
        # Under local updates the ranks' parameters differ between syncs, and their inner optimizer
        # states always do; Lightning saves rank 0's only, so every rank's own copy is kept here.
        local["params"] = kept["params"] if kept is not None else _own_params(strategy)
        local["optimizer_states"] = [_cpu_copy(opt.state_dict()) for opt in strategy.optimizers]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    gathered: list = [None] * world if world > 1 else [local]
    if world > 1:
        dist.all_gather_object(gathered, local)
    return {"version": _STATE_VERSION, "world_size": world, "local_update": own["local_update"],
            "per_rank": gathered}


def _parts(codec, local_update) -> str:
    """Which of a per-step codec and a local-update rule a checkpoint's state or a strategy has, in words."""
    return (f"{'a' if codec is not None else 'no'} per-step gradient codec and "
            f"{'a' if local_update is not None else 'no'} local-update rule")


def apply_comm_state(strategy, state: dict) -> None:
    """Restore :func:`gather_comm_state` output; each rank takes its own entry of ``per_rank``."""
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"{CHECKPOINT_KEY}: unsupported version {state.get('version')!r}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    mine, elastic = rank_entry(state, rank, world)  # another world size: what it can keep, and the warning
    lu = strategy.local_update
    mine, unapplied = without_unapplied_residuals(mine, strategy.compressor, lu)  # warned once the rest is applied
    module = strategy.lightning_module
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()} if module is not None else None
    unapplied += warm_start_rank_notes(mine, strategy.compressor, lu, shapes)
    written = _parts(mine["compressor"], state["local_update"])
    if written != _parts(strategy.compressor, lu):  # what a strategy=ddp resume drops is comm_checkpoint's
        raise ValueError(f"{CHECKPOINT_KEY}: the checkpoint was written with {written}; this strategy has "
                         f"{_parts(strategy.compressor, lu)} ({strategy.compressor if lu is None else lu!r})")
    strategy.load_comm_local_state_dict({"compressor": mine["compressor"], "local_update": state["local_update"],
                                         "local_update_rank": mine["local_update"]}, counts=True)
    if lu is not None:
        if "params" in mine:  # applied after DDP's wrap (which broadcasts rank 0's) and to the optimizer
            strategy._rank_restore = {"params": mine["params"], "optimizer_states": mine["optimizer_states"]}
        else:
            rank_zero_warn(f"{CHECKPOINT_KEY}: this checkpoint predates per-rank parameters; every rank "
                           "resumes from rank 0's parameters and optimizer state")
    strategy.session.load_counters_state_dict(mine["counters"])
    for note in unapplied:
        rank_zero_warn(note)
    if elastic is not None:  # said once applied: not before an error about another preset
        rank_zero_warn(elastic)
