"""``WSDScheduler``: the warmup-stable-decay schedule as a plug-in callback for any LightningModule.

It sets ``lr = base_lr * wsd_lr_factor(global_step)`` on every param group of every optimizer of the
trainer, so another project gets WSD without touching its ``configure_optimizers``. The factor is the
same pure function :func:`lit_dtrain.schedules.wsd_lr_factor` that ``conf/scheduler/wsd.yaml`` hands to
``LambdaLR``, and the LR sequence is identical to the scheduler's.

The base (peak) LRs are the configured ones: they are read from the freshly built optimizers in
``on_fit_start``, which Lightning calls after ``configure_optimizers`` and before it restores a
checkpoint's optimizer state, and kept in the callback's state. A resume uses the configured peaks too,
whether the checkpoint holds this callback's state (its saved peaks are replaced, logged when they differ:
a resume with a lowered LR kept the old peak) or not (written with the ``LambdaLR`` scheduler instead),
never the restored optimizer's LR, which is already scaled (0 at the end of a decay to 0). The schedule's
arguments come from the constructor, so resuming with a larger ``total_steps`` extends the run and a new
``decay_steps`` starts a decay branch. ``total_steps=None`` takes the trainer's planned steps at each train start
(``trainer.estimated_stepping_batches``): a resume with a larger ``max_epochs`` extends the run, the same trainer
takes the same horizon (recorded in the callback's state).

Under manual optimization Lightning's ``global_step`` counts every ``optimizer.step``, two a batch with two
optimizers, so it is no optimizer's step count: there each optimizer's ``k``-th update uses the schedule's LR for
step ``k`` (its updates are counted in a step post-hook, which sets the LR of its next one, and checkpointed). A
call the GradScaler skips counts too, as ``global_step`` counts it under automatic optimization.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._lr_scaling import restore_lrs
from lit_dtrain.callbacks._state_keys import note_stage, state_is_for_fit
from lit_dtrain.callbacks._step_hooks import StepHooksCallback
from lit_dtrain.callbacks._wsd_conflicts import LRSetElsewhere, refuse_an_unreturned_scheduler, refuse_other_lr_setters
from lit_dtrain.callbacks._wsd_horizon import (
    FROM_TRAINER,
    estimated_steps,
    note_short_fit,
    planned_steps,
    warn_if_stopped_before_the_decay,
    warn_if_the_horizon_moves_the_lr,
    warn_optimizers_left_behind,
    warn_past_the_horizon,
)
from lit_dtrain.optim import set_lr
from lit_dtrain.schedules.lr import check_wsd_args, wsd_lr_factor
from lit_dtrain.utils.rank_zero import log_once
from lit_dtrain.utils.words import counted, plural

log = logging.getLogger(__name__)


NO_HORIZON = 2**62  # a horizon no fit reaches: the warmup, then the peak LR


class WSDScheduler(StepHooksCallback):
    """Warmup-stable-decay LR for every optimizer of the trainer (no ``LRScheduler`` needed).

    Args:
        total_steps: schedule horizon in optimizer steps; the decay ends on step ``total_steps - 1``. ``None`` (the
            default): the trainer's planned steps, ``trainer.estimated_stepping_batches`` at each train start (from
            ``max_steps``/``max_epochs``; a ``ConfigError`` where it is unknown). A trainer that will take more steps
            than a given ``total_steps`` is warned about at train start (its last steps would run at
            ``min_lr_factor``).
        warmup_steps: linear warmup steps, factor ``(step + 1) / warmup_steps``.
        decay_steps: decay length in steps (or give ``decay_fraction``; one of the two is required).
        decay_fraction: decay over ``round(decay_fraction * total_steps)`` steps.
        decay_type: ``linear`` | ``cosine`` | ``1-sqrt`` | ``exponential``.
        min_lr_factor: final LR as a fraction of the peak.

    The LR for step ``s`` is set after step ``s - 1`` ends (``on_train_batch_end``, so that
    ``LearningRateMonitor`` logs the schedule's LR of step ``s`` whatever the callback order) and
    again right before step ``s`` (``on_train_batch_start``, idempotent), and at ``on_train_start`` for
    the first step of a fit or a resume. With gradient accumulation every micro-batch of one optimizer
    step sees the same ``global_step`` and so the same LR. Under manual optimization the step is each
    optimizer's own count of updates (see the module docstring): with two optimizers that step every batch,
    ``total_steps`` is ``max_steps / 2``.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        warmup_steps: int = 0,
        decay_steps: int | None = None,
        decay_fraction: float | None = None,
        decay_type: str = "1-sqrt",
        min_lr_factor: float = 0.0,
    ) -> None:
        if decay_steps is None and decay_fraction is None:  # (HF's get_wsd_schedule has no default either)
            raise ValueError(
                "WSDScheduler: give the decay's length, decay_steps=<steps> or decay_fraction=<share of total_steps> "
                "(lit_dtrain's own runs use decay_fraction=0.2, the last 20% of the steps); there is no default"
            )
        self._arguments = {"total_steps": total_steps, "warmup_steps": warmup_steps, "decay_steps": decay_steps,
                           "decay_type": decay_type, "min_lr_factor": min_lr_factor, "decay_fraction": decay_fraction}
        self.total_steps: int | None = None  # None until train start when the horizon is the trainer's
        self.decay_steps: int | None = None
        self._set_horizon(total_steps if total_steps is not None else NO_HORIZON)  # (without one: checks the rest)
        if total_steps is None:
            self.total_steps = self.decay_steps = None
        self.warmup_steps, self.decay_type = int(warmup_steps), str(decay_type)
        self.min_lr_factor = float(min_lr_factor)
        self._saved_schedule: dict = {}  # a checkpoint's schedule, compared with this fit's once its horizon is known
        self._schedule_source = "the checkpoint's run"  # or the previous fit's of the same Trainer
        self._resumed_schedule: dict = {}  # the checkpoint's schedule: the LR it gives the restored step is compared
        # False: a caller that checks a resume's LR against the config itself (train.py, before the fit) leaves the
        # check of a given schedule to it; a horizon taken from the trainer (total_steps=None) is checked here still
        self.warn_on_resume_lr = True
        # a caller whose resume of an early-stopped checkpoint trains no step (train.py: KeepEarlyStop) names its
        # way to decay a run stopped before its decay (its decay branch); None: resume with a shorter total_steps
        self.decay_advice: str | None = None
        self._start_step = 0  # global_step at train start: a fit that trained no step says nothing at its end
        self._planned: float | None = None  # the trainer's planned steps at train start (automatic optimization)
        self._past_due = False  # a step past the horizon is still to be warned about (automatic optimization)
        self.base_lrs: list[list[float]] | None = None  # per optimizer, per param group
        self.last_step: int = -1  # the step whose LR was set last
        self.updates: list[int] | None = None  # manual optimization: each optimizer's step calls so far (its step)
        self._index: dict[int, int] = {}  # manual optimization: id(optimizer) -> its position in trainer.optimizers
        self._lr_check = LRSetElsewhere()  # an LR other code sets over this callback's: refused
        self._remove_hooks()

    def _set_horizon(self, total_steps: int, why: str = "") -> None:
        try:
            self.decay_steps = check_wsd_args(**{**self._arguments, "total_steps": total_steps})
        except ValueError as e:
            raise ValueError(f"WSDScheduler: {e}{why}") from None
        self.total_steps = int(total_steps)

    def lr_factor(self, step: int) -> float:
        """The schedule's factor for optimizer step ``step``."""
        if self.total_steps is None:
            raise RuntimeError(f"{FROM_TRAINER} at train start; no fit has started")
        return wsd_lr_factor(
            step,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            decay_type=self.decay_type,
            min_lr_factor=self.min_lr_factor,
        )

    def _apply(self, trainer: L.Trainer, step: int | list[int]) -> None:
        """Set every optimizer's LRs for ``step`` (one for all, or one per optimizer)."""
        optimizers = trainer.optimizers
        if self.base_lrs is None:
            raise RuntimeError("WSDScheduler: base LRs are unknown; on_train_start did not run")
        if [len(o.param_groups) for o in optimizers] != [len(b) for b in self.base_lrs]:
            raise RuntimeError(
                f"WSDScheduler: the optimizers' param groups {[len(o.param_groups) for o in optimizers]} do not "
                f"match the {[len(b) for b in self.base_lrs]} whose peak LRs it read at fit start (or from the "
                "checkpoint); a param group added during training has no peak LR"
            )
        steps = step if isinstance(step, list) else [step] * len(optimizers)
        for optimizer, base_lrs, optimizer_step in zip(optimizers, self.base_lrs, steps):
            self._set(optimizer, base_lrs, optimizer_step)

    def _set(self, optimizer, base_lrs: list[float], step: int) -> None:
        factor = self.lr_factor(step)
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            set_lr(group, base_lr * factor)
        self._lr_check.note(optimizer, [base_lr * factor for base_lr in base_lrs])
        self.last_step = step

    def _after_update(self, optimizer, args, kwargs, index: int) -> None:
        # manual optimization: this optimizer took its update; set the LR of its next one. A per-step scaling (the
        # FourierSampler's stage multiplier) is taken back first, so that its own restore cannot write over this LR
        self._pending.pop(index, None)
        restore_lrs(optimizer)
        self._count_update(optimizer, index)

    def _count_update(self, optimizer, index: int) -> None:
        self.updates[index] += 1
        self._set(optimizer, self.base_lrs[index], self.updates[index])

    def _remove_hooks(self) -> None:
        super()._remove_hooks()
        self._lr_check.remove()
        self._pending: dict[int, object] = {}  # manual optimization: optimizer index -> the optimizer, whose step was
        # called this batch but has not reached its post-hook (yet, or ever: the GradScaler skipped it)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # Every optimizer.step call, taken or not, is one step of the schedule, as under automatic optimization
        # (global_step counts a step the GradScaler skips). Lightning calls this hook for each one; torch calls the
        # post-hook only when the update runs (a foreach optimizer whose step the GradScaler skipped never runs it, a
        # fused one does), so a call without its post-hook is counted here at the next call or at batch end.
        index = self._index.get(id(optimizer)) if self._hooks else None
        if index is None:
            return
        if index in self._pending:  # its previous call this batch was skipped (16-mixed: no scaling is in flight here)
            self._count_update(optimizer, index)
        self._pending[index] = optimizer

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        note_stage(self, stage)
        # Runs before a checkpoint is restored: a fit that does not resume reads its peaks in on_fit_start, even
        # when this callback object already served another fit (a sweep loop, staged training).
        if stage == "fit":
            # a second fit of the same Trainer goes on from its global_step: compared at train start as a resume is
            again = trainer.global_step > 0 and self.last_step >= 0 and self._arguments["total_steps"] is None
            previous = {k: v for k, v in self.state_dict().items() if k in self._arguments} if again else {}
            self.base_lrs, self.last_step, self._resumed_schedule = None, -1, {}
            if trainer.global_step == 0:  # (a second fit of this Trainer keeps each optimizer's count of updates: taken
                self.updates = None  # from global_step, [12, 12] for a GAN's [16, 8], both LRs jumped silently)
            if self._arguments["total_steps"] is None:  # (another fit's horizon is not this one's)
                self.total_steps = self.decay_steps = None
            self._saved_schedule, self._schedule_source = previous, "the previous fit of this Trainer"

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The optimizers are built, but a checkpoint's optimizer state is not restored yet (Lightning's _run:
        # strategy.setup, on_fit_start, then restore_training_state): their LRs are the configured peaks. Reading
        # them later would take a resumed scheduler-form checkpoint's scaled LR (0 after a full decay) as the peak.
        # They win over the peaks this callback's restored state holds (Lightning restores callbacks before
        # setup): a resume with another configured LR (lowered after an instability) kept the old peak silently.
        if not trainer.optimizers:
            return
        refuse_an_unreturned_scheduler(trainer, pl_module)
        configured = [[float(g["lr"]) for g in o.param_groups] for o in trainer.optimizers]
        if self.base_lrs is not None and self.base_lrs != configured:
            if [len(b) for b in self.base_lrs] == [len(b) for b in configured]:
                log_once(log, logging.INFO, "WSDScheduler: the configured peak LRs %s replace the checkpoint's %s",
                         configured, self.base_lrs)
            else:  # another set of param groups: _apply names the mismatch
                return
        self.base_lrs = configured

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._arguments["total_steps"] is None and getattr(trainer, "fast_dev_run", False):
            # Lightning replaced max_steps by fast_dev_run's n batches, so the run's length is unknown: a horizon of n
            # refused every smoke test whose warmup_steps + decay did not fit in n ("warmup_steps=2 + decay_steps=0 >
            # total_steps=1"). Its steps run as the first steps of a longer run: the warmup, then the peak LR.
            self._set_horizon(NO_HORIZON)
            rank_zero_info(f"WSDScheduler: fast_dev_run={trainer.fast_dev_run}: the run's length is unknown, so its "
                           "steps run the schedule's warmup and peak LR (no decay)")
        elif self._arguments["total_steps"] is None:
            # Not earlier: trainer.estimated_stepping_batches sets up the train DataLoader when the fit loop has not
            # yet, and one set up before the checkpoint's restore never loads its saved state (Lightning #20550): a
            # stateful DataLoader resumed from its first batch
            planned = planned_steps(trainer, pl_module)
            self._set_horizon(planned, " (total_steps=None: trainer.estimated_stepping_batches)")
            self._log_schedule_change()
        if not trainer.optimizers:
            raise RuntimeError("WSDScheduler needs an optimizer; configure_optimizers returned none")
        refuse_other_lr_setters(trainer)
        if self.base_lrs is None:
            raise RuntimeError(
                "WSDScheduler: the peak LRs are unknown: the optimizers did not exist at on_fit_start and no "
                "checkpoint restored this callback's state (the restored optimizer's LR is not the peak)"
            )
        step, self._start_step, self._planned = trainer.global_step, trainer.global_step, None
        resumed, self._resumed_schedule = self._resumed_schedule, {}
        given = self._arguments["total_steps"] is not None
        if self.warn_on_resume_lr or not given:
            warn_if_the_horizon_moves_the_lr(resumed, step, self.total_steps, self.lr_factor, self._schedule_source,
                                             self.warmup_steps, given)
        self._remove_hooks()
        self._lr_check.register(trainer.optimizers)
        if not pl_module.automatic_optimization:
            optimizers = trainer.optimizers
            if self.updates is None or len(self.updates) != len(optimizers):
                # a fresh fit (0), or a checkpoint without the counts: every optimizer stepped at each of its steps
                self.updates = [step // len(optimizers)] * len(optimizers)
            self._apply(trainer, self.updates)
            self._index = {id(optimizer): i for i, optimizer in enumerate(optimizers)}
            for i, optimizer in enumerate(optimizers):
                self._hooks.append(optimizer.register_step_post_hook(partial(self._after_update, index=i)))
            step = min(self.updates)
        else:
            self.updates = None
            self._apply(trainer, step)
            self._past_due = step < self.total_steps  # (warned once, when a step past the horizon starts)
            if not getattr(trainer, "fast_dev_run", False):  # (its n steps are not the run's: no advice on them)
                self._check_horizon(trainer, step)
        if step >= self.total_steps:
            msg = "WSDScheduler: resuming at step %d >= total_steps=%d: the LR stays at min_lr_factor"
            log_once(log, logging.WARNING, msg, step, self.total_steps)

    def _check_horizon(self, trainer: L.Trainer, step: int) -> None:
        """Warn when the trainer will take more steps than ``total_steps`` (a ``max_epochs`` run, or ``max_steps``
        larger than the horizon): every step past it runs at ``min_lr_factor`` (LR 0 by default), training nothing
        while it costs compute. Fewer steps: see ``_note_short_fit``. (Under manual optimization the trainer's step
        count is not an optimizer's.)"""
        planned = self._planned = estimated_steps(trainer)  # min(max_steps, max_epochs x steps); inf, -1: no end
        if not math.isfinite(planned) or planned < 0:
            return
        planned = int(planned)
        if step < planned < self.total_steps and self.decay_steps > 0:
            note_short_fit(self, planned)
        if planned <= self.total_steps or step >= self.total_steps:
            return  # (a resume past the horizon gets the warning below)
        self._past_due = False
        past = planned - self.total_steps
        rank_zero_warn(
            f"WSDScheduler: the trainer will take {planned} optimizer steps (trainer.estimated_stepping_batches, "
            f"from max_steps/max_epochs), but total_steps={self.total_steps}: the decay ends at step "
            f"{self.total_steps - 1} and the last {counted(past, 'step')} {plural(past, 'runs', 'run')} at "
            f"min_lr_factor={self.min_lr_factor} of the peak LR. Set total_steps={planned} (or stop the trainer at "
            f"max_steps={self.total_steps})"
        )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # manual optimization: the optimizers' updates are known only now (with two optimizers and total_steps set
        # to max_steps, each took half the schedule and the run ended in its stable phase, without a word)
        if getattr(trainer, "fast_dev_run", False):
            return
        if self.updates and self.decay_steps > 0 and max(self.updates) < self.total_steps:
            note_short_fit(self, max(self.updates), manual=True)
        elif self.updates and self.decay_steps > 0 and min(self.updates) < self.total_steps:
            warn_optimizers_left_behind(self.updates, self.total_steps, self.decay_steps, self.lr_factor)
        elif not self.updates and self.decay_steps > 0 and trainer.global_step > self._start_step:
            warn_if_stopped_before_the_decay(trainer, self.total_steps, self.decay_steps, self.lr_factor,
                                             self.decay_advice, self.warmup_steps, self._planned)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not self._hooks:  # (manual optimization: set after each update)
            self._apply(trainer, trainer.global_step)
            if self._past_due and trainer.global_step >= self.total_steps:  # the estimate at train start was wrong
                self._past_due = False
                warn_past_the_horizon(trainer.global_step, self.total_steps, self.min_lr_factor, self._planned,
                                      trainer.reload_dataloaders_every_n_epochs)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._lr_check.check_at_batch_end(trainer)
        if not self._hooks:
            self._apply(trainer, trainer.global_step)  # global_step already counts the step that just ended
        for index, optimizer in self._pending.items():  # manual optimization: a step the GradScaler skipped
            self._count_update(optimizer, index)
        self._pending = {}

    @override
    def state_dict(self) -> dict:
        # a fit resumed at its max_steps never reaches train start (where total_steps=None takes the trainer's horizon):
        # a checkpoint saved after it keeps the restored one's (None put an extension back at the peak LR unwarned)
        restored = self._saved_schedule if self.total_steps is None else {}
        return {
            "base_lrs": [list(b) for b in self.base_lrs] if self.base_lrs is not None else None,
            "last_step": self.last_step,
            "optimizer_updates": list(self.updates) if self.updates is not None else None,  # manual optimization
            "total_steps": restored.get("total_steps", self.total_steps),  # for information: the arguments win
            "warmup_steps": self.warmup_steps,
            "decay_steps": restored.get("decay_steps", self.decay_steps),
            "decay_type": self.decay_type,
            "min_lr_factor": self.min_lr_factor,
        }

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        if not state_is_for_fit(self):
            return
        if "base_lrs" not in state_dict:
            raise KeyError(f"WSDScheduler state has no 'base_lrs'; got keys {sorted(state_dict)}")
        base = state_dict["base_lrs"]
        saved = [[float(x) for x in b] for b in base] if base is not None else None
        if self.base_lrs is None or saved is None or [len(b) for b in saved] != [len(b) for b in self.base_lrs]:
            self.base_lrs = saved
        # else: on_fit_start read the configured peaks already (a strategy that restores after setup), and they win
        self.last_step = int(state_dict.get("last_step", -1))
        updates = state_dict.get("optimizer_updates")  # absent before it existed, None under automatic optimization
        self.updates = [int(u) for u in updates] if updates is not None else None
        self._saved_schedule = {k: state_dict[k] for k in self._arguments if k in state_dict}
        self._schedule_source = "the checkpoint's run"
        if self.total_steps is not None:  # (else: at train start, once the trainer's horizon is taken)
            self._log_schedule_change()

    def _log_schedule_change(self) -> None:
        changed = {k: (v, getattr(self, k)) for k, v in self._saved_schedule.items() if v != getattr(self, k)}
        self._resumed_schedule = self._saved_schedule  # the LR it gives: checked at train start, at the restored step
        self._saved_schedule = {}
        if changed:
            log_once(log, logging.INFO, "WSDScheduler: resuming with a changed schedule (saved, now): %s", changed)
