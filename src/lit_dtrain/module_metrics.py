"""The metrics of :class:`~lit_dtrain.module.LitLLM`: the validation-loss metric (a token-weighted mean whose sums stay
in fp32 or wider under every precision, and that reports NaN when any token's loss is NaN), and
:func:`log_every_step`, ``train/loss``'s ``self.log`` at a fraction of its host cost."""

from __future__ import annotations

import math

import lightning as L
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


def log_every_step(module: L.LightningModule, name: str, value: torch.Tensor, batch_size: int) -> None:
    """``module.log(name, value, on_step=True, prog_bar=True, batch_size=batch_size)`` from ``training_step``, with
    the same effect at every step (loggers, ``trainer.callback_metrics``, ``progress_bar_metrics``) for about a
    quarter of the host time. ``self.log`` re-registers the value at every call: it rebuilds its metadata and moves
    the stored result to the value's device by walking the whole result object (``_ResultMetric.to``), ~0.6-0.8 ms
    of CPU per step, the largest host cost of a default step outside forward, backward and the optimizer
    (docs/benchmarks.md).
    Once ``self.log`` has registered the name in this loop, the value goes into the stored result the way
    ``self.log`` puts it there (``_ResultCollection.update_metrics``; Lightning 2.6's internals, which pyproject
    pins); any other case takes ``self.log`` itself: the first step of a fit or epoch (Lightning resets the step's
    results there), another hook or device, a stored entry of another form (not on-step-only with ``prog_bar``),
    a run with no result collection (``self.log`` warns or refuses as it does)."""
    trainer = module._trainer
    results = getattr(trainer, "_results", None) if trainer is not None else None
    fx = "training_step"
    key = f"{fx}.{name}"
    stored = results.get(key) if results is not None and results.dataloader_idx is None else None
    if (stored is None or module._current_fx_name != fx or not stored.meta.prog_bar or not stored.meta.on_step
            or stored.meta.on_epoch or not isinstance(stored.value, torch.Tensor) or stored.value.device != value.device
            or value.numel() != 1 or trainer._logger_connector.should_reset_tensors(fx)):
        module.log(name, value, on_step=True, prog_bar=True, batch_size=batch_size)
        return
    results.update_metrics(key, value.detach().squeeze(), batch_size)  # (it stores a clone: the value is not kept)
    trainer._logger_connector._current_fx = fx


def window_losses(token_loss: torch.Tensor, batch) -> dict:
    """``LitLLM.predict_step``'s result for a batch of windows: ``loss [B]`` (each window's mean token loss),
    ``token_loss [B, T]`` and ``index [B]`` (the window's index in its source's validation stream, or ``None``).
    Windows whose ``loss_weight`` is 0 are dropped: they are the fillers that give every data-parallel rank as many
    validation windows (``LMDataModule.val_dataloader``), so the ranks' results hold each window exactly once."""
    index = batch.get("index")
    if "loss_weight" in batch:
        keep = batch["loss_weight"] != 0
        if not bool(keep.all()):
            token_loss = token_loss[keep]
            index = None if index is None else index[keep]
    return {"loss": token_loss.mean(dim=1), "token_loss": token_loss, "index": index}
