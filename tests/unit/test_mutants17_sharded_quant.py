"""Gaps found by the seventeenth hand mutation audit of strategies/sharded_quant.py: its server residuals' layout,
undo and keep, pinned on 4 (or 2) ranks run as threads of one process (tests/unit/_thread_ranks.py), where the
4-process gloo test of tests/dist/test_sharded_quant.py let the mutants live."""

from __future__ import annotations

import torch

from lit_dtrain.strategies import ShardedBlockQuantizer
from lit_dtrain.strategies.compressors import segments_from_shapes
from tests.unit._thread_ranks import run_ranks

BLOCK = 8
SEGMENTS = segments_from_shapes([("w", (6, 8)), ("b", (8,)), ("emb", (5, 7))])  # 48 + 8 + 35 values
NUMEL = sum(s.numel for s in SEGMENTS)


def rank_grad(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * step + rank))


def _codec(**kwargs) -> ShardedBlockQuantizer:
    return ShardedBlockQuantizer(block_size=BLOCK, error_feedback=True, **kwargs)


def test_a_state_records_the_world_size_its_server_residuals_were_shared_at():
    """A state saved after steps on 4 ranks says so, and resumed on 2 ranks (zero gradients, no worker residual)
    adds none of its server residuals, whose shares cover other values there. Without the world size kept, the
    state said None and rank 0 of 2 added the 4-rank residuals of equal-sized shares to its mean."""
    def four(comm):
        c = _codec()
        c.reduce(rank_grad(comm.rank), SEGMENTS, comm, 0).wait()
        return c.state_dict()

    states = run_ranks(4, four)
    assert [s["server_layout"] for s in states] == [{"world_size": 4, "block_size": BLOCK}] * 4
    assert all(s["server_residuals"] for s in states)

    def two(comm):
        c = _codec()
        c.load_state_dict({**states[comm.rank], "residuals": {}})
        return c.reduce(torch.zeros(NUMEL), SEGMENTS, comm, 1).wait()

    assert all(not out.any() for out in run_ranks(2, two))


def test_a_state_without_its_layout_keeps_the_server_residuals_it_can_place():
    """A state written before the layout was kept (no ``server_layout``) is read as this run's: its server residual
    of the right size is added (the output of zero gradients is that residual, requantized), one of another size is
    not (no size error). Reading the missing block size as another one dropped them all."""
    def run(comm):
        c = _codec()
        c.reduce(rank_grad(comm.rank), SEGMENTS, comm, 0).wait()
        state = {k: v for k, v in c.state_dict().items() if k != "server_layout"}
        state["residuals"] = {}
        kept = _codec()
        kept.load_state_dict(state)
        assert set(kept.server_residuals) == set(c.server_residuals)
        out = kept.reduce(torch.zeros(NUMEL), SEGMENTS, comm, 1).wait()
        wrong_size = _codec()
        wrong_size.load_state_dict({**state, "server_residuals": {k: torch.ones(3) for k in c.server_residuals}})
        return out, wrong_size.reduce(torch.zeros(NUMEL), SEGMENTS, comm, 1).wait()

    results = run_ranks(2, run)
    assert all(out.abs().sum() > 0 for out, _ in results)  # the residuals were added
    assert all(not other.any() for _, other in results)  # 3 values fit no share: not added


def test_an_undone_step_puts_the_server_residuals_back():
    """``undo_step`` after a dropped step (a loss spike's skip, a step the GradScaler skipped) restores the server
    residuals from before it: the undo record is a copy of the dict. Keeping the live dict in it, the undo 'restored'
    the dropped step's residuals."""
    def run(comm):
        c = _codec()
        c.track_undo()
        c.reduce(rank_grad(comm.rank, 0), SEGMENTS, comm, 0).wait()
        before = {k: v.clone() for k, v in c.server_residuals.items()}
        c.reduce(rank_grad(comm.rank, 1), SEGMENTS, comm, 1).wait()
        changed = any(not torch.equal(before[k], v) for k, v in c.server_residuals.items())
        assert c.undo_step()
        return changed, before, c.server_residuals

    for changed, before, after in run_ranks(2, run):
        assert changed and before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_keep_residuals_puts_back_the_server_residual_of_an_unused_parameter():
    """A parameter no rank used in a step (``find_unused_parameters``): its shard's mean was all residual, which DDP
    discarded, so its server residual is the one from before the step again; those of used ones stay new. Without
    the put-back every rank kept the new one (each rank owns a share of ``w``'s 6 blocks)."""
    def run(comm):
        c = _codec()
        c.track_undo()
        c.reduce(rank_grad(comm.rank, 0), SEGMENTS, comm, 0).wait()
        before = dict(c.server_residuals)
        c.reduce(rank_grad(comm.rank, 1), SEGMENTS, comm, 1).wait()
        after = dict(c.server_residuals)
        c.keep_residuals(["w"])
        return before, after, c.server_residuals

    for rank, (before, after, now) in enumerate(run_ranks(2, run)):
        assert "w" in now and not torch.equal(before["w"], after["w"]), rank
        for name in now:
            assert now[name] is (before if name == "w" else after)[name], (rank, name)


def test_a_new_loss_scale_rescales_the_server_residuals_too():
    """Under a GradScaler the residuals are in the units of the loss scale: halving it (after an overflow) halves
    the server residuals with the worker ones. Left out of ``_residual_tensors``, they kept the old scale and were
    added at twice their value."""
    def run(comm):
        c = _codec()
        c.set_grad_scale(1024.0)
        c.reduce(rank_grad(comm.rank) * 1024, SEGMENTS, comm, 0).wait()
        before = {k: v.clone() for k, v in c.server_residuals.items()}
        c.set_grad_scale(512.0)
        return before, c.server_residuals

    for before, after in run_ranks(2, run):
        assert before and before.keys() == after.keys()
        assert all(torch.equal(after[k], before[k] / 2) for k in before)
