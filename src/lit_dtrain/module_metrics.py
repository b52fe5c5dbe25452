"""The validation-loss metric of :class:`~lit_dtrain.module.LitLLM`: a token-weighted mean whose sums stay in fp32 (or
wider) under every precision, and that reports NaN when any token's loss is NaN."""

from __future__ import annotations

import math

import torch
from torchmetrics import MeanMetric

HALF = (torch.float16, torch.bfloat16)


class ValLossMean(MeanMetric):
    """``MeanMetric(nan_strategy=nan)`` whose states are never cast to a 16-bit float.

    ``trainer.precision=bf16-true`` (also ``16-true``) converts the whole module with ``.to(dtype)``, and torchmetrics
    lets that cast a metric's states: the loss x weight sum and the token count were accumulated in bf16, and val/loss
    came out as a bf16 number, 5.4688 where the tokens' mean was 5.4805 (a step of 1/128 of the loss: the nano model's
    1.39 was one of 1.3828, 1.3906, 1.3984), for ModelCheckpoint's choice and summary.json. Such a cast is undone
    here: the states go back to fp32 (a ``64-true`` run keeps fp64 states).

    NaN: the default ``nan_strategy`` drops NaNs (with a warning), and a model whose logits overflowed on some windows
    reported the mean of the others as a healthy val/loss. A float strategy puts that float (NaN) in their place;
    ``"disable"`` cannot be used, it replaces every weight by 1 (loss_weight).
    """

    def __init__(self) -> None:
        super().__init__(nan_strategy=math.nan)

    def _apply(self, fn, exclude_state=""):
        this = super()._apply(fn, exclude_state)
        if any(isinstance(v, torch.Tensor) and v.dtype in HALF for v in (getattr(this, k) for k in this._defaults)):
            this.set_dtype(torch.float32)  # (set_dtype applies a cast through _apply once more, to fp32)
        return this
