"""Tokens/s logging through Lightning's own ``ThroughputMonitor``.

``ThroughputMonitor`` needs to know how big a batch is; for the lit_dtrain batch contract the "items"
it counts are tokens, so ``train/device/items_per_sec`` is tokens/s of this rank (and
``train/device/samples_per_sec`` its sequences/s). With several ranks Lightning also logs the global
figures ``train/items_per_sec`` and ``train/samples_per_sec`` (the per-device rate times the world size).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ThroughputMonitor


def _batch_size(batch: dict) -> int:
    return int(batch["input_ids"].size(0))


def _tokens(batch: dict) -> int:
    return int(batch["input_ids"].numel())


def token_throughput_monitor(window_size: int = 50) -> ThroughputMonitor:
    """A ``ThroughputMonitor`` that counts sequences and tokens of ``{"input_ids": [B, T]}`` batches."""
    return ThroughputMonitor(batch_size_fn=_batch_size, length_fn=_tokens, window_size=window_size)
