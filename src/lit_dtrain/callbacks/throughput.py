"""Tokens/s logging through Lightning's own ``ThroughputMonitor``.

``ThroughputMonitor`` needs to know how big a batch is; for the lit_dtrain batch contract the "items"
it counts are tokens, so ``train/device/items_per_sec`` is tokens/s of this rank (and
``train/device/samples_per_sec`` its sequences/s). With several ranks Lightning also logs the global
figures ``train/items_per_sec`` and ``train/samples_per_sec`` (the per-device rate times the world size).
Every micro-batch's tokens count; the rates are averaged over the last ``window_size`` optimizer steps.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage


def _input_ids(batch):
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if ids is None:
        got = f"a dict with keys {sorted(batch)}" if isinstance(batch, Mapping) else type(batch).__name__
        raise TypeError(
            f"token_throughput_monitor counts batches of the form {{'input_ids': Tensor[B, T]}}, got {got}; for other "
            "batches use Lightning's ThroughputMonitor(batch_size_fn=..., length_fn=...) directly"
        )
    return ids


def _batch_size(batch: dict) -> int:
    return int(_input_ids(batch).size(0))


def _tokens(batch: dict) -> int:
    return int(_input_ids(batch).numel())


class _StepWindowThroughputMonitor(ThroughputMonitor):
    """``window_size`` in optimizer steps for training. Lightning's window counts the batches it is updated with,
    micro-batches: with ``accumulate_grad_batches=A`` a window of ``n`` covered ``n / A`` steps (a fraction of one
    step for ``n < A``). Validation keeps a window of ``n`` batches. A batch without ``input_ids`` is refused when a
    training batch starts, before it trains."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # Lightning's monitor reads the batch at its end, after the optimizer step: check its form before it trains
        _input_ids(batch)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        accumulate = max(1, int(trainer.accumulate_grad_batches or 1))
        if trainer.state.stage == RunningStage.TRAINING and accumulate > 1:
            kwargs = {**self.kwargs, "window_size": self.kwargs.get("window_size", 100) * accumulate}
            self._throughputs[RunningStage.TRAINING] = Throughput(
                available_flops=self.available_flops, world_size=trainer.world_size, **kwargs
            )


def token_throughput_monitor(window_size: int = 50) -> ThroughputMonitor:
    """A ``ThroughputMonitor`` that counts sequences and tokens of ``{"input_ids": [B, T]}`` batches; the rates are
    averaged over the last ``window_size`` optimizer steps (validation: batches)."""
    return _StepWindowThroughputMonitor(batch_size_fn=_batch_size, length_fn=_tokens, window_size=window_size)
