"""A step undone after the codec was told a new loss scale: manual optimization with one backward and two optimizer
steps under ``16-mixed`` (a Muon + AdamW split, say). The first ``opt.step()``'s ``scaler.update()`` grows the scale
(``growth_interval`` good steps), the second optimizer's ``_optimizer_step`` tells the codec the grown scale (which
rescales the live residuals), its parameters' grads hold an inf, the scaler backs off, and the strategy undoes the
step: the record's pre-step residuals, made under the old scale, must come back in the told one."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.strategies import BlockQuantizer, ShardedBlockQuantizer, build_compressor
from lit_dtrain.strategies.compressors import segments_from_shapes
from tests.unit._thread_ranks import run_ranks

SEGMENTS = segments_from_shapes([("w", (6, 8)), ("b", (8,)), ("emb", (5, 7))])  # 91 values, 3 parameters
NUMEL = sum(s.numel for s in SEGMENTS)
MAKE = {
    "int8_ef": lambda: BlockQuantizer(bits=8, block_size=8, error_feedback=True),
    "topk": lambda: build_compressor("topk"),
    "int8_rs_ef": lambda: ShardedBlockQuantizer(block_size=8, error_feedback=True),
}


def _state(c) -> dict:
    state = c.state_dict()
    return {k: {n: t.clone() for n, t in state[k].items()} for k in ("residuals", "server_residuals") if k in state}


@pytest.mark.parametrize("name", list(MAKE))
def test_an_undo_after_a_new_scale_restores_the_residuals_in_that_scale(name):
    """Two steps at scale 1024; the second is undone after the codec was told 2048 (the first optimizer's update grew
    it), then told 1024 again (the backoff): every residual (worker, and int8_rs's server ones) is exactly what it was
    before the undone step. Before, the record's copies were not rescaled with the live ones: they came back in 1024's
    units under a told 2048, and the backoff then halved them (every residual at half its value)."""
    def run(comm):
        c = MAKE[name]()
        c.track_undo()
        for step in range(2):
            if step == 1:
                before = _state(c)
            c.set_grad_scale(1024.0)
            g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * step + comm.rank))
            c.reduce(g * 1024.0, SEGMENTS, comm, step).wait()
        c.set_grad_scale(2048.0)  # the second optimizer's step, after the first one's update grew the scale
        assert c.undo_step()  # ... which the scaler skipped (an inf in its grads): back to 1024
        c.set_grad_scale(1024.0)  # the next step's
        return before, _state(c)

    for rank, (before, after) in enumerate(run_ranks(2, run)):
        assert before.keys() == after.keys() and all(v.abs().sum() > 0 for v in before["residuals"].values()), rank
        for kind in before:
            assert before[kind].keys() == after[kind].keys(), (rank, kind)
            for k, v in before[kind].items():
                assert torch.equal(after[kind][k], v), (name, rank, kind, k, (after[kind][k] / v).nanmean())
