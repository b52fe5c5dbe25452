"""Top-k in one process: exact selection, the sampled threshold, non-finite entries, its buckets across a resume."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dtrain.strategies import (
    CommSession,
    LoopbackCommunicator,
    NoCompression,
    TopK,
)
from lit_dtrain.strategies.compressors import Segment
from lit_dtrain.strategies.sparsify import exact_topk_indices
from tests.unit._compressor_helpers import NUMEL, SEGMENTS, grad, payload_bytes


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
    is handed;
    tests/dist/test_compressed_ddp_resume.py::test_resume_restores_comm_state_exactly[powersgd_3_ranks] checks the
    resumed run on 3 ranks."""
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
