"""Lightning's ``LearningRateMonitor``, one row per optimizer step under gradient accumulation.

Lightning's monitor logs the LR in ``on_train_batch_start``, which runs once per micro-batch, and its check
(``trainer._logger_connector.should_update_logs``) looks at the count of optimizer steps taken, which does not change
within a step: with ``accumulate_grad_batches=A`` every logged step got ``A`` identical ``lr-*`` rows (CSV rows at
steps 1, 1, 3, 3, ... for ``A=2``). :class:`OncePerStepLRMonitor` lets the first micro-batch of a step log, as before,
and skips the rest. Lightning also logs an optimizer without an LR scheduler (the one ``WSDScheduler`` drives) at every
epoch start, at the step whose first batch logs it again: a ``max_epochs`` run got two rows at each epoch's first step.
There only the epoch-interval schedulers are logged. Checked lightning 2.6: no option of ``LearningRateMonitor`` does
this.

``lr-<optimizer>/<group>`` is the schedule's LR. When a callback scales the LR of an update and puts it back right
after (``LossSpikeMonitor``'s ``lr_cooldown``, the FourierSampler's stage multiplier: a callback with a true
``scales_lr``), the update used another LR, which the schedule's tag never showed: ``lr-<optimizer>/<group>-effective``
is that LR, at the same steps (a step without an update has no point: one the GradScaler skipped, one whose
gradients ``LossSpikeMonitor``'s ``skip`` or ``rollback`` dropped, since its ``optimizer.step`` moved nothing). It
goes with the rows of an optimizer step, never an epoch start's: an optimizer whose LR is logged at epoch starts only
(``logging_interval='epoch'``, or ``None`` with its scheduler stepped per epoch, as Lightning's monitor does) has no
``-effective`` tag; ``logging_interval='step'`` logs both at every step.

Lightning's monitor also appends every logged LR to its ``lrs`` lists and never drops one: a run that logs every step
kept 2,000 values per param group after 2,000 steps, one more each logged step for as long as it runs (the loggers
already hold them). :class:`OncePerStepLRMonitor` keeps the latest :attr:`~OncePerStepLRMonitor.lrs_kept` (1000).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from typing_extensions import override

from lit_dtrain.callbacks._lr_scaling import pop_applied_lrs, track_applied_lrs


class OncePerStepLRMonitor(LearningRateMonitor):
    """``LearningRateMonitor`` (same arguments, names, ``logging_interval`` and momentum/weight decay logging) that
    writes the step-interval LRs once per optimizer step, at the step's first micro-batch, whatever
    ``accumulate_grad_batches`` is, and an optimizer without an LR scheduler once at an epoch's first step. It keeps no
    checkpoint state, as Lightning's monitor keeps none. Its ``lrs`` lists hold the latest ``lrs_kept`` LRs of each
    tag (Lightning's keep every logged one, a list that grows for as long as the run logs)."""

    lrs_kept = 1000  # values kept per tag in ``lrs``, the latest

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen_step: int | None = None  # the logging step of the last micro-batch seen
        self._effective = False  # a callback scales the LR of an update: log the LR it used too
        self._due: int | None = None  # the step whose schedule LR was logged and whose update's LR is owed
        self._names: dict[int, tuple] = {}  # id(optimizer) -> (optimizer, its groups' lr tags), of this step's row

    @override
    def on_train_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._seen_step = self._due = None  # a new fit (or a resume) starts counting afresh
        self._names = {}
        self._effective = any(getattr(cb, "scales_lr", False) for cb in trainer.callbacks)
        if self._effective:
            for optimizer in trainer.optimizers:
                track_applied_lrs(optimizer)
        super().on_train_start(trainer, *args, **kwargs)

    @override
    def _get_optimizer_stats(self, optimizer, names):  # the tags of each optimizer's groups, for the effective LRs
        self._names[id(optimizer)] = (optimizer, names)
        stats = super()._get_optimizer_stats(optimizer, names)
        for values in self.lrs.values():  # (Lightning's _extract_lr has just appended this step's LRs)
            del values[: max(0, len(values) - self.lrs_kept)]  # (not [:-kept]: [:-0] kept every one)
        return stats

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        # Lightning's monitor logs at this counter; it moves once per optimizer step (per batch under manual
        # optimization), so a micro-batch that finds it unchanged belongs to a step whose first micro-batch logged
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if step == self._seen_step:
            return
        self._seen_step = step
        self._names = {}  # this step's row names only the optimizers it logs (under None, no epoch-interval one's)
        super().on_train_batch_start(trainer, *args, **kwargs)
        # (None on a step that is not logged: a logged step whose update never came, a dropped or GradScaler-skipped
        # one, must not lend its number to a later step's LR)
        logged = self._effective and self.logging_interval != "epoch" and trainer._logger_connector.should_update_logs
        self._due = step if logged else None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if not self._effective:
            return
        applied = {id(opt): pop_applied_lrs(opt) for opt in trainer.optimizers}  # (also drops those not logged)
        if self._due is None or not any(applied.values()):
            return  # not a logged step, or a micro-batch that accumulates
        stats = {}
        for key, lrs in applied.items():
            if lrs is not None and key in self._names:
                stats.update({f"{name}-effective": float(lr) for name, lr in zip(self._names[key][1], lrs)})
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=self._due)
        self._due = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.logging_interval is not None or not trainer._logger_connector.should_update_logs:
            super().on_train_epoch_start(trainer, *args, **kwargs)
            return
        # The first batch logs the optimizers without a scheduler at this same step (Lightning logs them at both
        # intervals); here only the schedulers stepped per epoch, whose LRs the step rows leave out.
        names, _, _ = self._find_names_from_schedulers(trainer.lr_scheduler_configs)
        self._remap_keys(names)
        stats = {}
        for name, config in zip(names, trainer.lr_scheduler_configs):
            if config.interval == "epoch":
                stats.update(self._get_optimizer_stats(config.scheduler.optimizer, name))
        if not stats:
            return
        device = trainer.strategy.root_device
        trainer.callback_metrics.update({name: torch.tensor(value, device=device) for name, value in stats.items()})
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
