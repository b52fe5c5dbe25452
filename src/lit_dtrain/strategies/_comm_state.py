"""The compressor and local-update state ``CompressedDDPStrategy`` writes under ``checkpoint["lit_dtrain_comm"]``
(:meth:`~lit_dtrain.strategies.compressed_ddp.CompressedDDPStrategy.comm_state_dict`) and hands each rank back at a
resume (``load_comm_state_dict``): every rank's counters and codec state gathered to rank 0, the replicated
local-update state, and under local updates every rank's own parameters and optimizer state. What a resume on
another number of ranks keeps, and the warnings, are in :mod:`.comm_checkpoint`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_dtrain.strategies.comm import CommSession
from lit_dtrain.strategies.comm_checkpoint import CHECKPOINT_KEY, rank_entry

_STATE_VERSION = 1


def gather_comm_state(strategy) -> dict:
    """Collective (call on every rank): each rank's counters and compressor state, plus the replicated
    local-update state (counters, period, DiLoCo outer parameters and momentum) from this rank."""
    lu = strategy.local_update
    own = strategy.comm_local_state_dict()
    local = {
        "counters": strategy.session.counters_state_dict(),  # per rank: comm time differs between ranks
        "compressor": own["compressor"],
        "local_update": own["local_update_rank"],
    }
    if lu is not None and strategy.lightning_module is not None:
        # Under local updates the ranks' parameters differ between syncs, and their inner optimizer
        # states always do; Lightning saves rank 0's only, so every rank's own copy is kept here.
        local["params"] = {n: p.detach().cpu().clone() for n, p in CommSession.named_params(strategy.lightning_module)}
        # CPU copies, as for the parameters: gathered live, rank r's state would be unpickled on rank 0 as
        # cuda:r (a device a one-GPU-per-task job cannot see), and would alias the running optimizer's tensors
        local["optimizer_states"] = [apply_to_collection(opt.state_dict(), torch.Tensor,
                                                         lambda t: t.detach().cpu().clone())
                                     for opt in strategy.optimizers]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    gathered: list = [None] * world if world > 1 else [local]
    if world > 1:
        dist.all_gather_object(gathered, local)
    return {"version": _STATE_VERSION, "world_size": world, "local_update": own["local_update"],
            "per_rank": gathered}

def apply_comm_state(strategy, state: dict) -> None:
    """Restore :func:`gather_comm_state` output; each rank takes its own entry of ``per_rank``."""
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"{CHECKPOINT_KEY}: unsupported version {state.get('version')!r}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    mine, elastic = rank_entry(state, rank, world)  # another world size: what it can keep, and the warning
    if (mine["compressor"] is None) != (strategy.compressor is None):
        raise ValueError(f"{CHECKPOINT_KEY}: checkpoint compressor state {mine['compressor'] is not None} does "
                         f"not match this strategy's compressor {strategy.compressor!r}")
    lu = strategy.local_update
    if (state["local_update"] is None) != (lu is None):
        raise ValueError(f"{CHECKPOINT_KEY}: checkpoint local-update state does not match {lu!r}")
    strategy.load_comm_local_state_dict({"compressor": mine["compressor"], "local_update": state["local_update"],
                                         "local_update_rank": mine["local_update"]}, counts=True)
    if lu is not None:
        if "params" in mine:  # applied after DDP's wrap (which broadcasts rank 0's) and to the optimizer
            strategy._rank_restore = {"params": mine["params"], "optimizer_states": mine["optimizer_states"]}
        else:
            rank_zero_warn(f"{CHECKPOINT_KEY}: this checkpoint predates per-rank parameters; every rank "
                           "resumes from rank 0's parameters and optimizer state")
    strategy.session.load_counters_state_dict(mine["counters"])
    if elastic is not None:  # said once applied: not before an error about another preset
        rank_zero_warn(elastic)
