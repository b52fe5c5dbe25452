"""Writing a callback's step scalars under the optimizer step they describe.

``self.log(..., on_step=True)`` inside a callback does not write at that step: Lightning writes the step
metrics only after a step ``k`` with ``(k + 1) % log_every_n_steps == 0``, under that ``k``, with the *last*
value each name was given. A callback with a cadence of its own (every N steps, on every clip or spike event)
therefore had its values written at a later step's number, and the same stale value written again at every
cadence step until it was logged anew. Lightning's ``LearningRateMonitor`` writes to the loggers directly for
this reason; :func:`log_step_metrics` does the same, and also puts the values into ``trainer.callback_metrics``
(``self.log(logger=False)``) for the progress bar and for monitors.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L

from lit_dtrain.utils.loop import logging_axis_step


def log_interval(own: int | None, trainer: L.Trainer) -> int:
    """A callback's logging interval in optimizer steps: its own, else the trainer's ``log_every_n_steps``; 0 means
    no regular rows (Lightning's own meaning of ``log_every_n_steps=0``), events may still be written."""
    return int(own) if own else int(getattr(trainer, "log_every_n_steps", 1))


def logging_step(trainer: L.Trainer) -> int:
    """The step on Lightning's logging axis now: the optimizer step under automatic optimization; under manual
    optimization the batch (Lightning then counts every ``optimizer.step`` in ``global_step``, several per batch
    with several optimizers, and writes the module's logs at the batch count)."""
    module = getattr(trainer, "lightning_module", None)  # (a stand-in trainer in a unit test may have none)
    if module is not None and not module.automatic_optimization:
        return logging_axis_step(trainer)
    return trainer.global_step


def on_log_cadence(every: int, step: int, trainer: L.Trainer | None = None) -> bool:
    """True when optimizer step ``step`` (0-based, the step being taken or just taken) gets a regular row at interval
    ``every``: ``(step + 1) % every == 0``, the steps after which Lightning writes its own step metrics (``train/loss``;
    ``_LoggerConnector.should_update_logs`` in lightning 2.6), and, as there, also when the trainer is about to stop.
    ``every`` 0 means never."""
    if every <= 0:
        return False
    return (step + 1) % every == 0 or bool(getattr(trainer, "should_stop", False))


def log_step_metrics(trainer: L.Trainer, pl_module: L.LightningModule, metrics: Mapping[str, float], step: int,
                     callback_metrics: bool = True) -> None:
    """``metrics`` to every logger now, under optimizer step ``step`` (0-based, Lightning's x axis), on global rank
    0; and, with ``callback_metrics``, into ``trainer.callback_metrics`` (through ``self.log``, ~0.8 ms of CPU a
    name). Values must already be the same on every rank."""
    if not metrics:
        return
    values = {name: float(value) for name, value in metrics.items()}  # one host read each (a GPU tensor: a sync)
    for name, value in values.items() if callback_metrics else ():
        pl_module.log(name, value, on_step=True, on_epoch=False, logger=False, rank_zero_only=True)
    if getattr(trainer, "is_global_zero", True):  # (a stand-in trainer in a unit test may have neither)
        for logger in getattr(trainer, "loggers", ()):
            logger.log_metrics(dict(values), step=int(step))
            logger.save()  # as Lightning's own logger connector does after every write (CSV rows reach the file)
