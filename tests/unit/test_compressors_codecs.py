"""Compressors in one process (no torch.distributed): the error bounds and byte counts of the half-precision, int,
sign, packing and PowerSGD codecs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dtrain.strategies import (
    BlockQuantizer,
    LoopbackCommunicator,
    PowerSGD,
    ScaledSign,
    TopK,
    build_compressor,
)
from lit_dtrain.strategies.compressors import Segment, pack_payload, segments_from_shapes, unpack_payload
from lit_dtrain.strategies.sparsify import pack_bits, topk_ratio_at, unpack_bits
from tests.conftest import ROOT
from tests.unit._compressor_helpers import NUMEL, SEGMENTS, TwoRankComm, grad, payload_bytes


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


@pytest.mark.parametrize("bits", [8, 4])
def test_the_docs_bytes_column_is_the_block_quantizers_ratio_on_a_model(bits):
    """docs/compressed_ddp.md's preset table (and the preset's YAML comment) give the ratio the codec sends on a
    model, to two decimals: int4 said 7.75x where nano's payload is 7.757x (small's 7.7575x) smaller than fp32."""
    from lit_dtrain.models import build_llama

    model = build_llama(vocab_size=257, block_size=256, n_layer=5, n_head=4, n_kv_head=2, d_model=128)  # nano
    segments = segments_from_shapes([(n, p.shape) for n, p in model.named_parameters()])
    numel = sum(s.numel for s in segments)
    ratio = 4 * numel / payload_bytes(BlockQuantizer(bits=bits).compress(torch.randn(numel), segments, 0))
    row = next(line for line in (ROOT / "docs" / "compressed_ddp.md").read_text().splitlines()
               if line.startswith(f"| `int{bits}` |"))
    assert row.rstrip(" |").endswith(f"| {ratio:.2f}x less"), (row, ratio)
    comment = (ROOT / "conf" / "strategy" / "ddp_compressed" / f"int{bits}.yaml").read_text().splitlines()[0]
    assert comment.endswith(f": {ratio:.2f}x fewer bytes."), (comment, ratio)


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


def test_powersgd_resumed_with_another_rank_starts_its_warm_start_afresh():
    """A checkpoint's warm-start Qs are (m, r) of the rank it was written with: a resume with another
    ``matrix_approximation_rank`` draws new ones (a Q of the old rank would not fit the new P), and reduces as a
    fresh compressor of that rank does."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    old = PowerSGD(matrix_approximation_rank=1, error_feedback=False)
    old.reduce(x.clone(), SEGMENTS, LoopbackCommunicator(), step=0).wait()
    resumed, fresh = (PowerSGD(matrix_approximation_rank=2, error_feedback=False) for _ in range(2))
    resumed.load_state_dict(old.state_dict())
    out = resumed.reduce(x.clone(), SEGMENTS, LoopbackCommunicator(), step=1).wait()
    assert torch.equal(out, fresh.reduce(x.clone(), SEGMENTS, LoopbackCommunicator(), step=1).wait())
    assert {k: tuple(q.shape) for k, q in resumed.q_memory.items()} == {"w1": (40, 2), "w2": (24, 2), "emb": (24, 2)}


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_of_a_block_s_maximum_stays_in_range(bits, monkeypatch):
    """``max|block| * (1 / scale)`` is 127.0000076 in fp32 for 3.19 (7.0000005 for 2.8859 at 4 bits), so noise
    near 1 floors it to L + 1: clamped to L it decodes to the maximum itself; unclamped, int8 wrapped it to -128 (a
    4-bit 8 overflowed its nibble)."""
    top = 3.190070390701294 if bits == 8 else 2.885874032974243
    x = torch.tensor([top, -1.0, 0.5, 0.25])
    q = BlockQuantizer(bits=bits, block_size=4, stochastic_rounding=True)
    monkeypatch.setattr(q, "_noise", lambda params, blocks, step, device: torch.full((blocks, 4), 1 - 2.0**-24))
    y = q.decompress(q.compress(x, [], 0), [], 4)
    assert y[0].item() == pytest.approx(top, rel=1e-6)
    assert torch.all((y - x).abs() <= top / q.levels)  # stochastic rounding errs by less than one step
