"""Compressors and local-update rules, in one process (no torch.distributed): error bounds, error feedback,
byte accounting, state round trips."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dtrain.strategies import (
    COMPRESSORS,
    LOCAL_UPDATES,
    BlockQuantizer,
    CommSession,
    DiLoCo,
    HalfPrecision,
    LocalSGD,
    LoopbackCommunicator,
    NoCompression,
    PowerSGD,
    ScaledSign,
    TopK,
    build_compressor,
    build_local_update,
)
from lit_dtrain.strategies.compressors import Segment, pack_payload, segments_from_shapes, unpack_payload
from lit_dtrain.strategies.sparsify import exact_topk_indices, pack_bits, topk_ratio_at, unpack_bits

SHAPES = [("w1", (48, 40)), ("b1", (40,)), ("w2", (40, 24)), ("emb", (13, 8, 3))]
SEGMENTS = segments_from_shapes(SHAPES)
NUMEL = sum(s.numel for s in SEGMENTS)


def grad(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUMEL, generator=g) * scale


def payload_bytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


# --- error bounds ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "unit_roundoff"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_precision_is_one_rounding(name, unit_roundoff):
    x = grad(0) * torch.logspace(-3, 3, NUMEL)  # six decades; the smallest are fp16 subnormals
    y = build_compressor(name).roundtrip(x)
    # round to nearest: relative error <= unit roundoff, absolute <= half the fp16 subnormal spacing 2^-24
    assert torch.all((y - x).abs() <= unit_roundoff * x.abs() + 2.0**-25)
    assert not torch.equal(y, x)  # it really did round


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 3000), block=st.sampled_from([2, 16, 256]), bits=st.sampled_from([8, 4]),
       seed=st.integers(0, 10_000))
def test_int_quantization_error_bound(numel, block, bits, seed):
    """Deterministic rounding errs by at most half a step: max|block| / (2 L), L = 127 or 7."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3
    q = BlockQuantizer(bits=bits, block_size=block)
    y = q.roundtrip(x)
    levels = 127 if bits == 8 else 7
    pad = (-numel) % block
    absmax = torch.cat([x, x.new_zeros(pad)]).view(-1, block).abs().amax(1)
    bound = (absmax / (2 * levels)).repeat_interleave(block)[:numel]
    assert torch.all((y - x).abs() <= bound * (1 + 1e-5) + 1e-12)


def test_int8_bytes_are_one_byte_plus_block_scales():
    q = BlockQuantizer(bits=8, block_size=256)
    x = torch.randn(10_000)
    payload = q.compress(x, [], 0)
    assert payload_bytes(payload) == 10_000 + 4 * 40  # 40 blocks (the last one's padding is not sent)
    assert 4 * 10_000 / payload_bytes(payload) > 3.9
    q4 = BlockQuantizer(bits=4, block_size=256)
    assert payload_bytes(q4.compress(x, [], 0)) == 5_000 + 4 * 40
    assert payload_bytes(q4.compress(x[:9_999], [], 0)) == 5_000 + 4 * 40  # odd count: one half-used byte


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_int_blocks_start_at_parameters_so_bucket_layout_does_not_matter(bits, stochastic):
    """DDP lays parameters out in one order for the first step after a start and another after it rebuilds its
    buckets; each parameter's decoded values must not depend on that, or a resumed run differs from the
    uninterrupted one. With stochastic rounding the noise was drawn over the bucket's flat layout (seeded by the
    call count, which also depends on the bucket count); it is now drawn per parameter."""
    q = BlockQuantizer(bits=bits, block_size=256, stochastic_rounding=stochastic)
    x = grad(7)
    permuted = [SEGMENTS[i] for i in (3, 0, 2, 1)]
    offsets, y = {}, []
    offset = 0
    for s in permuted:  # the same parameters, laid out in another order
        offsets[s.name] = offset
        y.append(x[s.offset : s.offset + s.numel])
        offset += s.numel
    y = torch.cat(y)
    other = segments_from_shapes([(s.name, s.shape) for s in permuted])
    a = q.decompress(q.compress(x, SEGMENTS, 0), SEGMENTS, NUMEL)
    q.num_calls += 3  # another bucket count before this one: the call count differs
    b = q.decompress(q.compress(y, other, 0), other, NUMEL)
    for s in SEGMENTS:
        assert torch.equal(a[s.offset : s.offset + s.numel], b[offsets[s.name] : offsets[s.name] + s.numel]), s.name
    assert (a - x).abs().max() > 0  # it did quantize
    # one scale per block of each parameter: 1920, 40, 960, 312 values -> 8 + 1 + 4 + 2 blocks
    assert q.compress(x, SEGMENTS, 0)[0].numel() == 15


@pytest.mark.parametrize("bits", [8, 4])
def test_int_values_equal_each_parameter_quantized_on_its_own(bits):
    """The codec works on views of runs of parameters; the result must equal quantizing every parameter alone,
    in zero-padded blocks of its own (mixed layout: whole-block parameters next to ragged ones, and a run of
    several whole-block parameters)."""
    block, levels = 16, (127 if bits == 8 else 7)
    shapes = [("a", (32,)), ("b", (16, 2)), ("c", (7,)), ("d", (48,)), ("e", (5, 5)), ("f", (16,)), ("g", (3,))]
    segments = segments_from_shapes(shapes)
    numel = sum(s.numel for s in segments)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(11)) * 2
    x[40:48] = 0  # an all-zero block
    q = BlockQuantizer(bits=bits, block_size=block)
    scales, _ = payload = q.compress(x, segments, 0)
    y = q.decompress(payload, segments, numel)
    expected, expected_scales = [], []
    for s in segments:
        v = x[s.offset : s.offset + s.numel]
        blocks = torch.cat([v, v.new_zeros((-v.numel()) % block)]).view(-1, block)
        scale = blocks.abs().amax(1) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        qv = torch.round(blocks / safe[:, None]).clamp(-levels, levels)
        expected.append((qv * scale[:, None]).view(-1)[: s.numel])
        expected_scales.append(scale)
    torch.testing.assert_close(scales, torch.cat(expected_scales), rtol=0, atol=0)
    torch.testing.assert_close(y, torch.cat(expected), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [8, 4])
def test_int_codec_handles_an_empty_buffer(bits):
    """An empty buffer is an empty payload (810ee52's views made compress fail on it: torch.cat of no blocks)."""
    q = BlockQuantizer(bits=bits, block_size=16)
    segments = [Segment("empty", 0, 0, (0, 3))]
    payload = q.compress(torch.empty(0), segments, 0)
    assert payload_bytes(payload) == 0
    assert q.decompress(payload, segments, 0).shape == (0,)
    assert q.roundtrip(torch.empty(0, 3)).shape == (0, 3)


def test_stochastic_rounding_noise_differs_by_rank_step_and_parameter():
    x = torch.full((512,), 0.5) * torch.linspace(0.1, 1.0, 512)
    segments = segments_from_shapes([("a", (256,)), ("b", (256,))])

    def draw(rank, step, segs=segments):
        q = BlockQuantizer(bits=4, block_size=64, stochastic_rounding=True)
        q.rank = rank
        return q.decompress(q.compress(x, segs, step), segs, 512)

    base = draw(0, 1)
    assert torch.equal(base, draw(0, 1))  # deterministic
    assert not torch.equal(base, draw(1, 1)) and not torch.equal(base, draw(0, 2))
    renamed = segments_from_shapes([("a", (256,)), ("c", (256,))])
    other = draw(0, 1, renamed)
    assert torch.equal(other[:256], base[:256]) and not torch.equal(other[256:], base[256:])


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    x = torch.randn(512) * 0.37
    q = BlockQuantizer(bits=4, block_size=64, stochastic_rounding=True)
    outs = []
    for step in range(400):
        q.num_calls = step  # the noise is seeded by (seed, step, call count, rank)
        outs.append(q.roundtrip(x, step=step))
    outs = torch.stack(outs)
    step_size = (x.view(-1, 64).abs().amax(1) / 7).repeat_interleave(64)
    assert torch.all((outs - x).abs() <= step_size * (1 + 1e-5))
    # mean of 400 draws: standard error <= step/(2*sqrt(400)) = step/40; allow 4 standard errors
    assert torch.all((outs.mean(0) - x).abs() <= step_size / 10)
    deterministic_error = (BlockQuantizer(bits=4, block_size=64).roundtrip(x) - x).abs().mean()
    assert (outs.mean(0) - x).abs().mean() < deterministic_error / 3  # averaging removes the bias


def test_topk_keeps_exactly_the_largest_and_counts_bytes():
    x = grad(1)
    c = TopK(ratio=0.05, error_feedback=False)
    payload = c.compress(x, SEGMENTS, 0)
    k = math.ceil(0.05 * NUMEL)
    assert payload_bytes(payload) == 8 * k
    y = c.decompress(payload, SEGMENTS, NUMEL)
    expected = torch.zeros_like(x)
    idx = x.abs().topk(k).indices
    expected[idx] = x[idx]
    assert torch.equal(y, expected)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(20_001, 200_000), ratio=st.floats(1e-4, 0.2), seed=st.integers(0, 1000))
def test_sampled_threshold_topk_is_exact(n, ratio, seed):
    a = torch.randn(n, generator=torch.Generator().manual_seed(seed)).abs()
    k = max(1, int(ratio * n))
    got = exact_topk_indices(a, k, seed)
    assert got.numel() == k
    assert torch.equal(a[got].sort().values, a.topk(k).values.sort().values)


def topk_sizes_of(monkeypatch, run):
    """``(run(), sizes)``: the result and the size of every tensor ``Tensor.topk`` was called on meanwhile."""
    sizes: list[int] = []
    real_topk = torch.Tensor.topk

    def recording_topk(self, *args, **kwargs):
        sizes.append(self.numel())
        return real_topk(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", recording_topk)
    try:
        return run(), sizes
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("seed", [28, 31, 59, 68])  # seeds whose sampled threshold lets fewer than k pass
def test_topk_whose_sample_overshoots_needs_no_topk_over_the_whole_bucket(monkeypatch, seed):
    """When fewer than k entries pass the sampled threshold (a small k * sample_size / n: 20 of 200k here, 12 seeds
    in 200), a lower threshold from the same sample is tried before a topk over the whole bucket (100-380 ms for 9.18M
    values). Its indices, in order, are the full topk's, so the payload is byte-identical to what was sent before."""
    n, k = 200_000, 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).abs()
    sample = x[torch.randint(0, n, (20_000,), generator=torch.Generator().manual_seed(seed))]
    assert (x >= torch.quantile(sample, 1 - 2 * k / n)).sum() < k  # the case this test is about
    expected = x.topk(k, sorted=False).indices
    got, topk_sizes = topk_sizes_of(monkeypatch, lambda: exact_topk_indices(x, k, seed))
    assert max(topk_sizes) < n // 10, topk_sizes
    assert torch.equal(got, expected)


@pytest.mark.parametrize("nonzeros", [0, 300, 15_000])  # all zero; fewer nonzeros than k; more, but under 2k
def test_topk_of_a_mostly_zero_bucket_is_exact_and_cheap(monkeypatch, nonzeros):
    """A (nearly) all-zero bucket makes the sampled threshold 0, which passed every entry to a topk over the
    whole bucket (230-300 ms for 9M values). Now the nonzeros are found in one pass and topk sees only them;
    the zeros that fill up ``k`` are the lowest-index ones (not always those topk picks among ties: any k zeros
    are a true top-k, and their values, 0, are what is sent)."""
    n, k = 1_000_000, 10_000
    g = torch.Generator().manual_seed(nonzeros)
    x = torch.zeros(n)
    where = torch.randperm(n, generator=g)[:nonzeros]
    x[where] = torch.randn(nonzeros, generator=g) + 0.5  # a few exact zeros among them are fine
    nonzero_set = set(x.nonzero().flatten().tolist())
    got, topk_sizes = topk_sizes_of(monkeypatch, lambda: exact_topk_indices(x.abs(), k, seed=3))
    assert got.numel() == k and got.unique().numel() == k
    assert max(topk_sizes, default=0) <= len(nonzero_set)  # never a topk over the bucket's zeros
    if len(nonzero_set) <= k:  # every nonzero, then the lowest-index zeros
        zeros = [i for i in range(n) if i not in nonzero_set][: k - len(nonzero_set)]
        assert sorted(got.tolist()) == sorted(nonzero_set | set(zeros))
    assert torch.equal(x.abs()[got].sort().values, x.abs().topk(k).values.sort().values)  # the true top-k
    c = TopK(ratio=k / n, error_feedback=True)
    segments = [Segment("p", 0, n, (n,))]
    values, indices = c.compress(x, segments, 0)
    assert torch.equal(values, x[indices.long()])
    sent = c.decompress([values, indices], segments, n)
    if len(nonzero_set) <= k:
        assert torch.equal(sent, x)  # nothing dropped, so error feedback keeps a zero residual
    else:
        assert (sent != 0).sum() == k and torch.equal(sent[sent != 0], x[sent != 0])


@pytest.mark.parametrize("path", ["full", "threshold", "mostly_zero", "many_nan"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_topk_sends_a_non_finite_entry_on_every_selection_path(path, bad):
    """A bucket with a NaN/inf must decode non-finite on every rank (so the GradScaler skips the step, or LitLLM stops
    with NonFiniteError), as every other codec sends such a bucket as it is. ``topk`` ranks NaN first, but the sampled
    threshold's ``magnitude >= threshold`` is False for NaN: a NaN the sample missed was dropped there, and the step
    went on with a finite gradient on the threshold path only."""
    n = {"full": 5_000, "threshold": 200_000, "mostly_zero": 200_000, "many_nan": 200_000}[path]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, generator=g) if path != "mostly_zero" else torch.zeros(n)
    if path == "mostly_zero":
        x[torch.randperm(n, generator=g)[:150]] = 1.0 + torch.rand(150, generator=g)  # < 2k: threshold 0
    where = torch.randperm(n, generator=g)[: 400 if path == "many_nan" else 3]  # 400 > k: at least k are sent
    x[where] = bad
    c = TopK(ratio=0.001, error_feedback=True)
    k = c.k_at(n, 0)
    values, indices = c.compress(x, [Segment("p", 0, n, (n,))], 0)
    assert values.numel() == k
    if where.numel() <= k:
        assert set(where.tolist()) <= set(indices.tolist()), (path, bad)
    else:
        assert not values.isfinite().any(), (path, bad)
    out = c.reduce(x.clone(), [Segment("p", 0, n, (n,))], LoopbackCommunicator(), 0).wait()
    assert not out.isfinite().all(), (path, bad)
    assert all(v.isfinite().all() for v in c.residuals.values())  # a non-finite bucket leaves the residual alone


def test_topk_resumed_on_ddps_initial_bucket_selects_within_the_saved_buckets():
    """DDP runs a start's first step on one bucket and rebuilds its buckets after it. Top-k selects per bucket, so a
    resumed run's first step (one bucket holding two saved buckets) selected across their boundary and the run left
    the uninterrupted one (0.0093 in a 2-rank run with 4 KB buckets). Restored, it selects within each saved bucket:
    the same values, the same residual, the same later steps. With one saved bucket nothing changes."""
    comm = LoopbackCommunicator()
    a, b = SEGMENTS[:2], SEGMENTS[2:]  # two DDP buckets after the rebuild, each laid out from offset 0
    na = sum(s.numel for s in a)
    bucket_b = [Segment(s.name, s.offset - na, s.numel, s.shape) for s in b]

    def step_two_buckets(c, g, step):
        return torch.cat([c.reduce(g[:na].clone(), a, comm, step).wait(), c.reduce(g[na:].clone(), bucket_b, comm,
                                                                                   step).wait()])

    straight = TopK(ratio=0.05)
    for step in range(3):
        step_two_buckets(straight, grad(step), step)
    state = straight.state_dict()
    assert state["bucket_layout"] == [["w1", "b1"], ["w2", "emb"]]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = TopK(ratio=0.05)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    # DDP's initial bucket holds every parameter, in another order: emb, w2, b1, w1
    order = [SEGMENTS[3], SEGMENTS[2], SEGMENTS[1], SEGMENTS[0]]
    initial, offset = [], 0
    for s in order:
        initial.append(Segment(s.name, offset, s.numel, s.shape))
        offset += s.numel

    def to_initial(flat):
        return torch.cat([flat[s.offset : s.offset + s.numel] for s in order])

    def from_initial(flat):
        out = torch.empty_like(flat)
        for s, t in zip(order, initial):
            out[s.offset : s.offset + s.numel] = flat[t.offset : t.offset + t.numel]
        return out

    expected = step_two_buckets(straight, grad(3), 3)
    got = from_initial(resumed.reduce(to_initial(grad(3)), initial, comm, 3).wait())
    assert torch.equal(got, expected)
    assert resumed.num_calls == straight.num_calls
    layout = resumed.state_dict()["bucket_layout"]  # a resume of a resume splits too
    assert sorted(layout) == [["w1", "b1"], ["w2", "emb"]]
    for step in range(4, 6):  # the rebuilt buckets from here on
        assert torch.equal(step_two_buckets(resumed, grad(step), step), step_two_buckets(straight, grad(step), step))
    # before: one selection over the whole initial bucket, across the saved buckets' boundary
    whole = TopK(ratio=0.05)
    assert not torch.equal(from_initial(whole.reduce(to_initial(grad(3)), initial, comm, 3).wait()), expected)

    # one saved bucket (the default 25 MB holds every gradient): the resumed step is the plain selection
    one = TopK(ratio=0.05)
    one.reduce(grad(0), SEGMENTS, comm, 0).wait()
    one_resumed, plain = TopK(ratio=0.05), TopK(ratio=0.05)
    one_resumed.load_state_dict(one.state_dict())
    plain.load_state_dict({k: v for k, v in one.state_dict().items() if k != "bucket_layout"})  # an older file
    assert torch.equal(one_resumed.reduce(grad(1), SEGMENTS, comm, 1).wait(), plain.reduce(grad(1), SEGMENTS, comm,
                                                                                           1).wait())


def test_session_reduces_the_first_bucket_after_a_restore_as_the_saved_buckets():
    """On 3+ ranks an all-reduce sums in an order set by a value's place in the buffer, so the first step after a
    restore (DDP's initial bucket: every parameter, another order) is reduced as the saved buckets, each laid out as
    saved; a bucket that is not a union of them (another size) is reduced as it is. Checked here by what the codec
    is handed; tests/dist/test_compressed_ddp.py::test_resume_restores_comm_state_exactly[powersgd_3_ranks] checks
    the resumed run on 3 ranks."""
    a, b = SEGMENTS[:2], SEGMENTS[2:]
    na = sum(s.numel for s in a)
    saved = [[[s.name, s.offset, s.numel] for s in a], [[s.name, s.offset - na, s.numel] for s in b]]
    order = [SEGMENTS[3], SEGMENTS[2], SEGMENTS[1], SEGMENTS[0]]  # DDP's initial bucket: emb, w2, b1, w1
    initial, offset = [], 0
    for s in order:
        initial.append(Segment(s.name, offset, s.numel, s.shape))
        offset += s.numel

    class Recording(NoCompression):
        def reduce(self, flat, segments, comm, step):
            self.seen.append((flat.clone(), [(s.name, s.offset, s.numel) for s in segments]))
            return super().reduce(flat, segments, comm, step)

    def restored(layout):
        session = CommSession(Recording(), comm=LoopbackCommunicator())
        session.compressor.seen = []
        session.load_counters_state_dict({"step": 3, "hook_calls": 6, "total_bytes": 0, "total_dense_bytes": 0,
                                          "total_time_ms": 0.0, "bucket_layout": layout})
        return session

    g = grad(3)
    bucket = torch.cat([g[s.offset : s.offset + s.numel] for s in order])
    session = restored(saved)
    out = session.reduce_bucket(bucket.clone(), initial).wait()
    assert torch.equal(out, bucket)  # one rank: the mean is the gradient, each value back in its place
    assert [layout for _, layout in session.compressor.seen] == [[tuple(e) for e in part] for part in saved]
    assert torch.equal(session.compressor.seen[0][0], g[:na]) and torch.equal(session.compressor.seen[1][0], g[na:])
    assert session.hook_calls == 7 and session.counters_state_dict()["bucket_layout"] == saved
    session.after_optimizer_step([])  # from the second step on the buckets are DDP's rebuilt ones, as they come
    session.reduce_bucket(bucket.clone(), initial).wait()
    assert session.compressor.seen[-1][1] == [(s.name, s.offset, s.numel) for s in initial]

    other_size = [[[n, o, k + 1] for n, o, k in saved[0]], saved[1]]  # not this model's buckets
    session = restored(other_size)
    session.reduce_bucket(bucket.clone(), initial).wait()
    assert [layout for _, layout in session.compressor.seen] == [[(s.name, s.offset, s.numel) for s in initial]]


def test_topk_records_its_buckets_during_the_uncompressed_warmup_too():
    """A checkpoint written at the end of ``start_step``'s fp32 warm-up resumes into a compressed step on DDP's initial
    bucket: the buckets of the warm-up steps must be in the state (before: empty, so that step selected across them)."""
    comm = LoopbackCommunicator()
    c = TopK(ratio=0.05, start_step=2)
    na = SEGMENTS[0].numel + SEGMENTS[1].numel
    bucket_b = [Segment(s.name, s.offset - na, s.numel, s.shape) for s in SEGMENTS[2:]]
    for step in range(2):
        c.reduce(grad(step)[:na].clone(), SEGMENTS[:2], comm, step).wait()
        c.reduce(grad(step)[na:].clone(), bucket_b, comm, step).wait()
    assert comm.take_step_record()["sent_log"] == [("all_reduce", 4 * na), ("all_reduce", 4 * (NUMEL - na))] * 2
    assert c.state_dict()["bucket_layout"] == [["w1", "b1"], ["w2", "emb"]]


def test_dynamic_topk_ratio_schedule():
    assert topk_ratio_at(0, 0.01, 0.25, 100) == pytest.approx(0.25)
    assert topk_ratio_at(50, 0.01, 0.25, 100) == pytest.approx(0.05)  # geometric mean
    assert topk_ratio_at(100, 0.01, 0.25, 100) == 0.01
    assert topk_ratio_at(7, 0.01, None, 100) == 0.01
    c = TopK(ratio=0.01, initial_ratio=0.25, ratio_warmup_steps=100)
    ks = [c.k_at(10_000, s) for s in range(0, 120, 10)]
    assert ks[0] == 2500 and ks[-1] == 100 and ks == sorted(ks, reverse=True)


def test_scaled_sign_keeps_signs_and_per_parameter_l1():
    x = grad(2) * torch.linspace(0.1, 10, NUMEL)
    c = ScaledSign(error_feedback=False)
    payload = c.compress(x, SEGMENTS, 0)
    assert payload_bytes(payload) == math.ceil(NUMEL / 8) + 4 * len(SEGMENTS)
    y = c.decompress(payload, SEGMENTS, NUMEL)
    assert torch.equal(y.sign(), torch.where(x >= 0, 1.0, -1.0))
    for s in SEGMENTS:
        sl = slice(s.offset, s.offset + s.numel)
        assert y[sl].abs().sum() == pytest.approx(x[sl].abs().sum().item(), rel=1e-5)


def test_bit_and_payload_packing_round_trip():
    mask = torch.rand(1001) > 0.5
    assert pack_bits(mask).numel() == 126
    assert torch.equal(unpack_bits(pack_bits(mask), 1001), mask)
    parts = [torch.randn(3), torch.arange(5, dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.uint8)]
    back = unpack_payload(pack_payload(parts), parts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(parts, back))


def test_powersgd_is_exact_on_low_rank_matrices_and_counts_bytes():
    g = torch.Generator().manual_seed(3)
    x = torch.zeros(NUMEL)
    for s in SEGMENTS:
        if len(s.shape) >= 2:
            n, m = s.shape[0], s.numel // s.shape[0]
            low_rank = torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g)
            x[s.offset : s.offset + s.numel] = low_rank.view(-1)
        else:
            x[s.offset : s.offset + s.numel] = torch.randn(s.numel, generator=g)
    c = PowerSGD(matrix_approximation_rank=2, error_feedback=False, warm_start=False)
    comm = LoopbackCommunicator()
    out = c.reduce(x.clone(), SEGMENTS, comm, step=0).wait()
    assert torch.allclose(out, x, atol=1e-4, rtol=1e-4)
    compressed, uncompressed = c.plan(SEGMENTS)
    # emb (13 x 24, r=2): 13*24 = 312 > 2 * (13+24) * 2 = 148 -> compressed; b1 is a vector
    assert [s.name for s, *_ in compressed] == ["w1", "w2", "emb"] and [s.name for s in uncompressed] == ["b1"]
    expected = 4 * (40 + sum((n + m) * r for _, n, m, r in compressed))
    assert comm.take_step_record()["bytes"] == expected == 4 * c.payload_numel(SEGMENTS)


def test_powersgd_over_two_ranks_returns_the_mean_of_low_rank_gradients():
    """Both rounds are sums over ranks: the uncompressed vectors and the Qs must be divided by the world size
    (with one rank, as elsewhere in this file, that division is invisible). The other rank holds 3x, whose
    payloads are 3 times this rank's in both rounds; the mean 2x is rank 2, so PowerSGD returns it exactly."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(NUMEL, generator=g)
    for seg in SEGMENTS:
        if len(seg.shape) >= 2:
            n, m = seg.shape[0], seg.numel // seg.shape[0]
            low_rank = torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g)
            x[seg.offset : seg.offset + seg.numel] = low_rank.view(-1)
    c = PowerSGD(matrix_approximation_rank=2, error_feedback=False, warm_start=False)
    out = c.reduce(x.clone(), SEGMENTS, TwoRankComm(lambda t: 3 * t), step=0).wait()
    torch.testing.assert_close(out, 2 * x, atol=1e-4, rtol=1e-4)


def test_powersgd_skips_matrices_that_would_not_shrink():
    c = PowerSGD(matrix_approximation_rank=4, min_compression_rate=2.0)
    segs = segments_from_shapes([("tiny", (6, 5)), ("big", (64, 64))])
    compressed, uncompressed = c.plan(segs)
    assert [s.name for s, *_ in compressed] == ["big"] and [s.name for s in uncompressed] == ["tiny"]


def test_uncompressed_warmup_steps_send_fp32():
    comm = LoopbackCommunicator()
    c = TopK(ratio=0.01, start_step=2)
    for step in range(3):
        c.reduce(grad(step), SEGMENTS, comm, step).wait()
        assert comm.take_step_record()["bytes"] == (4 * NUMEL if step < 2 else 8 * math.ceil(0.01 * NUMEL))


# --- error feedback ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["topk", "sign", "int4_ef", "powersgd"])
def test_error_feedback_sum_of_updates_tracks_sum_of_gradients(name):
    """sum_t decoded_t = sum_t g_t - e_T exactly, and the residual e_T stays bounded (does not grow with T)."""
    factory = {
        "topk": lambda: TopK(ratio=0.1),
        "sign": lambda: ScaledSign(),
        "int4_ef": lambda: BlockQuantizer(bits=4, error_feedback=True),
        "powersgd": lambda: PowerSGD(matrix_approximation_rank=1),
    }[name]
    c = factory()
    comm = LoopbackCommunicator()
    sent, true, residual_norms = torch.zeros(NUMEL), torch.zeros(NUMEL), []
    for step in range(60):
        g = grad(100 + step) + 0.5  # a persistent mean direction, as real gradients have
        true += g
        sent += c.reduce(g.clone(), SEGMENTS, comm, step).wait()
        residual_norms.append(c.residual_for(SEGMENTS, g).norm().item())
    residual = c.residual_for(SEGMENTS, sent)
    assert torch.allclose(sent + residual, true, rtol=1e-4, atol=1e-3)
    g_norm = grad(0).add(0.5).norm().item()
    # bounded: the last residuals are no larger than the early ones plus slack, and far below T * |g|
    assert max(residual_norms[-10:]) < 2 * max(residual_norms[:20]) + 1e-6
    assert max(residual_norms) < 20 * g_norm
    # and error feedback helps: the running sum is far closer to the truth than without it (measured ratios:
    # topk 0.11, sign 0.09, int4 0.12; rank-1 PowerSGD on full-rank noise, its worst case, 0.56)
    c_no_ef = factory()
    c_no_ef.error_feedback = False
    sent_no_ef = sum(c_no_ef.reduce(grad(100 + s) + 0.5, SEGMENTS, comm, s).wait() for s in range(60))
    assert (sent - true).norm() < (0.7 if name == "powersgd" else 0.2) * (sent_no_ef - true).norm()


# --- state --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_state_dict_round_trip_continues_identically(name):
    spec = {"name": name}
    if name in ("int8", "int4"):
        spec.update(stochastic_rounding=True, error_feedback=True)
    a = build_compressor(spec)
    comm = LoopbackCommunicator()
    for step in range(3):
        a.reduce(grad(step), SEGMENTS, comm, step).wait()
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = build_compressor(spec)
    b.load_state_dict(torch.load(buffer, weights_only=True))  # plain tensors/ints/strings only
    assert b.num_calls == a.num_calls == 3
    for step in range(3, 6):
        assert torch.equal(a.reduce(grad(step), SEGMENTS, comm, step).wait(),
                           b.reduce(grad(step), SEGMENTS, comm, step).wait())
    if name == "powersgd":
        assert set(b.q_memory) == {"w1", "w2", "emb"}


def assert_same_steps(a, b, comm, steps) -> None:
    """``a`` and ``b`` reduce ``grad(step)`` to bitwise the same values at each of ``steps``."""
    for step in steps:
        x, y = (c.reduce(grad(step), SEGMENTS, comm, step).wait() for c in (a, b))
        assert torch.equal(x, y), (a, step)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_undo_step_erases_a_dropped_step_exactly(name):
    """A step dropped after its comm hook ran (a loss spike) leaves no trace: with ``track_undo`` the later
    steps equal those of a compressor that never saw it, bit for bit (residuals and PowerSGD's warm start)."""
    spec = {"name": name}
    if name in ("int8", "int4"):
        spec.update(stochastic_rounding=True, error_feedback=True)
    clean, spiked = build_compressor(spec), build_compressor(spec)
    spiked.track_undo()
    comm = LoopbackCommunicator()
    assert_same_steps(clean, spiked, comm, range(3))
    spiked.reduce(grad(99, scale=1e4), SEGMENTS, comm, 3).wait()  # the spike's step, then dropped
    assert spiked.undo_step()
    assert not spiked.undo_step()  # one step's state is kept, and it is used up
    # the clean compressor skips step number 3, as the strategy's counter does not
    assert_same_steps(clean, spiked, comm, range(4, 7))
    if spiked.error_feedback:  # ... and without the undo the spike would leak into the next step
        leaky = build_compressor(spec)
        for step in range(3):
            leaky.reduce(grad(step), SEGMENTS, comm, step).wait()
        leaky.reduce(grad(99, scale=1e4), SEGMENTS, comm, 3).wait()
        assert leaky.reduce(grad(4), SEGMENTS, comm, 4).wait().norm() > 10 * grad(4).norm()


EF_OR_WARM_START = ["fp16_ef", "int4", "topk", "sign", "powersgd", "powersgd_no_ef"]


def build_ef_or_warm_start(name):
    return {"fp16_ef": lambda: HalfPrecision("fp16", error_feedback=True),
            "powersgd_no_ef": lambda: PowerSGD(error_feedback=False)}.get(name, lambda: build_compressor(name))()


@pytest.mark.parametrize("name", ["fp16_ef", "int4", "topk", "sign", "powersgd"])
def test_undo_of_a_step_whose_hook_ran_twice_puts_back_the_state_from_before_the_first(name):
    """Gradient accumulation without ``no_sync`` (a manual loop that syncs every micro-batch) runs the comm hook once
    per micro-batch within one optimizer step. ``undo_step`` after that step is skipped must give back the state from
    before the step's first reduce, not from between its micro-batches: the residual of the first micro-batch is as
    much the skipped step's as that of the second."""
    clean, skipped = build_ef_or_warm_start(name), build_ef_or_warm_start(name)
    skipped.track_undo()
    comm = LoopbackCommunicator()
    assert_same_steps(clean, skipped, comm, range(3))
    for micro in range(2):  # step 3: two micro-batches, each through the hook; then the step is skipped
        skipped.reduce(grad(50 + micro), SEGMENTS, comm, 3).wait()
    assert skipped.undo_step()
    assert_same_steps(clean, skipped, comm, range(4, 7))


@pytest.mark.parametrize("name", EF_OR_WARM_START)
def test_an_overflowed_step_does_not_poison_later_steps(name):
    """Under ``16-mixed`` the GradScaler skips a step whose gradients overflowed (routine in the first steps). Its
    non-finite bucket must still come out non-finite (so the scaler sees it), but must leave the error-feedback
    residual and PowerSGD's warm-start Q as they were: later steps equal those of a compressor that never saw it.
    (Before: inf - inf put NaN in the residual / Q, and every later step decoded to NaN, so every later step was
    skipped too.)"""
    clean, hit = build_ef_or_warm_start(name), build_ef_or_warm_start(name)
    comm = LoopbackCommunicator()
    for step in range(3):
        clean.reduce(grad(step), SEGMENTS, comm, step).wait()
        hit.reduce(grad(step), SEGMENTS, comm, step).wait()
    overflow = grad(99)
    overflow[[5, 2000]] = torch.tensor([float("inf"), float("nan")])
    assert not hit.reduce(overflow, SEGMENTS, comm, 3).wait().isfinite().all()
    for step in range(4, 7):
        out = hit.reduce(grad(step), SEGMENTS, comm, step).wait()
        assert out.isfinite().all(), (name, step)
        assert torch.equal(out, clean.reduce(grad(step), SEGMENTS, comm, step).wait()), (name, step)


def test_finiteness_check_is_exact_when_the_sum_overflows():
    """``all_finite`` reads the bucket's sum; a finite bucket whose sum overflows fp32 must still count as
    finite, and any NaN/inf as not (before: 8 values of 1e38, sum 8e38 > fp32 max, answered False)."""
    from lit_dtrain.strategies.compressors import all_finite

    big = torch.zeros(1000)
    big[:8] = 1e38
    assert math.isinf(float(big.sum())) and all_finite(big)
    assert all_finite(-big) and all_finite(torch.tensor([3e38, -3e38, 3e38]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = big.clone()
        x[500] = bad
        assert not all_finite(x), bad
        assert not all_finite(torch.tensor([1.0, bad, 2.0])), bad
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # sums to NaN


@pytest.mark.parametrize("name", ["topk", "sign", "int4", "int8_ef"])
def test_a_finite_bucket_whose_sum_overflows_keeps_its_error_feedback(name):
    """Two values of 1e38 in each parameter: every value and every per-parameter sum is finite, the bucket's sum
    (8e38) is not. Error feedback must still run: the residual is ``g - decoded`` (before: it stayed 0, the step's
    compression error was dropped, as for a real overflow)."""
    c = build_compressor({"name": "int8", "error_feedback": True} if name == "int8_ef" else name)
    g = grad(5)
    for s in SEGMENTS:
        g[s.offset : s.offset + 2] = 1e38
    assert math.isinf(float(g.sum()))
    out = c.reduce(g.clone(), SEGMENTS, LoopbackCommunicator(), 0).wait()
    assert out.isfinite().all()
    residual = c.residual_for(SEGMENTS, g)
    assert residual.abs().sum() > 0
    torch.testing.assert_close(residual, g - out, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["fp16_ef", "int4", "int8_ef", "topk", "sign", "powersgd"])
def test_error_feedback_follows_a_gradscaler_change_of_scale(name):
    """Under ``16-mixed`` the buckets hold ``scale * g`` and the GradScaler halves the scale after an overflow. The
    residual, made under the old scale, must be halved too: then every decoded step divided by its scale equals that
    of a run whose scale never changed (the codecs commute with powers of two). Without ``set_grad_scale`` (before:
    the strategy never told the codec) the old residual is added at twice its value."""
    make = {"fp16_ef": lambda: HalfPrecision("fp16", error_feedback=True),
            "int8_ef": lambda: BlockQuantizer(bits=8, error_feedback=True)}.get(name, lambda: build_compressor(name))
    comm = LoopbackCommunicator()
    steady, halved, unaware = make(), make(), make()
    for step in range(6):
        scale = 1024.0 if step < 3 else 512.0
        steady.set_grad_scale(1024.0)
        halved.set_grad_scale(scale)
        a = steady.reduce(grad(step) * 1024.0, SEGMENTS, comm, step).wait() / 1024.0
        b = halved.reduce(grad(step) * scale, SEGMENTS, comm, step).wait() / scale
        c = unaware.reduce(grad(step) * scale, SEGMENTS, comm, step).wait() / scale
        assert torch.equal(a, b), (name, step)
        if step >= 3:
            assert not torch.equal(a, c), (name, step)
    assert halved.grad_scale == 512.0
    restored = make()
    restored.load_state_dict(halved.state_dict())  # the scale the residuals are in is part of the state
    assert restored.grad_scale == 512.0


@pytest.mark.parametrize("name", ["fp16_ef", "topk_fp16"])
def test_a_payload_that_overflows_its_dtype_leaves_a_finite_residual(name):
    """A finite fp32 gradient above fp16's 65504 (under 16-mixed: any |g| > 1 at the initial loss scale of 65536)
    decodes as inf. The bucket still comes out non-finite (the GradScaler skips the step), and the residual goes back
    to ``e`` (up to one rounding of ``g + e``) instead of ``g + e - inf``: later steps decode finite, close to a codec
    that never saw the step. (Before: -inf in the residual and every later step inf, so under 16-mixed every later
    step was skipped.)"""
    make = {"fp16_ef": lambda: HalfPrecision("fp16", error_feedback=True),
            "topk_fp16": lambda: TopK(ratio=0.1, value_dtype="fp16")}[name]
    comm = LoopbackCommunicator()
    c, clean = make(), make()
    for step in range(2):
        c.reduce(grad(step), SEGMENTS, comm, step).wait()
        clean.reduce(grad(step), SEGMENTS, comm, step).wait()
    e = c.residual_for(SEGMENTS, grad(0))
    big = grad(2)
    big[7] = 1e5
    assert big.isfinite().all()
    assert not c.reduce(big.clone(), SEGMENTS, comm, 2).wait().isfinite().all()
    residual = c.residual_for(SEGMENTS, big)
    assert residual.isfinite().all()
    assert (residual - e).abs().max() <= 2.0**-23 * (e + big).abs().max()  # the step is dropped: e, up to rounding
    for step in range(3, 6):
        out = c.reduce(grad(step), SEGMENTS, comm, step).wait()
        assert out.isfinite().all(), step
        torch.testing.assert_close(out, clean.reduce(grad(step), SEGMENTS, comm, step).wait(), rtol=1e-2, atol=1e-2)


def test_powersgd_with_another_rank_overflowed_keeps_what_it_could_not_send():
    """The other rank's gradient overflowed: the all-reduced P is non-finite on this rank too. Nothing usable was
    delivered, so this rank's residual becomes all of ``g + e`` (finite), and the replicated warm-start Q is kept."""
    inf_other = [True]
    comm = TwoRankComm(lambda t: torch.full_like(t, float("inf")) if inf_other[0] else t.clone())
    c = PowerSGD(matrix_approximation_rank=2)
    inf_other[0] = False
    c.reduce(grad(0), SEGMENTS, comm, 0).wait()
    q_before = {k: v.clone() for k, v in c.q_memory.items()}
    e_before = c.residual_for(SEGMENTS, grad(0))
    inf_other[0] = True
    assert not c.reduce(grad(1), SEGMENTS, comm, 1).wait().isfinite().all()
    assert torch.equal(c.residual_for(SEGMENTS, grad(0)), e_before + grad(1))
    assert set(c.q_memory) == set(q_before) and all(torch.equal(c.q_memory[k], q_before[k]) for k in q_before)
    inf_other[0] = False
    assert c.reduce(grad(2), SEGMENTS, comm, 2).wait().isfinite().all()


@pytest.mark.parametrize("name", ["fp16_ef", "int4", "topk", "sign", "powersgd"])
def test_undo_after_another_ranks_overflow_is_as_if_the_step_never_happened(name):
    """Rank 0 of 2, its own gradient finite, rank 1's payload non-finite at step 3: the step is skipped everywhere.
    Without the undo, the codecs' per-bucket rules leave different things (PowerSGD keeps all of ``g + e``, top-k and
    sign the unsent part of it), and part of the discarded gradient is applied in the next steps (PowerSGD: 0.41 of
    rank 0's share g / 2 over 4 steps). ``track_undo`` + ``undo_step`` after the skip (what CompressedDDPStrategy
    does under 16-mixed) makes every codec's next steps bitwise those of a codec that never saw the step."""
    make = {
        "fp16_ef": lambda: HalfPrecision("fp16", error_feedback=True),
        "powersgd": lambda: PowerSGD(matrix_approximation_rank=2),
    }.get(name, lambda: build_compressor(name))
    bad = grad(98)
    bad[5] = float("inf")

    def run(skip: str) -> list[torch.Tensor]:
        c, other_rank = make(), make()
        c.track_undo()
        overflow = [False]
        if c.collective == "all_gather" and not isinstance(c, PowerSGD):
            comm = TwoRankGatherComm(
                lambda t: pack_payload(other_rank.compress(bad.clone(), SEGMENTS, 0)) if overflow[0] else t.clone()
            )
        else:
            comm = TwoRankComm(lambda t: torch.full_like(t, float("inf")) if overflow[0] else t.clone())
        outs = []
        for step in range(8):
            if step == 3 and skip != "never":
                overflow[0] = True
                assert not c.reduce(grad(99), SEGMENTS, comm, step).wait().isfinite().all()
                overflow[0] = False
                if skip == "undone":
                    assert c.undo_step()
            elif step != 3:
                outs.append(c.reduce(grad(step), SEGMENTS, comm, step).wait())
        return outs

    never, undone = run("never"), run("undone")
    for step, (a, b) in enumerate(zip(never, undone)):
        assert torch.equal(a, b), (name, step)
    if name == "powersgd":  # without the undo: a good part of the discarded gradient reaches the model
        kept = run("kept")
        applied = (sum(kept[3:]) - sum(never[3:])) @ grad(99) / grad(99).square().sum()
        assert applied > 0.3, applied


def test_compressor_names_build_what_their_presets_configure():
    """``compressor="int4"`` (Python) and ``strategy=ddp_compressed/int4`` (Hydra) are the same codec."""
    from omegaconf import OmegaConf

    from tests.conftest import CONF_DIR

    for preset in sorted((Path(CONF_DIR) / "strategy" / "ddp_compressed").glob("*.yaml")):
        node = OmegaConf.load(preset).get("compressor")
        if not node or "_target_" not in node:
            continue
        from hydra.utils import instantiate

        configured = instantiate(node)
        by_name = build_compressor(preset.stem) if preset.stem in COMPRESSORS else None
        if by_name is not None:
            assert repr(by_name) == repr(configured), preset.stem


def test_loading_another_compressors_state_fails_loudly():
    with pytest.raises(ValueError, match="'topk'"):
        ScaledSign().load_state_dict(TopK().state_dict())


def test_builders_reject_unknown_names_and_keys():
    with pytest.raises(ValueError, match="unknown compressor 'lz4'"):
        build_compressor("lz4")
    with pytest.raises(ValueError, match="compressor.ration is not an argument .*did you mean 'compressor.ratio'"):
        build_compressor({"name": "topk", "ration": 0.1})
    with pytest.raises(ValueError, match="ratio must be in"):
        TopK(ratio=0.0)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        BlockQuantizer(bits=2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        HalfPrecision(dtype="fp8")
    d = build_local_update({"name": "diloco", "sync_period": 4, "compressor": "int8"})
    assert isinstance(d, DiLoCo) and isinstance(d.compressor, BlockQuantizer)



def test_a_mapping_given_in_python_has_its_flags_and_numbers_type_checked():
    """Only a config's mapping was type-checked: CompressedDDPStrategy(compressor={"name": "topk", "error_feedback":
    "no"}) trained with error feedback on (bool('no') is true). One check serves both forms now."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.raises(ConfigError, match=r"^compressor.error_feedback must be true or false, got 'no' \(str\)$"):
        CompressedDDPStrategy(compressor={"name": "topk", "error_feedback": "no"})
    with pytest.raises(ConfigError, match=r"^compressor.ratio must be a number, got '0.1' \(str\)$"):
        build_compressor({"name": "topk", "ratio": "0.1"})
    with pytest.raises(ConfigError, match=r"^local_update.nesterov must be true or false, got 1 \(int\)$"):
        build_local_update({"name": "diloco", "nesterov": 1})
    assert not build_compressor({"name": "topk", "error_feedback": False, "ratio": 1}).error_feedback


def test_numpy_numbers_given_in_python_are_taken_as_python_numbers():
    """A number read from a numpy array was refused where an integer is asked: build_compressor({"name": "powersgd",
    "matrix_approximation_rank": np.int64(2)}) raised 'must be an integer, got np.int64(2) (int64)', and
    make_ddp(collective_timeout_s=np.int64(60)) 'must be a number of seconds > 0'. They are taken, as Python's int
    and float (the codec's state holds no numpy scalar); a bool is still no integer."""
    import numpy as np

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp

    rank = build_compressor({"name": "powersgd", "matrix_approximation_rank": np.int64(2)}).matrix_approximation_rank
    assert rank == 2 and type(rank) is int
    ratio = build_compressor({"name": "topk", "ratio": np.float32(0.5)}).ratio
    assert ratio == 0.5 and type(ratio) is float
    assert type(build_local_update({"name": "local_sgd", "min_period": np.int64(4)}).min_period) is int
    assert make_ddp(collective_timeout_s=np.int64(60))._timeout.total_seconds() == 60
    assert CompressedDDPStrategy(compressor="int8", collective_timeout_s=np.uint16(8))._timeout.total_seconds() == 8
    for flag in (True, np.bool_(True)):
        with pytest.raises(ConfigError, match=r"^compressor.matrix_approximation_rank must be an integer, got"):
            build_compressor({"name": "powersgd", "matrix_approximation_rank": flag})
    with pytest.raises(ConfigError, match=r"^compressor.block_size must be an integer, got np.float64\(64.0\)"):
        build_compressor({"name": "int8", "block_size": np.float64(64)})


def test_a_numpy_bool_given_in_python_is_taken_where_a_flag_is_asked():
    """build_compressor({"name": "topk", "error_feedback": np.False_}) (a flag read from an array) was refused with
    'must be true or false, got np.False_ (bool)', which reads as if Python's bool were refused. It is taken, as numpy
    numbers are where a number is asked, and the codec holds Python's bool; where a number is asked a numpy bool is
    still refused, its type named as numpy's."""
    import numpy as np

    from lit_dtrain.errors import ConfigError

    for flag in (np.False_, np.True_):
        feedback = build_compressor({"name": "topk", "error_feedback": flag}).error_feedback
        assert feedback is bool(flag)
    assert build_local_update({"name": "diloco", "nesterov": np.False_}).nesterov is False
    with pytest.raises(ConfigError, match=r"^compressor.ratio must be a number, got np.True_ \(numpy.bool\)$"):
        build_compressor({"name": "topk", "ratio": np.True_})
    with pytest.raises(ConfigError, match=r"^compressor.error_feedback must be true or false, got np.str_\('no'\) "
                                          r"\(numpy.str_\)$"):
        build_compressor({"name": "topk", "error_feedback": np.str_("no")})


def test_a_bad_collective_timeout_given_in_python_is_named_as_its_argument():
    """make_ddp(collective_timeout_s='60') was told 'strategy.collective_timeout_s must be ...', a key of train.py's
    config that a Python user never wrote; a config's value is still named by its key (test_configs)."""
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp

    for build, name in ((make_ddp, "make_ddp"), (make_fsdp, "make_fsdp"),
                        (lambda **kw: CompressedDDPStrategy(compressor="int8", **kw), "CompressedDDPStrategy")):
        with pytest.raises(ValueError, match=rf"^{name}: collective_timeout_s must be a number of seconds > 0, got "
                                             r"'60'$"):
            build(collective_timeout_s="60")


def test_diloco_s_codec_given_in_python_is_named_by_its_place():
    """CompressedDDPStrategy(local_update={"name": "diloco", "compressor": {...}}) named a bad key of DiLoCo's codec
    'compressor.error_feedback', the key of the strategy's own codec, which the user had not set."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    bad = {"name": "topk", "error_feedback": "no"}
    with pytest.raises(ConfigError, match=r"^local_update.compressor.error_feedback must be true or false, got 'no'"):
        CompressedDDPStrategy(local_update={"name": "diloco", "compressor": bad})
    with pytest.raises(ValueError, match=r"^local_update.compressor.ratoi is not an argument .*'local_update.compres"):
        build_local_update({"name": "diloco", "compressor": {"name": "topk", "ratoi": 0.1}})
    with pytest.raises(ConfigError, match=r"^compressor.error_feedback must be"):  # DiLoCo itself: its own argument
        DiLoCo(compressor=bad)
    assert isinstance(build_local_update({"name": "diloco", "compressor": "int8"}).compressor, BlockQuantizer)

# --- local updates --------------------------------------------------------------------------------------
class TwoRankComm(LoopbackCommunicator):
    """Pretends to be rank 0 of 2: the other rank's contribution to each all-reduce comes from ``other``."""

    def __init__(self, other) -> None:
        super().__init__()
        self.other = other  # callable(tensor) -> the other rank's tensor

    @property
    def world_size(self) -> int:
        return 2

    def all_reduce_sum_async(self, tensor):
        fut = super().all_reduce_sum_async(tensor)
        tensor.add_(self.other(tensor))
        return fut


class TwoRankGatherComm(TwoRankComm):
    """Rank 0 of 2 for all-gather codecs too: the other rank's packed payload comes from ``other``."""

    def all_gather_async(self, tensor):
        fut = super().all_gather_async(tensor)
        return fut.then(lambda f: torch.stack([f.value()[0], self.other(f.value()[0])]))


def test_error_feedback_of_an_all_reduce_codec_keeps_only_its_own_rounding_under_two_ranks():
    """An all_reduce codec divides its payload by the world size before the sum; the residual must be this
    rank's own rounding error ``x - fp16(x)``, not ``x - fp16(x) / world`` (invisible with one rank)."""
    c = HalfPrecision("fp16", error_feedback=True)
    comm = TwoRankComm(lambda t: t.clone())  # the other rank sends the same payload
    g = grad(7)
    mean = c.reduce(g.clone(), SEGMENTS, comm, 0).wait()
    assert torch.equal(mean, g.half().float())  # the mean of two equal fp16 halves
    residual = c.residual_for(SEGMENTS, g)
    torch.testing.assert_close(residual, g - g.half().float(), rtol=0, atol=1e-7)
    assert bool((residual.abs() <= 2.0**-11 * g.abs() + 1e-7).all())


def test_topk_sums_the_ranks_sparse_vectors_where_their_indices_overlap():
    c = TopK(ratio=0.1)
    out = c.decompress_sum([[torch.tensor([1.0, 2.0]), torch.tensor([0, 3], dtype=torch.int32)],
                            [torch.tensor([10.0, 20.0]), torch.tensor([3, 4], dtype=torch.int32)]], [], 6)
    assert out.tolist() == [1.0, 0.0, 0.0, 12.0, 20.0, 0.0]
    # end to end over two ranks: the other rank sends the same top-k, so the mean is this rank's top-k
    g = grad(3)
    mean = c.reduce(g.clone(), SEGMENTS, TwoRankGatherComm(lambda t: t.clone()), 0).wait()
    kept = mean != 0
    assert int(kept.sum()) == math.ceil(0.1 * NUMEL) and torch.equal(mean[kept], g[kept])


def make_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(6, 4, generator=g)), ("b", torch.randn(5, generator=g))]


def test_local_sgd_averages_every_period_and_counts_bytes():
    params = make_params()
    offset = torch.full((29,), 0.5)
    comm = TwoRankComm(lambda t: t + offset)  # the other rank sits 0.5 higher in every coordinate
    rule = LocalSGD(sync_period=3)
    before = torch.cat([p.view(-1) for _, p in params]).clone()
    synced = [rule.after_optimizer_step(params, comm) for _ in range(6)]
    assert synced == [False, False, True, False, False, True]
    after = torch.cat([p.view(-1) for _, p in params])
    # each sync moves to the mean of (x, x + 0.5): +0.25
    assert torch.allclose(after, before + 0.5)
    assert comm.take_step_record()["bytes"] == 2 * 4 * 29


def test_adaptive_local_sgd_grows_while_divergence_is_low_and_shrinks_when_it_rises():
    params = make_params()
    norm_sq = sum(p.pow(2).sum() for _, p in params).item()
    gap = {"value": 0.0}
    comm = TwoRankComm(lambda t: t + gap["value"] if t.numel() > 1 else t)  # divergence scalar: same on both
    rule = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16, divergence_threshold=1e-3)
    periods = []
    for _ in range(40):
        if rule.after_optimizer_step(params, comm):
            periods.append(rule.period)
    assert periods[:3] == [8, 16, 16]  # identical replicas: divergence 0 -> grow to max
    gap["value"] = 2 * math.sqrt(1e-2 * norm_sq / 29)  # relative divergence ~1e-2 > threshold
    shrunk = []
    for _ in range(40):
        if rule.after_optimizer_step(params, comm):
            shrunk.append(rule.period)
    assert rule.last_divergence > 1e-3 and shrunk[-1] == 2 and shrunk == sorted(shrunk, reverse=True)


def test_an_early_sync_of_adaptive_local_sgd_leaves_its_period_alone():
    """A sync forced before the period is over (before a validation, at the last step) measures the drift of fewer
    steps: it grew the period (divergence 0 here) at every validation of a run validating more often than it syncs."""
    params = make_params()
    comm = TwoRankComm(lambda t: t.clone())  # identical replicas: divergence 0
    rule = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16)
    rule.after_optimizer_step(params, comm)
    assert rule.after_optimizer_step(params, comm, force_sync=True)
    assert (rule.period, rule.num_syncs, rule.num_early_syncs, rule.steps_since_sync) == (4, 1, 1, 0)
    assert comm.take_step_record()["bytes"] == 4 * 29  # the average only, no divergence all-reduce
    synced = [rule.after_optimizer_step(params, comm) for _ in range(4)]  # the period restarts at the early sync
    assert synced == [False, False, False, True] and (rule.period, rule.num_early_syncs) == (8, 1)
    restored = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16)
    restored.load_state_dict(rule.state_dict())
    assert (restored.num_syncs, restored.num_early_syncs) == (2, 1)


def test_diloco_outer_nesterov_step_matches_the_formula():
    params = make_params()
    start = torch.cat([p.view(-1) for _, p in params]).clone()
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.2))  # other rank's pseudo-gradient: 0.2 everywhere
    rule = DiLoCo(sync_period=2, outer_lr=0.7, outer_momentum=0.9)
    rule.maybe_initialize(params)
    for _, p in params:  # the inner optimizer moved this rank by -0.1
        p.data.sub_(0.1)
    rule.after_optimizer_step(params, comm)
    assert rule.after_optimizer_step(params, comm) is True
    delta = torch.full_like(start, (0.1 + 0.2) / 2)  # mean pseudo-gradient
    momentum = delta  # first step: 0.9 * 0 + delta
    expected = start - 0.7 * (delta + 0.9 * momentum)
    assert torch.allclose(torch.cat([p.view(-1) for _, p in params]), expected, atol=1e-6)
    assert torch.allclose(rule.momentum, momentum)

    restored = DiLoCo(sync_period=2)
    restored.load_state_dict(rule.state_dict())
    restored.maybe_initialize(params)
    assert torch.equal(restored.outer_params, rule.outer_params) and torch.equal(restored.momentum, rule.momentum)
    assert (restored.num_syncs, restored.step) == (1, 2)


def test_diloco_names_parameters_unfrozen_after_its_outer_loop_started():
    """A layer unfrozen mid-run joins CommSession.named_params: the flat parameters no longer match the outer ones
    (a bare tensor size-mismatch RuntimeError before)."""
    params = make_params()
    rule = DiLoCo(sync_period=1)
    rule.maybe_initialize(params[:-1])  # the last tensor frozen at the first step
    with pytest.raises(RuntimeError, match=r"DiLoCo: the trainable parameters changed .*new: \['" + params[-1][0]):
        rule.after_optimizer_step(params, TwoRankComm(lambda t: t.clone()))


@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_outer_momentum_accumulates_across_syncs(nesterov):
    """The first sync has zero momentum, so only later syncs show the momentum recursion m = mu * m + delta."""
    params = make_params()
    start = torch.cat([p.view(-1) for _, p in params]).clone()
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.2))  # other rank's pseudo-gradient: 0.2 everywhere
    rule = DiLoCo(sync_period=1, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    rule.maybe_initialize(params)
    expected, momentum, delta = start.clone(), 0.0, (0.1 + 0.2) / 2  # each sync: this rank moved by -0.1
    for sync in range(3):
        for _, p in params:
            p.data.sub_(0.1)
        assert rule.after_optimizer_step(params, comm) is True
        momentum = 0.9 * momentum + delta  # 0.15, 0.285, 0.4065
        expected -= 0.7 * ((delta + 0.9 * momentum) if nesterov else momentum)
        assert torch.allclose(rule.momentum, torch.full_like(start, momentum), atol=1e-6), sync
        assert torch.allclose(torch.cat([p.view(-1) for _, p in params]), expected, atol=1e-5), sync


@pytest.mark.parametrize("rule", ["local_sgd", "diloco"])
def test_a_sync_keeps_fp64_parameters_in_fp64(rule):
    """Under 64-true every sync computed the mean (and DiLoCo its outer parameters) in fp32: every weight was rounded
    to fp32 at each sync (1.2e-7 off for N(0, 1) values; a 2-rank 64-true run's weights were fp32-representable after
    every sync). The other rank sits 2**-40 higher (DiLoCo: its pseudo-gradient outer - local is 2**-40): the mean
    moves every value by 2**-41, exact in fp64, lost in fp32."""
    torch.manual_seed(0)
    params = [("w", torch.randn(6, 5, dtype=torch.float64)), ("b", torch.randn(5, dtype=torch.float64))]
    start = torch.cat([p.view(-1) for _, p in params]).clone()
    comm = TwoRankComm(lambda t: t + 2.0**-40)
    # DiLoCo with outer lr 1 and no momentum moves the outer parameters to the mean of the ranks' parameters
    built = (LocalSGD(sync_period=1) if rule == "local_sgd"
             else DiLoCo(sync_period=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False))
    built.maybe_initialize(params)
    assert built.after_optimizer_step(params, comm) is True
    after = torch.cat([p.view(-1) for _, p in params])
    assert after.dtype == torch.float64
    assert torch.equal(after, start + 2.0**-41 if rule == "local_sgd" else start - 2.0**-41)
    if rule == "diloco":
        assert built.outer_params.dtype == built.state_dict()["outer_params"]["w"].dtype == torch.float64


def test_a_validation_between_local_update_syncs_is_named():
    """With sync_before_validation=false each rank validates its own parameters between syncs: val/loss is a mean over
    different models, and a checkpoint written after the validation holds rank 0's. Said once per strategy; nothing
    right after a sync."""
    from types import SimpleNamespace

    from lit_dtrain.strategies.fit_end import warn_validation_between_syncs

    rule = LocalSGD(sync_period=4)
    trainer = SimpleNamespace(global_step=6, sanity_checking=False)
    strategy = SimpleNamespace(local_update=rule, lightning_module=SimpleNamespace(trainer=trainer, _trainer=trainer))
    rule.steps_since_sync = 0
    assert warn_validation_between_syncs(strategy) is None
    rule.steps_since_sync = 2
    with pytest.warns(UserWarning, match="validating at step 6, 2 step"):
        assert "strategy.sync_before_validation=true" in warn_validation_between_syncs(strategy)
    assert warn_validation_between_syncs(strategy) is None  # once


def test_a_validation_by_time_is_not_guessed_in_the_step():
    """val_check_interval as a duration: each rank reads its own clock, so a guess in the step could put one rank in a
    sync's all-reduce and not the other (a fit under local updates refuses it: the next test). By batches: asked of
    Lightning's epoch loop."""
    from types import SimpleNamespace

    from lit_dtrain.strategies.fit_end import validates_after_this_step

    epoch_loop = SimpleNamespace(_skip_next_val=False, _should_check_val_fx=lambda fetcher: True)
    trainer = SimpleNamespace(training=True, sanity_checking=False, _val_check_time_interval=None,
                              fit_loop=SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher=object()))
    assert validates_after_this_step(trainer)
    trainer._val_check_time_interval = 60.0
    assert not validates_after_this_step(trainer)


@pytest.mark.parametrize("local_update", [None, "local_sgd", "diloco"])
def test_a_fit_under_local_updates_refuses_a_validation_by_time(local_update, no_group_left):
    """Lightning validates by time when each rank's own clock says so. Under a local-update rule the sync before a
    validation then comes after different steps on the ranks: a 2-rank local SGD run (one rank 50 ms per batch slower,
    ``val_check_interval={"seconds": 0.5}``) paired one rank's validation sync with another collective of the other
    rank and hung until collective_timeout_s. A per-step codec has no such sync, as plain DDP: allowed."""
    import lightning as L

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def training_step(self, batch, _):
            return self.lin(batch[0]).square().mean()

        def validation_step(self, batch, _):
            self.log("val/loss", self.lin(batch[0]).square().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    strategy = CompressedDDPStrategy(compressor="fp16" if local_update is None else None, local_update=local_update)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        val_check_interval={"seconds": 30}, strategy=strategy)
    if local_update is None:
        trainer.fit(Net(), data, data)
        assert trainer.global_step == 2
        return
    with pytest.raises(ConfigError, match=rf"^val_check_interval is a duration \(30 s\).* under {local_update} .*"
                                          "set val_check_interval in batches$"):
        trainer.fit(Net(), data, data)
    assert trainer.global_step == 0


def test_diloco_state_from_before_its_first_step_restores_a_fresh_start():
    """LossSpikeMonitor's rollback snapshot is taken at ``on_train_start``, before DiLoCo's first step, when it has
    no outer parameters yet. Restoring it (a NaN step before the next snapshot) must start the outer loop afresh
    from the restored parameters (before: 'DiLoCo state has no outer parameters for [...]' at the next step)."""
    params = make_params()
    initial = [(n, p.clone()) for n, p in params]
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.2))
    rule = DiLoCo(sync_period=2, outer_lr=0.5, outer_momentum=0.5)
    snapshot = rule.state_dict()  # before the first step
    rule.maybe_initialize(params)
    for _ in range(3):
        for _, p in params:
            p.data.sub_(0.1)
        rule.after_optimizer_step(params, comm)
    rule.load_state_dict(snapshot)  # the rollback: parameters back to the initial ones, and the rule's state
    for (_, p), (_, p0) in zip(params, initial):
        p.data.copy_(p0)
    fresh, fresh_params = DiLoCo(sync_period=2, outer_lr=0.5, outer_momentum=0.5), [(n, p.clone()) for n, p in initial]
    for ps, r in ((params, rule), (fresh_params, fresh)):
        for _ in range(2):
            r.maybe_initialize(ps)
            for _, p in ps:
                p.data.sub_(0.1)
            r.after_optimizer_step(ps, comm)
    assert (rule.step, rule.num_syncs) == (fresh.step, fresh.num_syncs) == (2, 1)
    assert torch.equal(rule.outer_params, fresh.outer_params) and torch.equal(rule.momentum, fresh.momentum)
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, fresh_params))


def test_diloco_compresses_its_pseudo_gradient():
    params = make_params()
    comm = LoopbackCommunicator()
    rule = DiLoCo(sync_period=1, compressor=BlockQuantizer(bits=8))
    rule.maybe_initialize(params)
    for _, p in params:
        p.data.add_(0.01)
    rule.after_optimizer_step(params, comm)
    record = comm.take_step_record()
    assert record["bytes"] == 29 + 2 * 4  # 29 int8 values; a block per parameter (24 and 5 values), 2 fp32 scales
    assert rule.compressor.num_calls == 1


@pytest.mark.parametrize("make", [lambda period: LocalSGD(sync_period=period),
                                  lambda period: DiLoCo(sync_period=period)])
def test_resuming_with_another_sync_period_uses_the_configured_one(make):
    """A fixed period is configuration, not state: ``strategy.local_update.sync_period=5`` on a resume of a
    period-3 run must sync every 5 steps (it silently kept 3)."""
    params = make_params()
    comm = TwoRankComm(lambda t: t)
    old = make(3)
    old.maybe_initialize(params)
    for _ in range(4):  # synced at step 3; one step into the next period
        old.after_optimizer_step(params, comm)
    rule = make(5)
    rule.load_state_dict(old.state_dict())
    synced = [rule.after_optimizer_step(params, comm) for _ in range(9)]
    assert rule.period == 5
    assert synced == [False, False, False, True, False, False, False, False, True]  # steps 8 and 13


def test_resuming_adaptive_local_sgd_keeps_its_period_within_the_configured_bounds():
    rule = LocalSGD(sync_period=8, adaptive=True, min_period=2, max_period=64)
    rule.period = 64
    restored = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16)
    restored.load_state_dict(rule.state_dict())
    assert restored.period == 16  # the adapted period is state, but within this run's max_period
    rule.period = 32
    restored = LocalSGD(sync_period=8, adaptive=True, min_period=2, max_period=64)
    restored.load_state_dict(rule.state_dict())
    assert restored.period == 32



@pytest.mark.parametrize("spec", ["int8", {"name": "int8"}])
def test_diloco_builds_its_compressor_from_a_name_or_mapping(spec):
    """``strategy.local_update.compressor=int8`` (Hydra builds DiLoCo itself, not through build_local_update)
    gave DiLoCo the string, which failed only at the first sync, H steps into the run."""
    params = make_params()
    rule = DiLoCo(sync_period=1, compressor=spec)
    assert isinstance(rule.compressor, BlockQuantizer) and rule.compressor.bits == 8
    rule.maybe_initialize(params)
    for _, p in params:
        p.data.add_(0.01)
    comm = LoopbackCommunicator()
    assert rule.after_optimizer_step(params, comm) is True
    assert comm.take_step_record()["bytes"] == 29 + 2 * 4
    with pytest.raises(ValueError, match="unknown compressor 'int16'"):
        DiLoCo(compressor="int16")
    with pytest.raises(ValueError, match="compressor.bogus is not an argument of the compressor 'int8'"):
        DiLoCo(compressor={"name": "int8", "bogus": 1})


def test_compression_ratio_is_absent_until_something_was_sent():
    """Before a local-update run's first sync nothing is sent; the ratio was logged as inf, which flattened
    TensorBoard's axis for the whole run."""
    from lit_dtrain.strategies import CommSession

    session = CommSession(None, LocalSGD(sync_period=3))
    session.comm = LoopbackCommunicator()
    params = [("w", torch.nn.Parameter(torch.randn(4, 4)))]
    seen = []
    for _ in range(3):
        session.before_optimizer_step(params)
        session._dense_this_step = 64  # what the comm hook counts for a 4x4 fp32 gradient under DDP
        metrics = session.after_optimizer_step(params)
        seen.append(metrics.get("comm/compression_ratio"))
    assert seen[:2] == [None, None]
    assert seen[2] == pytest.approx(3 * 64 / 64)  # the sync at step 3 sent the 64 parameter bytes once


def test_another_strategy_resuming_compressed_state_is_told_what_it_drops():
    """The message a plain-DDP (or single-device) resume of a ``ddp_compressed`` checkpoint warns with, from the
    strategy's own ``comm_state_dict``; the 2-rank run through Lightning is in tests/dist/test_compressed_ddp.py."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy, dropped_comm_state_message

    plain = SingleDeviceStrategy(device="cpu")
    diloco = CompressedDDPStrategy(local_update=DiLoCo(sync_period=2, compressor="int4"))
    params = make_params()
    diloco.local_update.maybe_initialize(params)
    for _ in range(2):  # one outer step: outer parameters, momentum and the int4 pseudo-gradient residual
        for _, p in params:
            p.data.add_(0.01)
        diloco.local_update.after_optimizer_step(params, LoopbackCommunicator())
    checkpoint = {CHECKPOINT_KEY: diloco.comm_state_dict()}
    message = dropped_comm_state_message(checkpoint, plain, "x.ckpt")
    assert message.startswith(f"{CHECKPOINT_KEY}: x.ckpt was written under CompressedDDPStrategy "
                              "(strategy=ddp_compressed/diloco, 1 rank)"), message
    for part in ("DiLoCo's outer parameters and momentum", "pseudo-gradient compressor's error-feedback residuals",
                 "SingleDeviceStrategy does not read", "written right after a sync"):
        assert part in message, (part, message)
    assert dropped_comm_state_message(checkpoint, diloco) is None  # it restores the state itself
    assert dropped_comm_state_message({}, plain) is None  # a plain checkpoint: nothing to drop
    fp16 = {CHECKPOINT_KEY: CompressedDDPStrategy(compressor="fp16").comm_state_dict()}
    assert "ddp_compressed/fp16" in dropped_comm_state_message(fp16, plain)  # no error feedback: only counters
    assert "only the comm/* counters restart" in dropped_comm_state_message(fp16, plain)


@pytest.mark.parametrize("written, resumed", [("powersgd", "int8"), (None, "int8"), ("int8", None)])
def test_a_resume_under_another_preset_names_the_file_and_the_ways_out(tmp_path, written, resumed):
    """``ddp_compressed/int8`` resuming a PowerSGD checkpoint is refused (its state cannot be applied); the error
    named neither the file nor the preset that wrote it nor ``strategy=ddp``, which resumes without that state. A
    ConfigError: train.py prints it as one line (a ValueError came with a traceback)."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    path = tmp_path / "last.ckpt"
    torch.save({CHECKPOINT_KEY: CompressedDDPStrategy(compressor=written).comm_state_dict()}, path)
    with pytest.raises(ConfigError) as err:
        CompressedDDPStrategy(compressor=resumed).load_checkpoint(path)
    message = str(err.value)
    for part in (str(path), f"strategy=ddp_compressed/{written or 'none'})", "or with strategy=ddp,"):
        assert part in message, (part, message)


def test_the_preset_a_refused_resume_names_exists_for_every_codec_and_rule(tmp_path):
    """An int4_rs checkpoint resumed under ddp_compressed/int8 said 'Resume it with the preset that wrote it
    (strategy=ddp_compressed/int4_rs)', a preset that does not exist (Hydra: 'Could not find'): every codec and
    local-update name is named by overrides that compose and build it."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy
    from tests.conftest import CONF_DIR

    path = tmp_path / "last.ckpt"
    torch.save({CHECKPOINT_KEY: CompressedDDPStrategy(compressor="int4_rs").comm_state_dict()}, path)
    with pytest.raises(ValueError, match=r"\(strategy=ddp_compressed/int8_rs strategy.compressor.bits=4\)"):
        CompressedDDPStrategy(compressor="int8").load_checkpoint(path)
    from lit_dtrain.strategies.comm_checkpoint import preset_overrides

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for name in sorted(COMPRESSORS) + sorted(LOCAL_UPDATES):
            kwargs = {"local_update": name} if name in LOCAL_UPDATES else {"compressor": name}
            overrides = preset_overrides(CompressedDDPStrategy(**kwargs).comm_state_dict()).split()
            node = compose(config_name="train", overrides=overrides).strategy
            part = node.local_update if name in LOCAL_UPDATES else node.compressor
            assert instantiate(part).name == name, (name, overrides)


def test_litllm_warns_about_dropped_comm_state_without_importing_strategies_up_front(tmp_path):
    """``LitLLM.on_load_checkpoint`` warns through ``lit_dtrain.strategies``, but importing ``lit_dtrain.module``
    (as ``LossSpikeMonitor`` does, for ``NonFiniteError``) must not import the compressed-DDP package, which
    registers ``ddp_compressed`` in Lightning's strategy registry: the callbacks are imported one by one."""
    import subprocess
    import sys
    import types
    import warnings

    from lightning.pytorch.plugins import Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from tests.conftest import subprocess_env

    code = ("import sys; from lit_dtrain.callbacks import LossSpikeMonitor; import lit_dtrain.module; "
            "print(sorted(m for m in sys.modules if m.startswith('lit_dtrain.strategies')))")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(tmp_path), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out

    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    lit = LitLLM(Llama(LlamaConfig(block_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=8)))
    checkpoint = {CHECKPOINT_KEY: CompressedDDPStrategy(compressor="int8").comm_state_dict()}
    lit.on_load_checkpoint(checkpoint)  # no trainer: only the weights are read, nothing to say
    lit._trainer = types.SimpleNamespace(strategy=SingleDeviceStrategy(device="cpu"), ckpt_path="x.ckpt",
                                         precision_plugin=Precision())  # 32-true: converts nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lit.on_load_checkpoint(checkpoint)
    (message,) = [str(w.message) for w in caught if CHECKPOINT_KEY in str(w.message)]
    assert "x.ckpt was written under CompressedDDPStrategy (strategy=ddp_compressed/int8" in message


def test_local_update_checkpoint_holds_cpu_copies_of_each_ranks_optimizer_state():
    """Under local updates every rank's optimizer state is all-gathered into the checkpoint. It was gathered as
    ``opt.state_dict()``: the live tensors, on the rank's device (on GPUs, rank r's would be unpickled on rank 0
    as ``cuda:r``, which a one-GPU-per-task job cannot see); the parameters next to it were already CPU copies."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    strategy = CompressedDDPStrategy(local_update=LocalSGD(sync_period=2))
    strategy._lightning_module, strategy.optimizers = model, [opt]
    saved = strategy.comm_state_dict()["per_rank"][0]["optimizer_states"][0]["state"]
    live = opt.state_dict()["state"]
    assert saved.keys() == live.keys() and saved
    for i, entry in saved.items():
        for key, value in entry.items():
            assert value.device.type == "cpu"
            assert value.untyped_storage().data_ptr() != live[i][key].untyped_storage().data_ptr(), (i, key)
    before = {i: {k: v.clone() for k, v in e.items()} for i, e in saved.items()}
    opt.step()  # the live state moves on; what was saved does not
    assert all(torch.equal(saved[i][k], before[i][k]) for i in saved for k in saved[i])


def test_all_gather_uses_all_gather_into_tensor_where_torch_has_no_all_gather_single(monkeypatch):
    """torch 2.11 (seen on a GPU machine) has no ``dist.all_gather_single``, added in 2.13: every gathering codec
    failed in its first backward with AttributeError. The communicator falls back to ``all_gather_into_tensor``."""
    import torch.distributed as dist

    from lit_dtrain.strategies import comm

    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, t, group=None, async_op=False:
                        calls.append((out, t, group, async_op)) or "work")
    out, t = torch.empty(4), torch.ones(2)
    assert comm._all_gather_single(out, t, group="g", async_op=True) == "work"
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is t and calls[0][2:] == ("g", True)


@pytest.mark.usefixtures("no_group_left")
@pytest.mark.parametrize("codec", ["topk", "powersgd", "int8_rs"])
def test_a_resume_into_a_model_without_the_states_parameters_is_an_error_naming_the_file(tmp_path, codec):
    """A model that loads a checkpoint with ``strict_loading=False`` and another layout (a renamed layer) got the
    codec state of parameters it does not have: it was kept, never applied, and saved again in every checkpoint
    (residual keys 'lin.weight', 'lin.bias' next to the new model's own). A residual of another size (a direct
    ``load_state_dict``) failed at the first step as torch's bare 'expanded size ... must match'."""
    import lightning as L

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    class Net(L.LightningModule):
        def __init__(self, layer: str) -> None:
            super().__init__()
            self.layer, self.strict_loading = layer, False
            torch.manual_seed(0)
            setattr(self, layer, torch.nn.Linear(8, 8))

        def training_step(self, batch, _):
            return getattr(self, self.layer)(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)

    def trainer(steps: int) -> L.Trainer:
        spec = {"name": codec, "error_feedback": True} if codec != "powersgd" else {"name": codec, "start_step": 0}
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         strategy=CompressedDDPStrategy(compressor=spec))

    path = str(tmp_path / "lin.ckpt")
    first = trainer(2)
    # one process: nothing is sent, yet the codec rounds every step's gradient (before: without a word)
    with pytest.warns(UserWarning, match=rf"^CompressedDDPStrategy on 1 process: the '{codec}' codec sends nothing, "
                                         r"yet training uses its decoded \(lossy\) gradient; .* strategy=auto"):
        first.fit(Net("lin"))
    first.save_checkpoint(path)
    assert {"lin.weight", "lin.bias"} <= set(first.strategy.compressor.residuals)
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: {codec} compressor state holds the .* of 'lin\."):
        trainer(4).fit(Net("other"), ckpt_path=path)
    trainer(4).fit(Net("lin"), ckpt_path=path)  # the model that wrote it resumes

    c = build_compressor({"name": codec, "error_feedback": True})
    c.load_state_dict(first.strategy.compressor.state_dict())
    with pytest.raises(ValueError, match=r"'lin.weight' with 64 values; this model's has 32"):
        c.check_fits({"lin.weight": 32, "lin.bias": 8})


def test_a_codec_spec_names_a_misspelt_key_and_the_right_one():
    """A mapping's unknown argument was the codec class's TypeError (under train.py inside Hydra's instantiate
    wrapper, 'full_key: strategy'), an unknown name a list of names without the close one."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.raises(ValueError, match=r"^compressor.ratoi is not an argument of the compressor 'topk' \(TopK\); "
                                         r"did you mean 'compressor.ratio'\?$"):
        CompressedDDPStrategy(compressor={"name": "topk", "ratoi": 0.01})
    with pytest.raises(ValueError, match=r"^local_update: unknown local-update rule 'dilcoo'; .*did you mean 'diloco'"):
        CompressedDDPStrategy(local_update="dilcoo")
    with pytest.raises(ValueError, match=r"^compressor.bits: the compressor 'int4_rs' sets bits=4 itself$"):
        build_compressor({"name": "int4_rs", "bits": 8})
    # a preset's defaults can be overridden, its name's arguments cannot
    assert build_compressor("int4").error_feedback and not build_compressor({"name": "int4", "error_feedback": False}
                                                                            ).error_feedback
    assert build_compressor({"name": "int8_rs", "block_size": 64}).block_size == 64
    assert build_local_update({"name": "local_sgd_adaptive", "sync_period": 4}).adaptive


@pytest.mark.parametrize("preset", ["local_sgd", "local_sgd_adaptive", "diloco"])
def test_a_local_update_preset_turned_per_step_names_only_the_sync_flags_the_user_gave(preset, tiny_cfg):
    """The local-update presets set both sync flags to true, so strategy.local_update=null with a per-step codec over
    them was told 'sync_on_last_step and sync_before_validation ... do nothing: remove it' of keys never typed."""
    import warnings

    from lit_dtrain.strategies.by_name import build_strategy

    per_step = [f"strategy=ddp_compressed/{preset}", "strategy.local_update=null", "strategy.compressor=int8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy = build_strategy(tiny_cfg(*per_step))
        local = build_strategy(tiny_cfg(f"strategy=ddp_compressed/{preset}"))
    assert strategy.sync_on_last_step and strategy.sync_before_validation
    assert local.sync_on_last_step and local.sync_before_validation
    with pytest.warns(UserWarning, match=r"^CompressedDDPStrategy: sync_on_last_step acts only"):
        build_strategy(tiny_cfg(*per_step, "strategy.sync_on_last_step=false"))


def test_a_codec_with_a_local_update_is_refused_in_the_words_of_a_config(tiny_cfg):
    """strategy=ddp_compressed/local_sgd strategy.compressor=int8 was told to 'set compressor=None', the Python form."""
    from hydra.errors import InstantiationException

    from lit_dtrain.strategies.by_name import build_strategy

    with pytest.raises(InstantiationException) as caught:
        build_strategy(tiny_cfg("strategy=ddp_compressed/local_sgd", "strategy.compressor=int8"))
    assert str(caught.value.__cause__).endswith(
        "gradient compressor would never run: set strategy.compressor=null (compressor=None in Python); a codec for "
        "DiLoCo's pseudo-gradient goes in strategy.local_update.compressor")


def test_sync_flags_given_under_a_per_step_codec_are_named():
    """sync_on_last_step / sync_before_validation act only under a local-update rule; given under a per-step codec
    (false included) they did nothing, without a word. Not given, or under local updates: no warning, default true."""
    import warnings

    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.warns(UserWarning, match=r"^CompressedDDPStrategy: sync_before_validation acts only under a "
                                         r"local-update rule .* the compressor 'int8' .* does nothing: remove it$"):
        assert not CompressedDDPStrategy(compressor="int8", sync_before_validation=False).sync_before_validation
    with pytest.warns(UserWarning, match=r"sync_on_last_step and sync_before_validation act only"):
        CompressedDDPStrategy(compressor="topk", sync_on_last_step=True, sync_before_validation=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = CompressedDDPStrategy(compressor="int8")
        local = CompressedDDPStrategy(local_update="local_sgd", sync_on_last_step=False)
    assert plain.sync_on_last_step and plain.sync_before_validation
    assert not local.sync_on_last_step and local.sync_before_validation
    # on one process (world size 1 until a fit's setup says otherwise): DiLoCo's pseudo-gradient codec is named too
    from lit_dtrain.strategies.without_effect import warn_about_settings_without_effect

    with pytest.warns(UserWarning, match=r"the 'int8' codec sends nothing, yet training uses its decoded \(lossy\) "
                                         r"diloco pseudo-gradient"):
        warn_about_settings_without_effect(CompressedDDPStrategy(local_update={"name": "diloco", "compressor": "int8"}),
                                           None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for quiet in (CompressedDDPStrategy(compressor="none"), CompressedDDPStrategy(local_update="diloco")):
            warn_about_settings_without_effect(quiet, None)
    # 16-bit gradients (bf16-true) through a 16-bit codec: no byte saved (a 2-rank run logged compression_ratio 1)
    from unittest import mock

    from lightning.pytorch.plugins import HalfPrecision as HalfPrecisionPlugin
    from lightning.pytorch.plugins import Precision

    fp16 = CompressedDDPStrategy(compressor="fp16", precision_plugin=HalfPrecisionPlugin("bf16-true"))
    with pytest.warns(UserWarning, match=r"^CompressedDDPStrategy: under trainer.precision=bf16-true the gradients are "
                                         r"bf16 already: the 'fp16' codec sends as many bytes .* fp16's range; use "):
        warn_about_settings_without_effect(fp16, None)
    # bf16 has the wider range: on fp16 gradients it rounds them to 8 significant bits (it said "to bf16's range")
    bf16 = CompressedDDPStrategy(compressor="bf16", precision_plugin=HalfPrecisionPlugin("16-true"))
    with pytest.warns(UserWarning, match=r"the 'bf16' codec sends as many bytes \(comm/compression_ratio 1\) and "
                                         r"rounds them to bf16's 8 significant bits \(fp16 keeps 11\); use ") as said:
        warn_about_settings_without_effect(bf16, None)
    assert not any("range" in str(w.message) for w in said if "16-true" in str(w.message))
    with warnings.catch_warnings(), mock.patch.object(CompressedDDPStrategy, "world_size", 2):
        warnings.simplefilter("error")
        fp16.precision_plugin = Precision()  # 32-true: fp32 gradients, 2x fewer bytes; 2 processes
        warn_about_settings_without_effect(fp16, None)


def test_a_rollback_keeps_the_sync_counts_that_a_checkpoint_restores():
    """comm/syncs and comm/early_syncs count the syncs made, as comm/bytes_per_step's totals count their bytes: a
    loss-spike rollback to an older snapshot put them back (2 -> 1 in a 2-rank local SGD run) while the bytes stayed.
    The schedule (steps, steps since the sync) is the snapshot's; a checkpoint's load restores the counts too."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(local_update=LocalSGD(sync_period=2))
    rule, params, comm = strategy.local_update, make_params(), LoopbackCommunicator()
    rule.after_optimizer_step(params, comm)
    snapshot = strategy.comm_local_state_dict()  # after 1 step, no sync yet
    for _ in range(4):
        rule.after_optimizer_step(params, comm)
    rule.sync_now(params, comm)  # an early sync (a validation)
    assert (rule.num_syncs, rule.num_early_syncs, rule.step, rule.steps_since_sync) == (3, 1, 5, 0)
    strategy.load_comm_local_state_dict(snapshot)
    assert (rule.num_syncs, rule.num_early_syncs) == (3, 1)
    assert (rule.step, rule.steps_since_sync) == (1, 1)
    assert rule.after_optimizer_step(params, comm) and rule.num_syncs == 4  # the snapshot's schedule: sync at 2
    strategy.load_comm_local_state_dict(snapshot, counts=True)
    assert (rule.num_syncs, rule.num_early_syncs, rule.step) == (0, 0, 1)


def test_a_resume_on_another_number_of_ranks_keeps_the_shared_state_and_the_mean_residual(tmp_path):
    """A 2-rank checkpoint resumed on 1 process was refused ('holds compressor state of 2 ranks but this run has
    1'), even for state that is not per rank. Now the replicated state (PowerSGD's Qs, counters) is kept, every rank
    takes the mean of the saved residuals (the gradient still owed), and rank 0 warns what changed; a state other
    than residuals that differs between the ranks (one nothing can split) and another preset are still refused."""
    import copy
    import warnings

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    spec = {"name": "powersgd", "matrix_approximation_rank": 2}
    one = CompressedDDPStrategy(compressor=spec).comm_state_dict()
    ranks = [copy.deepcopy(one["per_rank"][0]) for _ in range(2)]
    for r, entry in enumerate(ranks):
        entry["compressor"]["residuals"] = {"w": torch.tensor([1.0, -2.0, 3.0]) * (r + 1), "b": torch.ones(2) * r}
        entry["compressor"]["q_memory"] = {"w": torch.arange(4.0).view(2, 2)}
        entry["counters"]["step"] = 4
    entry["counters"]["total_time_ms"] = 9.0  # rank 1's own comm time
    path = tmp_path / "step=4.ckpt"
    torch.save({CHECKPOINT_KEY: {**one, "world_size": 2, "per_rank": ranks}}, path)
    strategy = CompressedDDPStrategy(compressor=spec)
    with pytest.warns(UserWarning, match=r"^lit_dtrain_comm: the checkpoint was written on 2 ranks and this run has "
                                         r"1: .*residuals of 2 ranks are replaced on every rank by their mean \(norm "
                                         r"5.66: .* \(norm 2.83, zero in sum\)\. A resume on the same number"):
        strategy.load_checkpoint(path)
    c = strategy.compressor
    assert torch.equal(c.residuals["w"], torch.tensor([1.5, -3.0, 4.5])) and torch.equal(c.residuals["b"],
                                                                                       torch.full((2,), 0.5))
    assert torch.equal(c.q_memory["w"], torch.arange(4.0).view(2, 2))
    assert strategy.session.counters_state_dict()["total_time_ms"] == ranks[0]["counters"]["total_time_ms"]
    assert strategy.session.step == 4

    ranks[1]["compressor"]["q_memory"]["w"] += 1  # not replicated: nothing can split it over another world size
    torch.save({CHECKPOINT_KEY: {**one, "world_size": 2, "per_rank": ranks}}, path)
    with pytest.raises(ConfigError, match=r"the compressor state \['q_memory'\] differs between rank 0 and rank 1: .*"
                                          r"resume on the 2 ranks that wrote it, or with strategy=ddp, which") as e:
        CompressedDDPStrategy(compressor=spec).load_checkpoint(path)
    assert "preset that wrote it" not in str(e.value)  # the preset in use: it was 'Resume it with the preset ...'
    ranks[1]["compressor"]["q_memory"]["w"] -= 1
    torch.save({CHECKPOINT_KEY: {**one, "world_size": 2, "per_rank": ranks}}, path)
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=r"compressor state is for 'powersgd', this "
                                                                     r"compressor is 'int8'"):
        warnings.simplefilter("error")  # another preset: refused on any world size, with no elastic warning first
        CompressedDDPStrategy(compressor="int8").load_checkpoint(path)


def test_a_resume_on_another_number_of_ranks_drops_server_residuals_and_averages_local_parameters():
    """``int8_rs``'s server residuals are shares laid out for the saved world size: dropped, and said. Under local
    updates every rank starts from the mean of the saved ranks' parameters (said only when they differ, mid-period)
    with rank 0's optimizer state."""
    from lit_dtrain.strategies import comm_checkpoint

    def entry(r: int, server: bool) -> dict:
        compressor = {"name": "int8_rs", "num_calls": 4, "residuals": {"w": torch.full((2,), float(r))},
                      "server_layout": {"world_size": 2, "block_size": 64}}
        if server:
            compressor["server_residuals"] = {"w": torch.full((1,), 1.0 + r)}
        return {"counters": {"step": 4}, "compressor": compressor, "local_update": None}

    state = {"world_size": 2, "local_update": None, "per_rank": [entry(0, True), entry(1, True)]}
    kept, notes = comm_checkpoint.elastic_rank_entry(state, 1)
    assert kept["compressor"]["server_residuals"] == {} and torch.equal(kept["compressor"]["residuals"]["w"],
                                                                        torch.full((2,), 0.5))
    assert kept["compressor"]["server_layout"] == {"world_size": 2, "block_size": 64}
    assert notes[-1] == "the compressor server residuals (shares laid out for 2 ranks, norm 2.24) are dropped"

    ranks = [{"counters": {"step": 5}, "compressor": None, "local_update": None,
              "params": {"w": torch.tensor([1.0, 2.0 + r])}, "optimizer_states": [{"rank": r}]} for r in range(2)]
    local = {"world_size": 2, "local_update": {"name": "local_sgd", "steps_since_sync": 2}, "per_rank": ranks}
    kept, notes = comm_checkpoint.elastic_rank_entry(local, 3)
    assert torch.equal(kept["params"]["w"], torch.tensor([1.0, 2.5])) and kept["optimizer_states"] == [{"rank": 0}]
    assert notes == ["every rank starts from the mean of the 2 ranks' parameters, which differ 2 steps after the last "
                     "sync (the point a sync now would move them to)",
                     "every rank takes rank 0's optimizer state (rank 1's is dropped)"]
    ranks[1]["params"]["w"] = ranks[0]["params"]["w"].clone()  # right after a sync: kept exactly, nothing to say
    kept, notes = comm_checkpoint.elastic_rank_entry(local, 3)
    assert torch.equal(kept["params"]["w"], ranks[0]["params"]["w"]) and len(notes) == 1
