"""int8/int4 through a quantized reduce-scatter + all-gather (``ShardedBlockQuantizer``), on 4 gloo processes.

One spawn of 4 ranks (module fixture) records what the tests check: the reduced bucket is identical on every
rank and within the two-rounding bound of the exact mean; the bytes each rank hands to collectives follow the
shard formula and, at 4 ranks, are about half of what the all-gather codec hands over the wire; two different
bucket layouts give bit-identical results and residuals; error feedback (worker and server) removes the bias of
a repeated gradient; with stochastic rounding the average of many reductions tends to the exact mean (both
roundings are stochastic). The 2-rank Lightning resume test is ``int8_rs`` in tests/dist/test_compressed_ddp_resume.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_dtrain.strategies import BlockQuantizer, Communicator, ShardedBlockQuantizer
from lit_dtrain.strategies.comm import _all_gather_single
from lit_dtrain.strategies.compressors import segments_from_shapes
from tests.conftest import free_port, leave_rank
from tests.dist._compressed_ddp_helpers import assert_same

pytestmark = pytest.mark.dist

WORLD = 4
BLOCK = 64
SHAPES = [("w1", (48, 16)), ("b1", (48,)), ("w2", (32, 48)), ("b2", (32,)), ("w3", (8, 32)), ("b3", (8,)),
          ("emb", (37, 5))]
SEGMENTS = segments_from_shapes(SHAPES)
NUMEL = sum(s.numel for s in SEGMENTS)
SR_STEPS = 200


def rank_grad(rank: int, step: int = 0) -> torch.Tensor:
    """Each parameter at its own scale, so blocks and ranks differ in range."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.cat([torch.randn(s.numel, generator=g) * 10.0 ** (i % 3 - 1) for i, s in enumerate(SEGMENTS)])


def split_layout(flat: torch.Tensor, cut: int):
    """The same parameters as two buckets, cut before parameter ``cut`` (another DDP bucket layout)."""
    first, second = SEGMENTS[:cut], SEGMENTS[cut:]
    base = second[0].offset
    second = [type(s)(s.name, s.offset - base, s.numel, s.shape) for s in second]
    return [(flat[:base].clone(), first), (flat[base:].clone(), second)]


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    comm, res = Communicator(), {}
    g = rank_grad(rank)
    for bits in (8, 4):
        c = ShardedBlockQuantizer(bits=bits, block_size=BLOCK)
        comm.take_step_record()
        res[f"int{bits}_rs"] = c.reduce(g.clone(), SEGMENTS, comm, 0).wait()
        res[f"int{bits}_rs_bytes"] = comm.take_step_record()["bytes"]
        res[f"int{bits}_rs_shard_bytes"] = [s.nbytes for s in c.shards(SEGMENTS, NUMEL, WORLD)]
    gathered = BlockQuantizer(bits=8, block_size=BLOCK)
    res["int8"] = gathered.reduce(g.clone(), SEGMENTS, comm, 0).wait()
    res["int8_bytes"] = comm.take_step_record()["bytes"]
    # the same steps on two bucket layouts, with error feedback: same values, same residuals
    for tag, cut in (("layout_a", 2), ("layout_b", 5)):
        c = ShardedBlockQuantizer(block_size=BLOCK, error_feedback=True, stochastic_rounding=True, seed=3)
        outs = []
        for step in range(3):
            flat = rank_grad(rank, step)
            outs.append(torch.cat([c.reduce(b, segs, comm, step).wait() for b, segs in split_layout(flat, cut)]))
        res[tag] = {"outs": torch.stack(outs), "state": c.state_dict()}
    # a repeated gradient: the time average of the reduced values, with and without error feedback
    for tag, ef in (("ef", True), ("no_ef", False)):
        c = ShardedBlockQuantizer(bits=4, block_size=BLOCK, error_feedback=ef)
        res[f"avg_{tag}"] = sum(c.reduce(g.clone(), SEGMENTS, comm, s).wait() for s in range(40)) / 40
    # stochastic rounding without error feedback: integers in [-7, 7] (int4's levels, scale 1), so the first rounding
    # is exact and the mean of 4 ranks falls on quarters, which only the second rounding can round
    c = ShardedBlockQuantizer(bits=4, block_size=BLOCK, stochastic_rounding=True, seed=5)
    quarters = torch.randint(-7, 8, (4 * BLOCK,), generator=torch.Generator().manual_seed(rank)).float()
    quarters[::BLOCK] = 7.0  # every block's scale is 1 on every rank, and so is its mean's
    res["sr_grid"] = quarters
    flat_segments = segments_from_shapes([("q", (4 * BLOCK,))])
    res["sr_avg"] = sum(c.reduce(quarters.clone(), flat_segments, comm, s).wait() for s in range(SR_STEPS)) / SR_STEPS
    # an overflow on rank 0 only (one value of w2 inf), after a finite step that left residuals on every rank
    c = ShardedBlockQuantizer(block_size=BLOCK, error_feedback=True)
    c.reduce(rank_grad(rank, 0), SEGMENTS, comm, 0).wait()
    before = c.state_dict()
    bad = rank_grad(rank, 1)
    if rank == 0:
        bad[SEGMENTS[2].offset] = float("inf")
    res["overflow"] = {"out": c.reduce(bad, SEGMENTS, comm, 1).wait(), "before": before, "after": c.state_dict()}
    # server residuals saved under another layout, resumed on zero gradients with no worker residual: the shares
    # of a parameter differ, some with as many values (emb, w3), so they must not be added (the output stays 0)
    c = ShardedBlockQuantizer(block_size=BLOCK // 2, error_feedback=True)
    c.reduce(g.clone(), SEGMENTS, comm, 0).wait()
    other_block = {**c.state_dict(), "residuals": {}}
    shares_at_2 = ShardedBlockQuantizer(block_size=BLOCK).shards(SEGMENTS, NUMEL, 2)[rank].ranges if rank < 2 else ()
    other_world = {
        **other_block,
        "server_layout": {"world_size": 2, "block_size": BLOCK},
        "server_residuals": {name: torch.ones(b - a) for name, a, b, *_ in shares_at_2},
    }
    for tag, state in (("other_block", other_block), ("other_world", other_world)):
        c = ShardedBlockQuantizer(block_size=BLOCK, error_feedback=True)
        c.load_state_dict(state)
        res[tag] = c.reduce(torch.zeros(NUMEL), SEGMENTS, comm, 1).wait()
    everyone = torch.empty(WORLD * NUMEL)
    _all_gather_single(everyone, g)
    res["local"] = everyone.view(WORLD, NUMEL)
    torch.save(res, f"{out}.rank{rank}")
    leave_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("rs") / "res.pt")
    mp.spawn(_worker, args=(free_port(), out), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("key", ["int8_rs", "int4_rs", "layout_a", "avg_ef", "sr_avg"])
def test_every_rank_holds_the_same_reduced_values(ranks, key):
    for r in range(1, WORLD):
        assert_same(ranks[r][key] if key != "layout_a" else ranks[r][key]["outs"],
                    ranks[0][key] if key != "layout_a" else ranks[0][key]["outs"], f"rank {r}")


@pytest.mark.parametrize(("name", "levels"), [("int8_rs", 127), ("int4_rs", 7)])
def test_error_is_within_the_two_roundings(ranks, name, levels):
    """Per block: the ranks' first roundings err by <= max_r max|block_r| / (2L) on the mean, the second by
    <= max|y| / (2L) with y the mean before it, and max|y| <= max|result| / (1 - 1/(2L))."""
    local, reduced = ranks[0]["local"], ranks[0][name]
    mean = local.mean(0)
    err = (reduced - mean).abs()
    for s in SEGMENTS:
        for b in range(s.offset, s.offset + s.numel, BLOCK):
            block = slice(b, min(b + BLOCK, s.offset + s.numel))
            first = local[:, block].abs().max() / (2 * levels)
            second = reduced[block].abs().max() / (1 - 1 / (2 * levels)) / (2 * levels)
            assert err[block].max() <= (first + second) * (1 + 1e-5) + 1e-9, (name, s.name, b)
    assert err.max() > 0


def test_bytes_follow_the_shards_and_halve_the_all_gather_codecs_wire_bytes(ranks):
    """Handed to collectives: the pieces of the other ranks' shards (all_to_all) plus one padded shard
    (all_gather). On a ring, all_gather puts (W-1) x its input on the wire: then int8 over 4 ranks sends 3P per
    rank, int8_rs about 1.5P."""
    for r, res in enumerate(ranks):
        for name in ("int8_rs", "int4_rs"):
            sizes = res[f"{name}_shard_bytes"]
            assert res[f"{name}_bytes"] == sum(sizes) - sizes[r] + max(sizes), (name, r)
    sizes = ranks[0]["int8_rs_shard_bytes"]
    payload = NUMEL + 4 * sum(math.ceil(s.numel / BLOCK) for s in SEGMENTS)
    assert sum(sizes) == payload and ranks[0]["int8_bytes"] == payload  # the same quantized bytes in total
    assert max(sizes) <= 1.3 * payload / WORLD  # shards are balanced
    wire_rs = sum(sizes) - sizes[0] + (WORLD - 1) * max(sizes)
    wire_gather = (WORLD - 1) * payload
    assert wire_rs < 0.6 * wire_gather
    assert 4 * NUMEL * 2 * (WORLD - 1) / WORLD / wire_rs > 3.0  # ring fp32 all-reduce sends > 3x more


def test_bucket_layout_does_not_change_values_or_residuals(ranks):
    """Owners and blocks follow parameters, not buckets: what a resume's first step (DDP's initial buckets) needs."""
    for res in ranks:
        assert_same(res["layout_a"]["outs"], res["layout_b"]["outs"], "outs")
        assert_same(res["layout_a"]["state"]["residuals"], res["layout_b"]["state"]["residuals"], "worker")
        assert_same(res["layout_a"]["state"]["server_residuals"], res["layout_b"]["state"]["server_residuals"],
                    "server")
    owned = [set(res["layout_a"]["state"]["server_residuals"]) for res in ranks]
    assert all(owned) and set().union(*owned) == {s.name for s in SEGMENTS}  # each rank serves some parameters


def test_error_feedback_removes_the_bias_of_a_repeated_gradient(ranks):
    """int4, same gradients for 40 steps: without error feedback every step errs the same way; with the worker and
    server residuals the errors cancel, and the average is >10x closer to the exact mean (measured: 0.067 against
    2.36)."""
    mean = ranks[0]["local"].mean(0)
    with_ef = (ranks[0]["avg_ef"] - mean).abs().max()
    without = (ranks[0]["avg_no_ef"] - mean).abs().max()
    assert with_ef < 0.1 * without, (with_ef, without)


def test_stochastic_rounding_of_the_mean_is_unbiased(ranks):
    """With ``stochastic_rounding`` both roundings are stochastic, so the average of many reductions of the same
    gradients tends to the exact mean. Here the ranks' values are on int4's grid (the first rounding is exact) and
    their mean on quarters of it: over 200 steps every value's average is within 0.2 of the mean (its noise: at most
    0.5 / sqrt(200) = 0.035 per value). Before, the mean was rounded to nearest: errs by 0.25 or 0.5 at every step."""
    exact = torch.stack([res["sr_grid"] for res in ranks]).mean(0)
    assert (exact != exact.round()).sum() > 100  # most means need the second rounding
    err = (ranks[0]["sr_avg"] - exact).abs()
    assert err.max() < 0.2, err.max()


def test_an_overflow_on_one_rank_reaches_every_rank_and_keeps_the_server_residuals(ranks):
    """Rank 0's bucket holds an inf: every rank decodes non-finite values (the GradScaler skips the step everywhere),
    rank 0 keeps its own residual, and every rank keeps its share's server residual, as the owner of the inf's block
    does: what it added to the mean was dropped with the step. Before, the owners of finite shards kept the error of
    the dropped step's mean instead."""
    for r, res in enumerate(ranks):
        out, before, after = res["overflow"]["out"], res["overflow"]["before"], res["overflow"]["after"]
        assert not torch.isfinite(out).all(), r
        assert before["server_residuals"], r  # the finite step left a server residual on every rank
        assert_same(after["server_residuals"], before["server_residuals"], f"rank {r} server")
    assert_same(ranks[0]["overflow"]["after"]["residuals"], ranks[0]["overflow"]["before"]["residuals"], "rank 0")


@pytest.mark.parametrize("tag", ["other_block", "other_world"])
def test_server_residuals_of_another_layout_are_not_added(ranks, tag):
    """A state saved at block size 32 (or at 2 ranks) and loaded at block size 64 on 4 ranks: a rank's share of a
    parameter covers other values, some of them as many. All its server residuals start from zero (also those of
    shares that happen to cover the same values). Before, a share with the same number of values got the residual
    of the other values (emb: rank 0's [2648, 2712) that of [2680, 2744) at block 32; rank 1's [2712, 2776) that
    of [2648, 2712) at 2 ranks)."""
    for r, res in enumerate(ranks):
        added = [s.name for s in SEGMENTS if res[tag][s.offset : s.offset + s.numel].any()]
        assert not added, (r, added)
