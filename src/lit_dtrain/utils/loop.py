"""Where Lightning's training loop is within an optimizer step: one place for the private call it takes."""

from __future__ import annotations

from typing import Any


def mid_accumulation(trainer: Any) -> bool:
    """Whether the micro-batch that just ran is not its optimizer step's last (Lightning's private
    ``_TrainingEpochLoop._should_accumulate``: it steps on an epoch's final batch even mid-accumulation). A stop, a
    checkpoint or a count taken here would split a step: its accumulated gradients are in no checkpoint."""
    return trainer.fit_loop.epoch_loop._should_accumulate()
