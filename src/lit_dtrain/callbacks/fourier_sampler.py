"""``FourierSamplerCallback``: feeds each step's token losses to the :class:`FourierSampler` and logs it.

After every training micro-batch it hands ``outputs["token_loss"]`` and ``outputs["index"]`` to
``trainer.datamodule.sampler.observe`` (which runs the all-reduce/all-gather sync on every rank; an async
gather is waited on at the next draw, which ``LMDataModule`` makes at step time). It applies the stage's LR
multiplier inside each ``optimizer.step`` (torch step pre/post hooks: the scheduler's own LR is restored right
after the update, so schedules and ``LearningRateMonitor`` see unscaled values) and logs ``fourier/mix``,
``fourier/bands``, ``fourier/prob_entropy`` (of the distribution the step's batch was drawn from),
``fourier/top_band_energy``, ``fourier/lr_mult``, ``fourier/comm_bytes_per_step`` and
``fourier/nonfinite_skipped`` (samples whose token loss was NaN/inf, which the sampler leaves out of its table;
the first one also warns) to the loggers (TensorBoard by default), after the steps ``k`` with
``(k + 1) % log_every_n_steps == 0`` (Lightning's own cadence, so the rows line up with ``train/loss``).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._contract import require_outputs
from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, on_log_cadence
from lit_dtrain.callbacks._lr_scaling import restore_lrs, scale_lrs_for_step
from lit_dtrain.data.samplers.fourier import FourierSampler


class FourierSamplerCallback(L.Callback):
    """Connects a LightningModule's step outputs to the datamodule's :class:`FourierSampler`.

    Args:
        log_every_n_steps: logging cadence in optimizer steps (None: the Trainer's ``log_every_n_steps``).
        apply_lr_multiplier: scale the LR by the sampler's stage multiplier (off: stages only shape sampling).
    """

    required_step_outputs = ("token_loss", "index")  # checked against LitLLM.step_output_keys before compute

    def __init__(self, log_every_n_steps: int | None = None, apply_lr_multiplier: bool = True) -> None:
        if log_every_n_steps is not None and int(log_every_n_steps) <= 0:
            raise ValueError(f"log_every_n_steps must be positive, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.apply_lr_multiplier = apply_lr_multiplier
        self._hooks: list = []
        self._comm_bytes = 0
        self._batch_step = 0  # the optimizer step of the current micro-batch (set in on_train_batch_start)
        self._warned_nonfinite = False

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
            raise TypeError(
                f"FourierSamplerCallback needs trainer.datamodule.sampler to be a FourierSampler, got "
                f"{type(sampler).__name__}; select it with `data/sampler=fourier`"
            )
        return sampler

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.sampler_of(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The stage multiplier must be undone *inside* optimizer.step: Lightning steps the LR scheduler before
        # on_train_batch_end, and chainable torch schedulers read group["lr"]. So: torch step pre/post hooks.
        self._remove_hooks()
        if not self.apply_lr_multiplier:
            return
        sampler = self.sampler_of(trainer)
        for optimizer in trainer.optimizers:

            def pre(opt, args, kwargs):
                # undone right after the update by _lr_scaling's post-hook, which composes with LossSpikeMonitor's
                # lr_cooldown in any callback order
                scale_lrs_for_step(opt, sampler.lr_multiplier(trainer.global_step))

            self._hooks.append(optimizer.register_step_pre_hook(pre))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()  # (a later fit must not find this fit's hooks on a reused optimizer)
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
        self._batch_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        require_outputs(self, outputs, self.required_step_outputs)
        sampler = self.sampler_of(trainer)
        step = self._batch_step
        last_micro = not (batch_idx + 1) % max(int(trainer.accumulate_grad_batches), 1)
        every = log_interval(self.log_every_n_steps, trainer)  # 0: no step logging
        log_now = last_micro and on_log_cadence(every, step, trainer)  # Lightning's: rows line up with train/loss
        # before observe(): on one process (or with async_op=False) observe() applies the update at once, and the
        # entropy would be that of the *next* draw, not of the distribution this batch was drawn from
        prob_entropy = sampler.entropy() if log_now else None
        stats = sampler.observe(outputs["token_loss"], outputs["index"], step=step)
        self._comm_bytes += stats["comm_bytes"]
        if stats["nonfinite"] and not self._warned_nonfinite:
            self._warned_nonfinite = True
            rank_zero_warn(f"FourierSampler: {stats['nonfinite']} sample(s) of step {step} had a "
                           "NaN/inf token loss; they are left out of the sampling table (counted in "
                           "fourier/nonfinite_skipped)")
        if not last_micro:
            return  # mid-accumulation: log once per optimizer step
        if log_now:
            metrics = {
                "fourier/mix": float(stats["mix"]),
                "fourier/bands": float(stats["bands"]),
                "fourier/prob_entropy": prob_entropy,
                "fourier/top_band_energy": stats["top_band_energy"],
                # the multiplier this step's update used (1.0 when this callback does not apply it)
                "fourier/lr_mult": sampler.lr_multiplier(step) if self.apply_lr_multiplier else 1.0,
                "fourier/comm_bytes_per_step": float(self._comm_bytes),
                "fourier/nonfinite_skipped": float(sampler.nonfinite_skipped),
            }
            log_step_metrics(trainer, pl_module, metrics, step)
        self._comm_bytes = 0
