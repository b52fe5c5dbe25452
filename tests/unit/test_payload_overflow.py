"""A step that stops on non-finite gradients only because the fp16 codec's payload overflowed names the codec: the
codec notes the step (``Compressor.payload_overflow_step``) and ``CompressedDDPStrategy`` adds it to LitLLM's
``NonFiniteError``, which said only "non-finite gradients ... lower the LR" of finite gradients."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM, NonFiniteError
from lit_dtrain.strategies import CompressedDDPStrategy, build_compressor
from lit_dtrain.strategies.compressors import pack_payload
from lit_dtrain.strategies.payload_overflow import payload_overflow_message
from tests.unit._compressor_helpers import SEGMENTS, TwoRankComm, TwoRankGatherComm, grad

CODECS = [("fp16", TwoRankComm), ({"name": "topk", "ratio": 0.5, "value_dtype": "fp16"}, TwoRankGatherComm),
          ({"name": "fp16", "error_feedback": True}, TwoRankComm)]


@pytest.mark.parametrize("spec,comm", CODECS)
def test_a_finite_bucket_decoded_as_inf_notes_the_step(spec, comm):
    codec = build_compressor(spec)
    big = grad(0)
    big[3] = 2e5  # finite in fp32, above fp16's 65504 (x 2 ranks for the fp16 all-reduce's g / 2)
    codec.reduce(grad(1), SEGMENTS, comm(lambda t: t.clone()), step=0).wait()
    assert codec.payload_overflow_step is None  # small gradients: nothing noted
    out = codec.reduce(big, SEGMENTS, comm(lambda t: t.clone()), step=1).wait()
    assert not torch.isfinite(out).all() and codec.payload_overflow_step == 1
    # the overflow was the other rank's: this rank's finite bucket decoded non-finite all the same
    codec.reduce(grad(2), SEGMENTS, comm(_other_rank_overflowing(spec, comm)), step=2).wait()
    assert codec.payload_overflow_step == 2
    nan = grad(3)
    nan[0] = float("nan")  # this rank's own gradient was non-finite: no payload overflow to name
    codec.reduce(nan, SEGMENTS, comm(lambda t: t.clone()), step=3).wait()
    assert codec.payload_overflow_step == 2


def _other_rank_overflowing(spec, comm):
    """The other rank's contribution: inf in an all-reduce, or the packed payload of a gradient holding 2e5."""
    if comm is TwoRankComm:
        return lambda t: torch.full_like(t, float("inf"))
    other, big = build_compressor(spec), grad(9)
    big[3] = float("inf") if spec == "topk" else 2e5
    return lambda t: pack_payload(other.compress(big, SEGMENTS, 2))


@pytest.mark.parametrize("spec,comm", CODECS)
def test_another_ranks_nan_gradient_is_not_named_an_overflow_for_certain(spec, comm):
    """A NaN loss on rank 0 alone (2 gloo ranks, fp16): rank 1's error said its codec's payload had overflowed, "a step
    fp32 DDP ... would have taken", of a NaN that fp32 DDP sends alike. An overflow decodes as inf; NaN comes from a
    non-finite gradient elsewhere (or +inf and -inf summed, as a real 2-rank loss spike gave): said as either."""
    codec, nan = build_compressor(spec), grad(9)
    nan[3] = float("nan")
    other = ((lambda t: torch.full_like(t, float("nan"))) if comm is TwoRankComm else
             (lambda t: pack_payload(build_compressor(spec).compress(nan, SEGMENTS, 0))))
    out = codec.reduce(grad(0), SEGMENTS, comm(other), step=0).wait()
    assert out.isnan().any() and codec.payload_overflow_step is None and codec.payload_nan_step == 0
    message = payload_overflow_message(codec, 2, nan=True)
    assert "another rank's were non-finite (see its error), or the" in message and "would have taken" not in message


def test_topk_with_bf16_values_is_not_told_of_fp16():
    """top-k with bf16 values was told its payload 'overflowed fp16 (a gradient value above 65504 x 2 ranks ...)'
    and to use strategy.compressor=bf16: the fp16 all-reduce's bound and fix."""
    message = payload_overflow_message(build_compressor({"name": "topk", "value_dtype": "bf16"}), 2)
    assert "overflowed bf16 (a kept value past bf16's range" in message and "value_dtype=fp32, or" in message
    assert "fp16" not in message and "compressor=bf16" not in message


def test_bf16_and_fp32_topk_pay_no_check_and_note_nothing():
    for spec, comm in [("bf16", TwoRankComm), ("topk", TwoRankGatherComm)]:
        codec = build_compressor(spec)
        out = codec.reduce(grad(0), SEGMENTS, comm(_other_rank_overflowing(spec, comm)), step=0).wait()
        assert not torch.isfinite(out).all() and codec.payload_overflow_step is None


class _Spiking(LitLLM):
    """LitLLM on random tokens whose loss at step 2 is multiplied by 1e7: finite fp32 gradients above 65504."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        model = build_llama(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
        super().__init__(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step == 2:
            out["loss"] = out["loss"] * 1e7
        return out

    def train_dataloader(self):
        x = torch.randint(0, 257, (32, 17), generator=torch.Generator().manual_seed(0))
        return DataLoader([{"input_ids": r[:-1], "labels": r[1:]} for r in x], batch_size=4)


@pytest.mark.parametrize("codec,named", [("fp16", True), ("none", False)])
def test_the_nonfinite_error_names_the_fp16_payload(tmp_path, codec, named):
    """On one process the codec still decodes what it would send: the fp16 payload of a finite gradient near 1e5
    becomes inf there, as on every rank of a real run (2 gloo ranks: fp16 stopped at step 3, none and bf16 trained
    on). ``none`` sends fp32 and trains on with the clip."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=1.0,
                        strategy=CompressedDDPStrategy(compressor=codec), default_root_dir=tmp_path)
    if not named:
        trainer.fit(_Spiking())
        assert trainer.global_step == 4
        return
    with pytest.raises(NonFiniteError, match=r"non-finite gradients at step 2 .*the 'fp16' codec's payload "
                                             r"overflowed fp16 .*Use strategy.compressor=bf16"):
        trainer.fit(_Spiking())
