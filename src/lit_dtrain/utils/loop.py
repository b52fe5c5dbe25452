"""Where Lightning's training loop is within an optimizer step, and whether its ``Timer`` can stop it mid-step: one
place for the private names they read."""

from __future__ import annotations

from typing import Any


def mid_accumulation(trainer: Any) -> bool:
    """Whether the micro-batch that just ran is not its optimizer step's last (Lightning's private
    ``_TrainingEpochLoop._should_accumulate``: it steps on an epoch's final batch even mid-accumulation). A stop, a
    checkpoint or a count taken here would split a step: its accumulated gradients are in no checkpoint."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def lightnings_timer_splits_steps(trainer: Any) -> int | None:
    """The largest ``accumulate_grad_batches`` of a fit whose time limit is Lightning's own ``Timer``
    (``Trainer(max_time=...)``) checked per batch: it stops between micro-batches, mid-step; None where it cannot
    (no such timer, one micro-batch a step, or ``lit_dtrain.callbacks.StepEndTimer``, which waits for the step's
    end). Reads the ``Timer``'s private ``_duration`` and ``_interval`` (lightning 2.6)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler, Timer

    if not any(type(c) is Timer and c._duration is not None and c._interval == "step" for c in trainer.callbacks):
        return None
    most = max([int(trainer.accumulate_grad_batches or 1)] + [
        max(c.scheduling.values()) for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)])
    return most if most > 1 else None
