"""Property (hypothesis): decompress(compress(x)) stays within each compressor's stated error bound for
arbitrary shapes, including empty and non-contiguous tensors: fp16/bf16, int8/int4, top-k, scaled sign, PowerSGD."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dtrain.strategies import BlockQuantizer, HalfPrecision, PowerSGD, ScaledSign, TopK

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3)


def make(shape, seed, transpose):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 5
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)  # non-contiguous view
    return x


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), transpose=st.booleans(),
       kind=st.sampled_from(["fp16", "bf16"]))
def test_half_precision_relative_bound(shape, seed, transpose, kind):
    x = make(shape, seed, transpose)
    y = HalfPrecision(kind).roundtrip(x)
    assert y.shape == x.shape
    unit_roundoff = 2.0**-11 if kind == "fp16" else 2.0**-8
    assert torch.all((y - x).abs() <= unit_roundoff * x.abs() + 1e-7)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), transpose=st.booleans(), bits=st.sampled_from([8, 4]),
       block=st.sampled_from([2, 4, 16]))
def test_block_quantizer_half_step_bound(shape, seed, transpose, bits, block):
    x = make(shape, seed, transpose)
    y = BlockQuantizer(bits=bits, block_size=block).roundtrip(x)
    assert y.shape == x.shape
    flat, err = x.reshape(-1), (y - x).reshape(-1).abs()
    if flat.numel() == 0:
        return
    pad = (-flat.numel()) % block
    absmax = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block).abs().amax(1)
    levels = 127 if bits == 8 else 7
    bound = (absmax / (2 * levels)).repeat_interleave(block)[: flat.numel()]
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-12)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), transpose=st.booleans(), ratio=st.sampled_from([0.01, 0.3, 1.0]))
def test_topk_keeps_the_largest_and_drops_at_most_the_rest(shape, seed, transpose, ratio):
    x = make(shape, seed, transpose)
    y = TopK(ratio=ratio).roundtrip(x)
    assert y.shape == x.shape
    kept = y != 0
    assert torch.equal(y[kept], x[kept])  # sent values are exact
    k = min(x.numel(), math.ceil(ratio * x.numel()))
    assert int(kept.sum()) <= k
    assert (x - y).norm() <= math.sqrt(1 - k / max(x.numel(), 1)) * x.norm() * (1 + 1e-6) + 1e-6


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), transpose=st.booleans())
def test_scaled_sign_error_is_the_stated_one(shape, seed, transpose):
    x = make(shape, seed, transpose)
    y = ScaledSign().roundtrip(x)
    assert y.shape == x.shape
    if x.numel():  # ||x - s sign(x)||^2 = ||x||^2 - ||x||_1^2 / n
        expected = x.pow(2).sum() - x.abs().sum() ** 2 / x.numel()
        assert torch.allclose((x - y).pow(2).sum(), expected.clamp_min(0), rtol=1e-4, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), transpose=st.booleans(), rank=st.integers(1, 3))
def test_powersgd_is_an_orthogonal_projection(shape, seed, transpose, rank):
    x = make(shape, seed, transpose)
    y = PowerSGD(matrix_approximation_rank=rank, min_compression_rate=0.5).roundtrip(x)
    assert y.shape == x.shape
    assert torch.allclose(y.pow(2).sum() + (x - y).pow(2).sum(), x.pow(2).sum(), rtol=1e-4, atol=1e-4)
