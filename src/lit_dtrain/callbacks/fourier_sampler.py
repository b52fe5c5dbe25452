"""``FourierSamplerCallback``: feeds each step's token losses to the :class:`FourierSampler` and logs it.

At the end of every optimizer step it hands each of the step's micro-batches' ``outputs["token_loss"]`` and
``outputs["index"]`` to ``trainer.datamodule.sampler.observe`` (which runs the all-reduce/all-gather sync on every
rank; an async gather is waited on at the next draw, which ``LMDataModule`` makes at step time), so the
micro-batches of one step are all drawn from the table as the step began (with the sampler's ``lag=1``, as the
previous step began: ``observe`` then does not wait for the GPU, and applies the previous step's update). A step
whose gradients were dropped (``LossSpikeMonitor``'s ``skip``/``rollback``, listed before or after this callback) is
not handed over: the table does not learn from a batch that was never trained on (the monitor excludes its samples
from later draws). This is told as ``AdaptiveGradClip`` and ``OptimizerDiagnostics`` tell it, by the grads the
optimizer step saw (a step post-hook; when the GradScaler skipped ``optimizer.step``, by the grads left at batch
end: an fp16 overflow keeps its grads and is still learned from; its non-finite rows are not, see the sampler). It
applies the stage's LR multiplier inside each ``optimizer.step`` (torch step pre/post hooks: the scheduler's own LR
is restored right after the update, so schedules and ``LearningRateMonitor`` see unscaled values) and logs
``fourier/mix``, ``fourier/bands``, ``fourier/prob_entropy``, ``fourier/prob_max_ratio`` and ``fourier/prob_min_ratio``
(of the distribution the step's batch was drawn from),
``fourier/top_band_energy`` (this rank's mean energy, in nats², of the top active band of a window's token-loss
spectrum, over the step's micro-batches), ``fourier/lr_mult``, ``fourier/comm_bytes_per_step`` and
``fourier/nonfinite_skipped`` (samples whose token loss was NaN/inf, which the sampler leaves out of its table; the
first one also warns) to the loggers (TensorBoard by default), after the steps ``k`` with ``(k + 1) %
log_every_n_steps == 0`` (Lightning's own cadence, so the rows line up with ``train/loss``). With the sampler's
``lag=1``, ``fourier/top_band_energy`` of step ``k`` is a value the GPU computes: it is written under step ``k`` once
it has reached the host with step ``k``'s update, at the end of step ``k + 1`` (the last step's at the end of
training, or when a stop signal ends the fit), so that logging never waits for the GPU either. Under manual
optimization the step of the sampler's schedules is ``global_step`` over the number of optimizers
(:func:`sampler_step`). With a datamodule of one's own (not ``LMDataModule``, whose state holds it), the sampler's
table is checkpointed in this callback's state.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, whole_at_least
from lit_dtrain.callbacks._contract import check_step_outputs, require_outputs, require_token_losses, token_mask_of
from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, on_log_cadence
from lit_dtrain.callbacks._lr_scaling import restore_lrs, scale_lrs_for_step
from lit_dtrain.callbacks.adaptive_grad_clip import grad_params
from lit_dtrain.data.datamodule import LMDataModule
from lit_dtrain.data.samplers.fourier import FourierSampler
from lit_dtrain.utils.args import is_flag


def sampler_step(trainer: L.Trainer) -> int:
    """The optimizer step of the sampler's schedules (stages, mix, bands): ``global_step``; under manual optimization,
    where Lightning counts every ``optimizer.step`` (two a batch with two optimizers), ``global_step`` over the number
    of optimizers, each optimizer's own count of updates when they all step together (with two, the stages came twice
    as fast and, within one batch, the second optimizer's update could get the next stage's LR multiplier)."""
    module = getattr(trainer, "lightning_module", None)
    if module is None or module.automatic_optimization:
        return trainer.global_step
    return trainer.global_step // max(len(trainer.optimizers), 1)


class FourierSamplerCallback(L.Callback):
    """Connects a LightningModule's step outputs to the datamodule's :class:`FourierSampler`.

    Args:
        log_every_n_steps: logging cadence in optimizer steps (None: the Trainer's ``log_every_n_steps``).
        apply_lr_multiplier: scale the LR by the sampler's stage multiplier (off: stages only shape sampling).
    """

    required_step_outputs = ("token_loss", "index")  # checked against the module's step_output_keys at setup

    def __init__(self, log_every_n_steps: int | None = None, apply_lr_multiplier: bool = True) -> None:
        check_arg(
            "FourierSamplerCallback",
            "log_every_n_steps",
            log_every_n_steps,
            whole_at_least(1, none_ok=True),
            "an integer >= 1 or None",
        )
        self.log_every_n_steps = None if log_every_n_steps is None else int(log_every_n_steps)
        # apply_lr_multiplier="false" (a string, in a project of one's own) was truthy: the LR was scaled
        check_arg("FourierSamplerCallback", "apply_lr_multiplier", apply_lr_multiplier, is_flag, "True or False")
        self.apply_lr_multiplier = bool(apply_lr_multiplier)
        self._hooks: list = []
        self._comm_bytes = 0
        self._batch_step = 0  # the optimizer step of the current micro-batch (set in on_train_batch_start)
        self._global_at_start = 0  # trainer.global_step then: unchanged at batch end, no optimizer stepped
        self._warned_nonfinite = False
        self._nonfinite_at_start = 0
        self._energy_owed: int | None = None  # lag=1: the logged step whose top_band_energy is still on the device
        self._table_sampler: FourierSampler | None = None  # the sampler whose table this callback checkpoints
        self._saw_token_mask = False  # training_step returned a token_mask: a row without a real token is left out too
        self._reset_step()

    @property
    def scales_lr(self) -> bool:  # OncePerStepLRMonitor then logs the LR the update used
        return self.apply_lr_multiplier

    def _reset_step(self) -> None:
        self._micro_outputs: list[tuple] = []  # (token_loss, index, token_mask or None) of this step's micro-batches
        self._optimizer_ran = False  # an optimizer.step of this step ran (its post-hook)
        self._optimizer_had_grads = False  # ... and saw grads: the step was not dropped

    @staticmethod
    def sampler_of(trainer: L.Trainer) -> FourierSampler:
        """``trainer.datamodule.sampler``, checked to be a :class:`FourierSampler`."""
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None:
            raise RuntimeError(
                "FourierSamplerCallback needs trainer.datamodule (an LMDataModule with a FourierSampler); "
                "pass datamodule= to trainer.fit"
            )
        sampler = getattr(datamodule, "sampler", None)
        if not isinstance(sampler, FourierSampler):
            what = (f"{type(sampler).__name__}" if hasattr(datamodule, "sampler")
                    else f"none: {type(datamodule).__name__} has no attribute 'sampler'")
            raise TypeError(  # (a datamodule of one's own was told the config group, no word of LMDataModule)
                f"FourierSamplerCallback needs trainer.datamodule.sampler to be a FourierSampler, got {what}; pass "
                "trainer.fit(datamodule=LMDataModule(..., sampler=FourierSampler(...))) (from lit_dtrain.data and "
                "lit_dtrain.data.samplers), give a datamodule of your own a 'sampler' attribute, a FourierSampler it "
                "draws its batches from (docs/callbacks_in_your_project.md), or with train.py select "
                "data/sampler=fourier"
            )
        return sampler

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._table_sampler = None
        if stage == "fit":
            sampler = self.sampler_of(trainer)
            check_step_outputs([self], pl_module)  # a module that declares step_output_keys: refused before compute
            if not isinstance(trainer.datamodule, LMDataModule):
                # a datamodule of one's own: the table is this callback's to keep (a resume started it over without a
                # word); LMDataModule's state_dict holds it (one that also saves it loads the same state twice)
                self._table_sampler = sampler

    @override
    def state_dict(self) -> dict:
        return {} if self._table_sampler is None else {"sampler": self._table_sampler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        # after setup (Lightning restores a checkpoint then); only for a fit: an evaluation with ckpt_path= must not
        # rewind the table of the fit this callback serves
        if "sampler" in state_dict and self._table_sampler is not None:
            self._table_sampler.load_state_dict(state_dict["sampler"])

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The stage multiplier must be undone *inside* optimizer.step: Lightning steps the LR scheduler before
        # on_train_batch_end, and chainable torch schedulers read group["lr"]. So: torch step pre/post hooks.
        self._remove_hooks()
        self._reset_step()
        self._energy_owed = None
        self._hooks = [optimizer.register_step_post_hook(self._after_step) for optimizer in trainer.optimizers]
        sampler = self.sampler_of(trainer)
        sampler.expect_updates()  # its first update comes after accumulate_grad_batches micro-batches have been drawn
        self._nonfinite_at_start = sampler.nonfinite_skipped  # a resumed table's count was warned about before
        if not self.apply_lr_multiplier:
            return
        for optimizer in trainer.optimizers:

            def pre(opt, args, kwargs):
                # undone right after the update by _lr_scaling's post-hook, which composes with LossSpikeMonitor's
                # lr_cooldown in any callback order
                scale_lrs_for_step(opt, sampler.lr_multiplier(sampler_step(trainer)))

            self._hooks.append(optimizer.register_step_pre_hook(pre))

    def _after_step(self, optimizer, args, kwargs) -> None:
        # inside optimizer.step, before anything can zero the grads (as AdaptiveGradClip's post-hook): no grads here
        # means LossSpikeMonitor dropped the step, in whichever order the two callbacks are listed
        self._optimizer_ran = True
        self._optimizer_had_grads = self._optimizer_had_grads or bool(grad_params(optimizer))

    def _step_dropped(self, trainer: L.Trainer) -> bool:
        """True when this step's grads were dropped, so its batches were never trained on."""
        if self._optimizer_ran:
            return not self._optimizer_had_grads
        # no optimizer.step ran: the GradScaler skipped it (an fp16 overflow keeps its grads; a LossSpikeMonitor drop
        # under 16-mixed has none), or a stand-in trainer without optimizers
        optimizers = getattr(trainer, "optimizers", None) or []
        return bool(optimizers) and not any(grad_params(optimizer) for optimizer in optimizers)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()
        self._write_owed_energy(trainer)

    def _write_owed_energy(self, trainer: L.Trainer) -> None:
        """lag=1: write the last logged step's top_band_energy, still in its pending update (the fit is over: this
        may wait for the device)."""
        if self._energy_owed is not None:
            landed = self.sampler_of(trainer).landed_stats(self._energy_owed, wait=True)
            self._energy_owed = None
            if landed is not None and getattr(trainer, "is_global_zero", True):
                # to the loggers directly: Lightning refuses self.log in on_train_end and on_exception
                for logger in getattr(trainer, "loggers", ()):
                    logger.log_metrics({"fourier/top_band_energy": landed["top_band_energy"]}, step=landed["step"])
                    logger.save()

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # lag=1: the saved step's value is written before its checkpoint (it waits for the device, as the save does):
        # a resume restores the update, not the value, so a kill after the save and before the next step's end lost
        # the point (SIGKILL at the step after a checkpoint: points 0..6 and 8..11 of 12), and a kill after that
        # step's end kept it, written by the killed run under the earlier step, which the resume's purge keeps
        self._write_owed_energy(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()  # (a later fit must not find this fit's hooks on a reused optimizer)
        self._reset_step()  # an unfinished step's micro-batches: a continued fit redoes the step
        if isinstance(exception, SIGTERMException):
            # a stop signal ends the fit after a saved step, which a resume does not redo: its owed value is written
            # now (the resumed run restores the update, not the value; the point was missing from the curve)
            self._write_owed_energy(trainer)
        self._energy_owed = None
        for optimizer in trainer.optimizers:
            restore_lrs(optimizer)  # a raise inside optimizer.step would leave the stage-scaled LR

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        # the optimizer step this micro-batch belongs to: at batch end, global_step has already advanced
        # after the last micro-batch of a step but not after the others
        self._batch_step, self._global_at_start = sampler_step(trainer), trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        if outputs is not None and not (isinstance(outputs, Mapping) and not outputs):
            require_outputs(self, outputs, self.required_step_outputs)
            token_loss, index = require_token_losses(self, outputs)
            token_mask = token_mask_of(self, outputs, token_loss)
            self._saw_token_mask = self._saw_token_mask or token_mask is not None
            self._micro_outputs.append((token_loss.detach(), index, token_mask))
        # else: training_step returned None, Lightning's way to skip a batch (it hands on {}): nothing to learn from
        sampler = self.sampler_of(trainer)
        step = self._batch_step
        if trainer.global_step == self._global_at_start:
            # mid-accumulation (no optimizer step in this batch; told by the step count rather than batch_idx, which
            # misses the short accumulation window Lightning steps at the end of an epoch): whether the step is
            # applied is known after its optimizer step
            return
        micro_outputs, dropped = self._micro_outputs, self._step_dropped(trainer)
        self._reset_step()
        if dropped or not micro_outputs:  # never trained on: not learned from, and (as the other callbacks) no row
            sampler.step_not_observed(step)  # lag=1: the previous step's update is applied now, as observe would
            self._after_apply(trainer, pl_module, sampler)
            return
        every = log_interval(self.log_every_n_steps, trainer)  # 0: no step logging
        log_now = on_log_cadence(every, step, trainer)  # Lightning's cadence: rows line up with train/loss
        # before observe(): on one process (or with async_op=False) observe() applies the update at once, and the
        # entropy would be that of the *next* draw, not of the distribution this step's batches were drawn from
        distribution = sampler.distribution_stats() if log_now else None
        energies = []  # each micro-batch's (lag 0: floats; lag 1: on the device, averaged once landed)
        for token_loss, index, token_mask in micro_outputs:
            masked = {} if token_mask is None else {"token_mask": token_mask}  # (an observe of one's own may lack it)
            stats = sampler.observe(token_loss, index, step=step, **masked)
            self._comm_bytes += stats["comm_bytes"]
            energies.append(stats["top_band_energy"])
        self._after_apply(trainer, pl_module, sampler)
        if log_now:
            metrics = {
                "fourier/mix": float(stats["mix"]),
                "fourier/bands": float(stats["bands"]),
                "fourier/prob_entropy": distribution["entropy"],
                # how far from the target its most and least likely samples are (1 and 1: it has learned nothing)
                "fourier/prob_max_ratio": distribution["prob_max_ratio"],
                "fourier/prob_min_ratio": distribution["prob_min_ratio"],
                # the multiplier this step's update used (1.0 when this callback does not apply it)
                "fourier/lr_mult": sampler.lr_multiplier(step) if self.apply_lr_multiplier else 1.0,
                "fourier/comm_bytes_per_step": float(self._comm_bytes),
                "fourier/nonfinite_skipped": float(sampler.nonfinite_skipped),
            }
            if sampler.lag:  # a tensor on the GPU: written once it has reached the host (see _after_apply)
                self._energy_owed = step
            else:  # observe() has read them already; the step's mean (it was the last micro-batch's alone)
                metrics["fourier/top_band_energy"] = sum(energies) / len(energies)
            log_step_metrics(trainer, pl_module, metrics, step)
        self._comm_bytes = 0

    def _after_apply(self, trainer: L.Trainer, pl_module: L.LightningModule, sampler: FourierSampler) -> None:
        """After a step's updates were handed over (or the step was dropped): warn at the first non-finite sample,
        and, with ``lag=1``, write the top band energy of the logged step whose update has just been applied."""
        # the sampler's count covers every rank's samples; it grows when an update is applied (lag=1: a step later,
        # so that observe never waits for the GPU; several ranks with async_op: at the next draw), so the warning
        # names the last step applied, not the step being handed over
        new_nonfinite = sampler.nonfinite_skipped - self._nonfinite_at_start
        if new_nonfinite > 0 and not self._warned_nonfinite:
            self._warned_nonfinite = True
            # (a row whose token_mask holds no real token is counted so too: its loss was no NaN)
            masked = ", or no real token in its token_mask" if self._saw_token_mask else ""
            rank_zero_warn(f"FourierSampler: {new_nonfinite} sample(s) up to step {sampler.last_step} had a "
                           f"NaN/inf token loss{masked}; they are left out of the sampling table (counted in "
                           "fourier/nonfinite_skipped)")
        if self._energy_owed is not None:
            landed = sampler.landed_stats(self._energy_owed)
            if landed is not None:
                self._energy_owed = None
                log_step_metrics(trainer, pl_module, {"fourier/top_band_energy": landed["top_band_energy"]},
                                 landed["step"])
