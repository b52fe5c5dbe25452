"""The 16-bit sync on two ranks, exactly (fifth hand mutation audit): the one-process tests run at world size 1,
where dividing the payload by the world size, and multiplying the sent value back for the residual, are no-ops;
and bf16 differs from fp16 by its range, which an error bound inside fp16's range does not see."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.strategies import HalfPrecision
from tests.unit._compressor_helpers import NUMEL, SEGMENTS, TwoRankComm, grad


@pytest.mark.parametrize(("name", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_two_ranks_average_the_halved_16_bit_payloads_and_keep_the_rounding_as_residual(name, dtype):
    x, y = grad(0), grad(1)
    sent = {}

    def other(payload):
        sent["dtype"] = payload.dtype
        return (y.to(dtype) / 2).to(dtype)  # the other rank's payload, divided in its dtype as this rank's is

    codec = HalfPrecision(name, error_feedback=True)
    flat = x.clone()
    out = codec.reduce(flat, SEGMENTS, TwoRankComm(other), step=0).wait()
    mine = x.to(dtype).div_(2)
    assert sent["dtype"] == dtype
    assert torch.equal(out, (mine + (y.to(dtype) / 2).to(dtype)).float())  # a 16-bit sum of halves: the mean
    # the residual is what this rank's x lost to its rounding: x - 2 * its halved 16-bit payload
    assert torch.equal(codec.residuals["w1"].reshape(-1), (x - mine.float() * 2)[: 48 * 40])
    assert codec.residuals["w1"].abs().max() > 0


def test_bf16_carries_values_past_fp16_range_and_says_its_payload_cannot_overflow():
    x = torch.full((NUMEL,), 1e6)  # fp16's largest is 65504
    out = HalfPrecision("bf16").reduce(x.clone(), SEGMENTS, TwoRankComm(lambda p: p.clone()), step=0).wait()
    assert torch.allclose(out, x, rtol=2.0**-8)
    assert HalfPrecision("bf16").payload_may_overflow is False and HalfPrecision("fp16").payload_may_overflow is True
