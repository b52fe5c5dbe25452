"""Property (hypothesis): decompress(compress(x)) stays within each compressor's stated error bound for
arbitrary shapes, including empty and non-contiguous tensors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dtrain.strategies import BlockQuantizer, HalfPrecision

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
