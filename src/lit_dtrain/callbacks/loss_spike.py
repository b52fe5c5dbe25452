"""``LossSpikeMonitor``: detect a loss spike during training and handle it while the run goes on.

Lightning's ``SpikeDetection`` raises and writes a file of batch indices that nothing reads back. This
callback decides, before every optimizer step, whether the step is a spike (robust running statistics of
the loss, optionally of the grad norm; a non-finite loss or grad always counts; pure logic in
:mod:`lit_dtrain.callbacks._spike_stats`) and then takes the configured ``actions``:

- ``log``: TensorBoard scalars and a text event, plus a console warning;
- ``skip``: the step is not applied: every grad is set to None (torch optimizers then leave the parameters
  and their state untouched), the module's buffers (BatchNorm's statistics) and the GradScaler are restored, and a
  strategy that holds per-step state undoes the step (``CompressedDDPStrategy``: the spike's gradient, already
  folded into the error-feedback residual by the comm hook, is taken out again);
- ``rollback``: model, optimizer (and GradScaler, and the strategy's comm state) are restored from an
  in-memory CPU snapshot taken every ``snapshot_every`` steps (at least ``rollback_min_age`` steps older
  than the spike), PaLM-style;
- ``lr_cooldown``: the LR is multiplied by ``cooldown_factor`` for ``cooldown_steps`` steps, then ramped back;
- ``raise``: :class:`LossSpikeError` once ``raise_after`` spikes fall within ``raise_window`` steps.

With ``skip`` or ``rollback`` the sample ``index`` values of the spiking batch (all ranks' shards, plus the
``exclude_previous_steps`` batches before it) are excluded from ``trainer.datamodule.sampler`` (whose
exclusion set is checkpointed with the datamodule), so they are never trained on again, also after a
resume. Without such a sampler, any later step whose batch holds an excluded index is skipped instead.

The LR schedule follows the step count through skips and rollbacks (a rollback restores weights and optimizer
moments, not the schedule): a run ends on the schedule's last LR however many steps were dropped (see
docs/loss_spikes.md); the dropped steps are not made up for.

Hook order per optimizer step: ``on_train_batch_start`` -> ``on_before_backward`` (loss and indices, per
micro-batch) -> ``on_before_optimizer_step`` (one all-reduce of [loss, grad norm, flags], decision,
grads dropped) -> optimizer and scheduler step -> ``on_train_batch_end`` (restore, exclude, record).
Under DDP the decision uses all-reduced values, so every rank takes the same action. Every event is
appended to ``spikes.jsonl`` in the run dir (``trainer.default_root_dir``) by rank 0 when its step completes.

This file is the Lightning adapter; the parts it calls are ``_spike_args.py`` (argument checks),
``_spike_stats.py`` (statistics, decision), ``_spike_step.py`` (measuring and dropping the step),
``_spike_events.py`` (a spike's event: started, finished, recorded), ``_spike_samples.py`` (sample indices,
exclusion), ``_spike_records.py`` (spikes.jsonl), ``_spike_state.py`` (the checkpointed state) and ``_snapshots.py``
(rollback).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks import _snapshots as snapshots
from lit_dtrain.callbacks import _spike_records as records
from lit_dtrain.callbacks import _spike_state as spike_state
from lit_dtrain.callbacks import _spike_step as step_ops
from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, on_log_cadence
from lit_dtrain.callbacks._lr_scaling import restore_lrs, scale_lrs_for_step
from lit_dtrain.callbacks._spike_args import ACTIONS, check_args, check_fit
from lit_dtrain.callbacks._spike_events import EXCLUDED_SAMPLE, SpikeEvents
from lit_dtrain.callbacks._spike_samples import (
    DROP_ACTIONS,
    ExcludedOnlyRun,
    batch_sample_indices,
    exclusion_sampler,
    gather_indices,
    note_fit_data,
)
from lit_dtrain.callbacks._spike_stats import (
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    SpikeDetector,
    SpikeWindow,
    cooldown_factor,
)
from lit_dtrain.callbacks._state_keys import load_state_under_old_key, note_stage, state_is_for_fit
from lit_dtrain.module import NonFiniteError

__all__ = ["ACTIONS", "LossSpikeError", "LossSpikeMonitor"]


class LossSpikeError(RuntimeError):
    """Raised by the ``raise`` action when too many spikes fall within the window."""


class LossSpikeMonitor(SpikeEvents, L.Callback):
    """Detects loss spikes and logs / skips / rolls back / cools down / raises (see the module docstring).

    Args:
        actions: subset of ``log, skip, rollback, lr_cooldown, raise`` taken on every spike.
        z_threshold: z-score of the loss above which it may be a spike (None: not used).
        rel_threshold: relative rise ``(loss - location) / |location|`` above which it may be a spike (None: not used);
            when both thresholds are set, both must be exceeded.
        grad_z_threshold: z-score of the global grad norm that also counts as a spike (None: off).
        method: ``"ema"`` (EMA location, EMA of squared one-step errors) or ``"median"`` (median, MAD of
            one-step differences over ``window``) statistics; both ignore the loss curve's falling trend.
        decay: EMA decay of the location; scale_decay: EMA decay of the squared errors; window: median/MAD
            window; warmup_steps: steps of statistics before any loss spike can be declared.
        check_grad: compute the grad norm each step (non-finite grads count as spikes; needed by
            ``grad_z_threshold``). Under ``16-mixed`` non-finite grads are left to the GradScaler.
        snapshot_every: ``rollback`` snapshot cadence in steps; snapshot_keep: snapshots kept in CPU memory.
        rollback_min_age: the restored snapshot is at least this many steps older than the spike.
        exclude_previous_steps: also exclude the samples of this many steps before the spike.
        cooldown_factor, cooldown_steps, cooldown_ramp_steps: the ``lr_cooldown`` multiplier, hold and ramp.
        raise_after, raise_window: the ``raise`` action fires at ``raise_after`` spikes within
            ``raise_window`` steps.
        max_consecutive: after this many loss spikes in a row the new loss level is accepted (statistics
            restart from it; a ``level_shift`` line goes to spikes.jsonl), so ``skip`` cannot stall a run whose
            loss moved for good; grad-norm spikes likewise (``grad_level_shift``). None: never (non-finite losses
            are never accepted).
        max_nonfinite: after this many non-finite steps in a row (NaN/inf loss or grads, each dropped by
            ``skip``/``rollback``) raise :class:`~lit_dtrain.module.NonFiniteError`: a run whose every step is NaN
            cannot be recovered by dropping steps, and must not end as if it had trained. None: never.
        path: the events file (default ``<trainer.default_root_dir>/spikes.jsonl``).
    """

    def __init__(
        self,
        actions: Sequence[str] = ("log", "skip"),
        z_threshold: float | None = 6.0,
        rel_threshold: float | None = 0.2,
        grad_z_threshold: float | None = None,
        method: str = "ema",
        decay: float = 0.9,
        scale_decay: float = 0.98,
        window: int = 200,
        warmup_steps: int = 50,
        check_grad: bool = True,
        snapshot_every: int = 50,
        snapshot_keep: int = 2,
        rollback_min_age: int = 1,
        exclude_previous_steps: int = 0,
        cooldown_factor: float = 0.1,
        cooldown_steps: int = 50,
        cooldown_ramp_steps: int = 50,
        raise_after: int = 3,
        raise_window: int = 1000,
        max_consecutive: int | None = 10,
        max_nonfinite: int | None = 10,
        path: str | None = None,
    ) -> None:
        super().__init__()
        self.actions = check_args(
            actions, grad_z_threshold=grad_z_threshold, check_grad=check_grad, snapshot_every=snapshot_every,
            snapshot_keep=snapshot_keep, rollback_min_age=rollback_min_age,
            exclude_previous_steps=exclude_previous_steps, cooldown_factor=cooldown_factor,
            cooldown_steps=cooldown_steps, cooldown_ramp_steps=cooldown_ramp_steps, raise_after=raise_after,
            raise_window=raise_window, warmup_steps=warmup_steps, max_nonfinite=max_nonfinite, path=path)
        self.max_nonfinite = None if max_nonfinite is None else int(max_nonfinite)
        self._detector_args = dict(z_threshold=z_threshold, rel_threshold=rel_threshold,
                                   grad_z_threshold=grad_z_threshold, method=method, decay=decay,
                                   scale_decay=scale_decay, window=window, warmup_steps=warmup_steps,
                                   max_consecutive=max_consecutive, owner="LossSpikeMonitor")
        self.detector = SpikeDetector(**self._detector_args)
        self.window = SpikeWindow(raise_after, raise_window)
        self.check_grad, self.path = bool(check_grad), path
        self.snapshot_every, self.snapshot_keep = int(snapshot_every), int(snapshot_keep)
        self.rollback_min_age, self.exclude_previous_steps = int(rollback_min_age), int(exclude_previous_steps)
        self.cooldown = (float(cooldown_factor), int(cooldown_steps), int(cooldown_ramp_steps))
        self._reset_state()

    def _reset_state(self) -> None:
        """The state of a monitor that has seen no step (see :meth:`setup`)."""
        self.detector = SpikeDetector(**self._detector_args)
        self.window = SpikeWindow(self.window.max_spikes, self.window.window_steps)
        # persistent state
        self.excluded: list[int] = []  # global sample indices never to be trained on again
        self.events: list[dict] = []  # this process's latest events_kept events of the fit (all in spikes.jsonl)
        self.num_spikes = 0
        self.nonfinite_run: list[int] = []  # steps of the current run of consecutive non-finite steps
        self.cooldown_start = -(10**9)
        self.recent_indices: deque[list[int]] = deque(maxlen=max(self.exclude_previous_steps, 1))
        # per-step / in-memory state
        self.snapshots = snapshots.SnapshotRing(self.snapshot_keep)
        self.last_decision = None
        self._reset_step()
        self._saved_scaler: dict | None = None  # the GradScaler's state before a dropped step
        self._no_sampler_note: str | None = None  # a warning owed at the first batch (on_train_start)
        self._excluded_dev: torch.Tensor | None = None
        self._sampler = None
        self._num_train_samples: int | None = None  # len() of a plain train DataLoader's dataset, when sized
        self._excluded_only = ExcludedOnlyRun()  # steps in a row skipped for an excluded sample (no sampler)
        self._device = torch.device("cpu")
        self._stepped = False
        self._z_ready = False
        self._decision_undo: tuple | None = None  # (step, detector state, nonfinite_run, cooldown_start) before it

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Runs before Lightning restores a checkpoint (which then loads this callback's state): a fit without
        # ckpt_path starts fresh even when this object already served another fit (a sweep loop, staged training);
        # a fit with ckpt_path continues from the checkpoint's state. The same Trainer fitted again (a raised
        # max_steps) continues its run at its global_step, and this state with it.
        note_stage(self, stage)
        if stage == "fit" and trainer.global_step == 0:
            self._reset_state()
        elif stage == "fit":
            self._reset_inflight()  # (a fit that raised mid-step may have left half a step)

    def _reset_inflight(self) -> None:
        """Forget a step in progress (its loss, indices, pending event): it never completed."""
        self._reset_step()
        self._stepped = False
        self._saved_scaler = None
        self._decision_undo = None

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # the state key is the class name (not the thresholds), so a resume with retuned thresholds keeps the
        # excluded samples; checkpoints written with the old argument-built key still load
        load_state_under_old_key(self, checkpoint)

    def _reset_step(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0  # backward passes of this optimizer step
        self._indices: list[torch.Tensor] = []  # the sample indices of this step's trained micro-batches
        self._batch_index: torch.Tensor | None = None  # kept at its backward (a training_step returning None: not)
        self._hit_excluded: torch.Tensor | None = None
        self._pending: dict | None = None
        self._level_shifts: list[tuple] = []  # (event, message) of this step's accepted level shifts (loss, grad norm)
        self._step_buffers: list | None = None  # the module's buffers before this step's first forward (skip)

    # ---- setup --------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check_fit(trainer, pl_module, self.actions)
        self._sampler, self._num_train_samples = exclusion_sampler(trainer)
        self._fit_data = note_fit_data(getattr(self, "_fit_data", None), trainer, self.excluded)
        if self.excluded and self._sampler is not None:
            self._sampler.exclude(self.excluded)
        needs_index = DROP_ACTIONS & set(self.actions)
        # said at the first batch whose indices were read: a batch without them is refused there (KeyError), and
        # this note, said here, came first as noise before that fatal error
        self._no_sampler_note = None
        if needs_index and self._sampler is None:
            where = "the datamodule has" if trainer.datamodule is not None else "there is no datamodule, so"
            self._no_sampler_note = (f"LossSpikeMonitor: {where} no sampler with exclude(); steps whose batch holds an "
                                     f"excluded sample index (the batch key 'index') will be skipped instead.")
        self._device = pl_module.device
        self._set_excluded_device(self._device)
        track_undo = getattr(trainer.strategy, "track_comm_undo", None)
        if needs_index and track_undo is not None:
            track_undo()
        if "rollback" in self.actions:
            self.snapshots.clear()
            self.snapshots.add(trainer)
        if trainer.is_global_zero and self.path is None:  # (a chosen path may be shared)
            self._supersede_replayed_events(trainer)

    @override  # reload_dataloaders_every_n_epochs: a dataset grown from 8 to 24 was still counted as 8, so excluding
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # 0..7 stopped the run
        if self._sampler is None:  # Lightning reloads the loaders just before this hook
            self._num_train_samples = exclusion_sampler(trainer)[1]

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._release_copies()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # (a raise inside optimizer.step would leave this step's cooled LR on the optimizer; the snapshots hold a
        # CPU copy of the whole model)
        self._restore_lr(trainer)
        self._release_copies()
        undo = self._decision_undo
        if undo is not None and trainer.global_step == undo[0]:  # decided, never taken: a continued fit redoes it
            self.detector.load_state_dict(undo[1])
            self.nonfinite_run, self.cooldown_start = undo[2], undo[3]
        self._reset_inflight()

    # ---- per micro-batch ------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._batch_index = batch_sample_indices(batch, self.actions)
        self._keep_step_buffers(pl_module)
        if self._no_sampler_note is not None:
            rank_zero_warn(self._no_sampler_note)
            self._no_sampler_note = None

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        index, self._batch_index = self._batch_index, None
        if index is not None:
            self._indices.append(index)
            if self._excluded_dev is not None:
                hit = torch.isin(index.to(self._excluded_dev.device), self._excluded_dev).any()
                self._hit_excluded = hit if self._hit_excluded is None else self._hit_excluded | hit
        value = loss.detach().float()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed hands this hook the scaled loss
            value = value / scaler.get_scale()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._micro_batches += 1

    # ---- decision -------------------------------------------------------------------------------------------
    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._loss_sum is None:  # training_step returned None (Lightning's way to skip a batch): no decision
            self._reset_step()
            return
        step = trainer.global_step
        loss, grad_norm, hit_count = step_ops.step_measurements(
            trainer, optimizer, self._loss_sum, self._micro_batches, self._hit_excluded, self.check_grad)
        # what the decision changes, undone if the step is never taken (an exception before optimizer.step returns)
        self._decision_undo = (step, self.detector.state_dict(), list(self.nonfinite_run), self.cooldown_start)
        self._z_ready = self.detector.loss_stat.ready  # before decide() adds this step's value
        decision = self.detector.decide(loss, grad_norm)
        self.last_decision = decision
        if NONFINITE_LOSS in decision.reasons and "rollback" not in self.actions:  # (rollback restores them)
            step_ops.refuse_poisoned_weights(trainer, pl_module, step, "at a NaN/inf loss", self)
        if NONFINITE_LOSS in decision.reasons or NONFINITE_GRAD in decision.reasons:
            self.nonfinite_run.append(step)
        else:
            self.nonfinite_run = []
        # recorded when the step completes (a step that raises before is redone)
        self._level_shifts.extend(records.level_shift_records(step, decision, grad_norm, self.detector.max_consecutive))
        if not decision.is_spike and hit_count > 0:
            decision.reasons.append(EXCLUDED_SAMPLE)
        if decision.is_spike:
            self._start_event(trainer, optimizer, step, decision)
        self._apply_cooldown(trainer, optimizer, step)
        self._stepped = True

    @property
    def scales_lr(self) -> bool:  # OncePerStepLRMonitor then logs the LR the update used
        return "lr_cooldown" in self.actions

    def lr_multiplier(self, step: int) -> float:
        """The ``lr_cooldown`` LR multiplier at ``step`` (1.0 outside a cool-down)."""
        factor, hold, ramp = self.cooldown
        return cooldown_factor(step - self.cooldown_start, factor, hold, ramp)

    def _apply_cooldown(self, trainer, optimizer, step: int) -> None:
        mult = self.lr_multiplier(step)
        if mult == 1.0 or "lr_cooldown" not in self.actions or step_ops.scaler_skips_step(trainer, optimizer):
            # (a step the GradScaler skips never runs the post-hook that takes the multiplier out, while Lightning
            # still steps the LR scheduler: it would step from the cooled LR, and the restore at batch end would then
            # write the previous step's LR over the scheduler's)
            return
        # put back by a step post-hook before the scheduler steps; composes with other per-step scalings (the
        # FourierSampler's stage multiplier) in any callback order
        scale_lrs_for_step(optimizer, mult)

    def _restore_lr(self, trainer) -> None:
        for opt in trainer.optimizers:
            restore_lrs(opt)

    # ---- after the step ---------------------------------------------------------------------------------------
    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not self._stepped:
            return  # a gradient-accumulation micro-batch without optimizer step
        self._stepped = False
        self._decision_undo = None  # the step was taken
        self._restore_lr(trainer)  # the GradScaler may have skipped optimizer.step (and the post-hook)
        pending, decision = self._pending, self.last_decision
        for shift in self._level_shifts:
            self._record(trainer, *shift)
        if pending is None and self.exclude_previous_steps:
            self.recent_indices.append(gather_indices(trainer, self._indices))
        elif pending is not None:
            self._finish_event(trainer, pl_module, pending)
        self._snapshot_if_due(trainer, pending)
        self._excluded_only.update(trainer, pending, len(self.excluded), self._num_train_samples)
        scalars = {}
        if pending is not None or self._z_ready:  # in the warmup z is unused and meaningless
            # (step 1: no statistics yet, z ~ loss / min_scale hit the 1e6 cap and flattened every TB plot); the
            # readiness is that of the decision, taken before it added its value (else the warmup's last z showed)
            scalars["spike/loss_z"] = min(decision.loss_z, 1e6)
        scalars["spike/count"] = float(self.num_spikes)
        if "lr_cooldown" in self.actions:
            scalars["spike/lr_multiplier"] = self.lr_multiplier(trainer.global_step)
        every = log_interval(None, trainer)  # 0: Lightning writes no step metrics; only events are written
        step = trainer.global_step - 1  # the optimizer step that just ended
        if pending is not None or on_log_cadence(every, step, trainer):  # Lightning's cadence, and every event
            log_step_metrics(trainer, pl_module, scalars, step)
        self._reset_step()
        if step_ops.is_last_step(trainer):  # (before ModelCheckpoint saves them)
            step_ops.refuse_poisoned_weights(trainer, pl_module, step, "after the last step", self)
        if self.max_nonfinite is not None and len(self.nonfinite_run) >= self.max_nonfinite:
            steps = self.nonfinite_run
            raise NonFiniteError(
                f"{step_ops.nonfinite_run_message(steps, self.max_nonfinite)}; dropping steps cannot recover this "
                "run: lower optimizer.lr, check the data, or resume from an earlier checkpoint"
                f"{self._see_events(trainer, '. See ')}"
            )
        if pending is not None and "raise" in pending["actions"] and pending["counted"]:
            if self.window.add(pending["step"]):
                see = self._see_events(trainer, "; see ")
                raise LossSpikeError(f"{step_ops.spike_window_message(self.window)}{see}")

    # ---- state ----------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict:
        return spike_state.state_dict(self)

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        if state_is_for_fit(self):
            spike_state.load_state_dict(self, state_dict)
