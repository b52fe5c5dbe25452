"""``LitLLM``: the LightningModule around a plain language model.

It owns the loss (cross-entropy in fp32, float64 under 64-true), the validation metrics (torchmetrics), and the
optimizer and scheduler wiring (both arrive as Hydra partials). Techniques live in callbacks and strategies; they read
the step output contract ``{"loss", "token_loss" [B, T], "index" [B]}`` of :meth:`training_step`.

The parameters' side (shapes recorded before sharding, weight-decay groups, the optimizer built from them, the FLOPs
estimate) is in :mod:`lit_dtrain.module_params`, a checkpoint's model-shape check in
:mod:`lit_dtrain._model_config_check`; their names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lit_dtrain._model_config_check import WEIGHT_CONFIG_KEYS, check_model_config, check_weights_load_as_saved
from lit_dtrain.models.llama import compute_dtype
from lit_dtrain.module_grads import StepGradNorm, clips_by_norm_like_lightning, optimizer_params, step_grads
from lit_dtrain.module_metrics import ValLossMean, log_every_step, window_losses
from lit_dtrain.module_params import (
    build_optimizer,
    estimate_train_flops,
    param_groups,
    remember_parameter_shapes,
    restore_configured_settings,
)
from lit_dtrain.schedules.lr import StepLambdaLR
from lit_dtrain.step_rng import draws_random, forward_rng, step_seed
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger(__name__)

__all__ = [
    "NO_IGNORE_INDEX", "WEIGHT_CONFIG_KEYS", "LitLLM", "NonFiniteError", "build_optimizer", "check_model_config",
    "estimate_train_flops", "param_groups", "perplexity", "remember_parameter_shapes", "token_loss",
]


class NonFiniteError(FloatingPointError):
    """The loss or the gradients became NaN/Inf; raised before the weights are touched."""


NO_IGNORE_INDEX = torch.iinfo(torch.int64).min  # cross_entropy's ignore_index that no label can hit


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, T, V) against ``labels`` (B, T) in fp32 (float64 under 64-true): per token
    (B, T), or ``"sum"``/``"mean"`` over all of them. No ignore index: cross_entropy's default -100 made such a label
    a token of loss 0, silently; the int64 minimum is no label, so -100 fails like any other id outside the
    vocabulary. LitLLM and the scripts' own loops (bench_fourier.py, spectrum.py) share it, so their losses are
    LitLLM's."""
    B, T, V = logits.shape
    logits = logits.to(compute_dtype(logits.dtype))  # fp32 (float64 under 64-true)
    loss = F.cross_entropy(logits.reshape(B * T, V), labels.reshape(B * T), reduction=reduction,
                           ignore_index=NO_IGNORE_INDEX)
    return loss.view(B, T) if reduction == "none" else loss


class LitLLM(L.LightningModule):
    """Trains a causal language model ``model(input_ids) -> logits``.

    Args:
        model: any ``nn.Module`` mapping ``input_ids [B, T]`` to ``logits [B, T, V]``.
        optimizer: a callable ``params -> Optimizer`` (a Hydra ``_partial_``), given parameter groups.
        scheduler: a callable ``optimizer -> LRScheduler`` stepped every optimizer step, or None.
        val_names: names of the validation sets (one per data source), logged as ``val/<name>/loss``.
        compile: compile the model in place (``nn.Module.compile``) in ``configure_model`` (after activation
            checkpointing, before DDP/FSDP, the order torchtitan uses); its checkpoints keep the eager key names.
        check_finite: stop with :class:`NonFiniteError` before an optimizer step whose gradients hold a
            NaN or Inf, so weights never become non-finite. Runs after every callback's
            ``on_before_optimizer_step``: a spike monitor that skips the step (drops the grads) goes first.

    ``train/loss`` is the loss of an optimizer step: with ``accumulate_grad_batches=A`` the mean over its A
    micro-batches (the loss its gradient is of), on this rank.
    """

    step_output_keys = ("loss", "token_loss", "index")  # what training_step returns (the callback contract)

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        val_names: list[str] | None = None,
        compile: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        remember_parameter_shapes(model)  # before a strategy shards it: weight decay groups and FLOPs read them
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.compile = compile
        self.check_finite = check_finite
        self.val_names = list(val_names or ["val"])
        # token-weighted means in fp32 under any precision, NaN when a token's loss is NaN (module_metrics)
        self.val_loss = ValLossMean()
        self.val_loss_by_source = nn.ModuleList(ValLossMean() for _ in self.val_names)
        self._compiled = False
        self._loss_step: int | None = None  # train/loss: the optimizer step whose micro-batch losses are summed
        self._loss_sum, self._loss_count = torch.zeros(()), 0
        self.flops_per_batch: float | None = None  # of the current batch, read by ThroughputMonitor (FLOP/s, MFU)
        self._flops_by_shape: dict[tuple, float] = {}
        self._ids_checked = False  # the current loop's first batch was checked (see _check_token_ids)
        self._run_seed, self._draws_random = 0, False  # set at train start (see _forward_rng_of_step)
        self._grad_norm = StepGradNorm()  # the step's total grad norm, computed once (module_grads)

    # ---- model ------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.compile and not self._compiled:
            # In place (nn.Module.compile), not torch.compile(model): the wrapper it returns puts an '_orig_mod.'
            # segment into every state_dict key, and a checkpoint then did not load without compile (nor the reverse)
            self.model.compile()
            self._compiled = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _token_loss(self, batch: dict) -> torch.Tensor:
        if not isinstance(batch, Mapping):
            raise TypeError(
                "LitLLM trains on batches {'input_ids': Tensor[B, T], 'labels': Tensor[B, T]} (a dict, "
                f"lit_dtrain.data.window_batch builds one), got a {type(batch).__name__}"
            )
        for key in ("input_ids", "labels"):
            if key not in batch:
                raise KeyError(f"LitLLM batch is missing {key!r}; got keys {sorted(batch)}")
        if not self._ids_checked:
            self._check_token_ids(batch)
        # no ignore index (token_loss): a -100 label in a batch after the checked first one fails, not loss 0
        return token_loss(self.model(batch["input_ids"]), batch["labels"])  # (B, T)

    def _check_token_ids(self, batch: Mapping) -> None:
        """The first batch of each training and validation loop: every input id and label must be a row of the
        embedding. A tokenizer larger than ``model.vocab_size`` otherwise failed inside the embedding on a CPU
        ("index out of range in self") and with a device-side assert on a GPU, which names nothing; a label
        ``-100`` (another library's ignore index) was silently a token of loss 0 in the mean. One host read per
        loop; a later batch with an id out of range still fails as before."""
        self._ids_checked = True
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is None:
            return
        for key in ("input_ids", "labels"):
            ids = batch[key]
            if ids.numel() == 0:
                continue
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= vocab:
                bad = hi if hi >= vocab else lo
                hint = (" (LitLLM masks no tokens: every label counts in the loss, so -100 is no ignore index here)"
                        if bad < 0 else " (set model.vocab_size to the tokenizer's vocabulary size)")
                raise ValueError(f"LitLLM batch {key!r} holds token id {bad}, outside the model's vocabulary "
                                 f"[0, {vocab}){hint}")

    def on_validation_start(self) -> None:
        self._ids_checked = False

    def on_predict_start(self) -> None:
        self._ids_checked = False

    def on_train_start(self) -> None:
        self._ids_checked = False
        # The schedule is a function of the optimizer step. A checkpoint without LR-scheduler state (written with
        # the WSDScheduler callback, or with '~scheduler') leaves the new scheduler at step 0 while global_step
        # continues from the checkpoint: it would re-warm and put the decay S steps too late. Align it.
        self._loss_step = None  # a new fit (perhaps restored to an earlier step) sums no stale micro-batch loss
        self._run_seed = torch.initial_seed()  # train.py's seed_everything(seed): the forward's draws derive from it
        self._draws_random = draws_random(self.model)  # without dropout the forward runs on the generators unforked
        for optimizer in self.trainer.optimizers:  # after Lightning restored a checkpoint's optimizer state
            restore_configured_settings(optimizer)
        step = self.trainer.global_step
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if isinstance(scheduler, StepLambdaLR) and scheduler.last_epoch != step:
                log_once(log, logging.WARNING, "LR scheduler at step %d but the run is at global_step %d (the "
                         "checkpoint holds no scheduler state): moving the schedule to step %d", scheduler.last_epoch,
                         step, step)
                scheduler.set_step(step)

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._set_flops_per_batch(batch, backward=True)

    def on_validation_batch_start(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._set_flops_per_batch(batch, backward=False)

    def on_predict_batch_start(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        # forward only: predict/device/flops_per_sec read the last train batch's forward + backward after a fit (3x),
        # and nothing before one
        self._set_flops_per_batch(batch, backward=False)

    def _set_flops_per_batch(self, batch: dict, backward: bool) -> None:
        """``flops_per_batch`` of the batch about to run: forward + backward for a train batch, forward only (a third,
        see :func:`estimate_train_flops`) for a validation or predict batch, each at its own shape."""
        if not (isinstance(batch, Mapping) and "input_ids" in batch):
            return
        key = (*batch["input_ids"].shape, backward)
        if key not in self._flops_by_shape:
            flops = estimate_train_flops(self.model, *batch["input_ids"].shape)
            self._flops_by_shape[key] = flops if backward else flops / 3
        self.flops_per_batch = self._flops_by_shape[key]

    # ---- steps ------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> dict:
        token_loss = self._forward_rng_of_step(batch)  # (B, T) fp32 (float64 under 64-true)
        if "loss_weight" in batch:  # importance weights from a sampler (unbiased estimate)
            loss = (token_loss.mean(dim=1) * batch["loss_weight"].to(token_loss)).mean()
        else:
            loss = token_loss.mean()
        step_loss = self._step_mean_loss(loss.detach())
        log_every_step(self, "train/loss", step_loss, token_loss.size(0))  # self.log(..., on_step, prog_bar), cheaper
        return {"loss": loss, "token_loss": token_loss.detach(), "index": batch.get("index")}

    def _forward_rng_of_step(self, batch: dict) -> torch.Tensor:
        """The token loss, its forward's random draws (dropout) seeded from the step (lit_dtrain.step_rng)."""
        if self._trainer is None or not self._draws_random:
            return self._token_loss(batch)
        step = self._trainer.global_step
        micro = self._loss_count if step == self._loss_step else 0  # this step's micro-batches so far
        seed = step_seed(self._run_seed, step, micro, self.global_rank)
        with forward_rng(seed, self.device):
            return self._token_loss(batch)

    def _step_mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss of this optimizer step's micro-batches so far. With ``accumulate_grad_batches=A`` Lightning
        writes ``train/loss`` once per optimizer step, the value logged at its last micro-batch: the mean over all
        A, the loss the step's gradient is of (it was the last micro-batch's alone, a quarter of the tokens at A=4)."""
        step = self._trainer.global_step if self._trainer is not None else None
        if step is None or step != self._loss_step:  # a step's first micro-batch: its mean is its loss (no tensor op)
            self._loss_step, self._loss_sum, self._loss_count = step, loss, 1
            return loss
        self._loss_sum, self._loss_count = self._loss_sum + loss, self._loss_count + 1
        return self._loss_sum / self._loss_count

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Accumulate the token loss, each window's tokens weighted by the batch's ``loss_weight [B]`` if any.

        ``val/loss`` is the mean over all tokens of all ranks: each rank's ``MeanMetric`` sums loss x weight
        and weight, ``compute()`` sums both over the ranks, so ranks with different numbers of windows still
        give the exact global mean. ``LMDataModule`` sets ``loss_weight`` 0 on the padding windows that give
        every rank as many (see ``LMDataModule.val_dataloader``).
        """
        token_loss = self._token_loss(batch)  # (B, T)
        weight = torch.ones_like(token_loss)
        if "loss_weight" in batch:
            weight = weight * batch["loss_weight"].to(token_loss)[:, None]
        self.val_loss.update(token_loss, weight)
        self.val_loss_by_source[dataloader_idx].update(token_loss, weight)

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        """Per-window losses: ``{"loss": [B], "token_loss": [B, T], "index": [B]}`` (see
        :func:`~lit_dtrain.module_metrics.window_losses`); ``trainer.predict(module, datamodule=LMDataModule(...))``
        returns one list of these per source, over its validation windows. Logits: ``module(input_ids)``."""
        return window_losses(self._token_loss(batch), batch)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss), sync_dist=False)  # inf past a loss of ~88.7 (float32), never capped
        if len(self.val_names) > 1:
            for name, metric in zip(self.val_names, self.val_loss_by_source):
                if metric.update_count:
                    self.log(f"val/{name}/loss", metric.compute(), sync_dist=False)
        self.val_loss.reset()
        for metric in self.val_loss_by_source:
            metric.reset()

    def on_before_optimizer_step(self, optimizer) -> None:
        if not self.check_finite:
            return
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return  # fp16 loss scaling: an overflowing step is the GradScaler's to skip, not an error
        grads = step_grads(optimizer_params(optimizer))
        if not grads:  # a callback dropped this step's gradients (e.g. a loss-spike skip)
            return
        # the total norm (kept for train/grad_norm and the clip) is finite only if every gradient is; a non-finite one
        # with finite per-tensor norms (their squares overflowed in the sum) is no NaN/Inf gradient: not stopped
        if bool(self._grad_norm.total(grads).isfinite()):
            return
        if bool(torch.stack(torch._foreach_norm(grads)).isfinite().all()):
            return
        bad = [n for n, p in self.model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
        loss = self.trainer.callback_metrics.get("train/loss")
        from lit_dtrain.callbacks._spike_step import nonfinite_grad_fix  # (that package imports this module)

        raise NonFiniteError(
            f"non-finite gradients at step {self.trainer.global_step} (train/loss={loss}); first bad parameter(s): "
            f"{bad[:3]}. Stopped before the optimizer step, so the weights are still finite. To go on, "
            f"{nonfinite_grad_fix(getattr(self.trainer, 'callbacks', []))}, or lower the LR; "
            "then resume from the run's last checkpoint, if one was written (run_name=<its name> resume=auto)."
        )

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Match the ``_orig_mod.`` key segment of a ``torch.compile`` wrapper to this module's model (checkpoints
        of compiled runs from before the model was compiled in place have it), and refuse a checkpoint of another
        model shape. Warn (rank 0) when a resume drops compressed-DDP state: Lightning's own strategies
        (``strategy=ddp``) ignore the ``lit_dtrain_comm`` entry that ``strategy=ddp_compressed/...`` wrote, without
        a word.

        Under a precision that casts the module (``64-true``, ``bf16-true``, ``16-true``) the module is converted here
        first: Lightning loads the weights before its precision plugin converts the module (``Trainer._run``: restore,
        then ``strategy.setup``), so a ``64-true`` resume copied the float64 weights into the fp32 model, rounding
        them, and continued from there (8e-8 off an uninterrupted run after 20 steps; bf16 and fp16 fit in fp32)."""
        trainer = self._trainer
        if trainer is not None and not trainer.strategy.restore_checkpoint_after_setup:
            trainer.precision_plugin.convert_module(self)  # .to(dtype) or nothing; setup's own call is then a no-op
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):
            wrapped = hasattr(self.model, "_orig_mod")  # a caller's torch.compile(model); LitLLM compiles in place
            prefix = "model._orig_mod." if wrapped else "model."
            eager = {k.replace("model._orig_mod.", "model.", 1): v for k, v in state.items()}
            checkpoint["state_dict"] = {
                k.replace("model.", prefix, 1) if k.startswith("model.") else k: v for k, v in eager.items()
            }
        self._check_model_config(checkpoint)
        if self._trainer is not None:  # not when a checkpoint is only read for its weights
            # Imported here: lit_dtrain.strategies (compressed DDP, PowerSGD, ...; importing it registers
            # ddp_compressed in Lightning's registry) is not needed by callbacks that import this module
            # (LossSpikeMonitor for NonFiniteError).
            from lit_dtrain.strategies import warn_if_comm_state_dropped

            warn_if_comm_state_dropped(checkpoint, self._trainer.strategy, self._trainer.ckpt_path)

    def _check_model_config(self, checkpoint: dict) -> None:
        path = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
        check_model_config(checkpoint, getattr(self.model, "config", None), path)
        check_weights_load_as_saved(checkpoint.get("state_dict"), self, path)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Store the model shape so ``scripts/generate.py`` can rebuild the model from the file alone."""
        config = getattr(getattr(self.model, "_orig_mod", self.model), "config", None)
        if dataclasses.is_dataclass(config):
            checkpoint["model_config"] = dataclasses.asdict(config)

    # ---- optimization -----------------------------------------------------------------------------------
    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("LitLLM needs an optimizer factory (cfg.optimizer)")
        trainer = self._trainer
        clip, precision = (trainer.gradient_clip_val, trainer.precision) if trainer is not None else (None, "32-true")
        optimizer = build_optimizer(self.optimizer_factory, self.model, clip, precision)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Log ``train/grad_norm`` (the total norm before this clip, after a GradScaler's unscale and a callback's own
        clip, e.g. AdaptiveGradClip's) at the steps Lightning writes ``train/loss``, then clip. Under FSDP clip by
        norm through the root FSDP module, whose ``clip_grad_norm_`` sums the squared norms of every rank's shards and
        returns the total (Lightning's FSDP precision plugin refuses ``gradient_clip_algorithm='norm'``, so
        ``strategy=fsdp`` with the default ``trainer.gradient_clip_val=1.0`` stopped at the first step); there the
        norm is logged only when it clips by norm, as the shards' norms need that reduction.

        The norm goes to the loggers at once, under this step (``log_step_metrics``). Through ``self.log`` a step
        whose grads a spike monitor dropped (no norm, so no row) had the previous logged step's norm written under
        its number: Lightning writes the last value each name was given."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        # (lazy: the callbacks import this module)
        from lit_dtrain.callbacks._logging import log_step_metrics, logging_step, on_log_cadence
        from lit_dtrain.module_grads import held_on_some_rank  # (rank 0's shard may hold no grad where others do)

        trainer = self.trainer
        log_now = on_log_cadence(int(trainer.log_every_n_steps), trainer.global_step, trainer)
        root = getattr(trainer.strategy, "model", None)
        if isinstance(root, FullyShardedDataParallel):
            if gradient_clip_val and (gradient_clip_algorithm or "norm") == "norm":
                norm = root.clip_grad_norm_(float(gradient_clip_val))
                if log_now and held_on_some_rank(len(step_grads(optimizer_params(optimizer))), trainer.strategy):
                    log_step_metrics(trainer, self, {"train/grad_norm": norm}, logging_step(trainer))
                return
        else:
            # one total norm for the non-finite check, the logged norm and the clip (module_grads): Lightning's own
            # clip would compute it once more; a spike monitor that dropped this step left no gradients (no row)
            params = optimizer_params(optimizer)
            grads = step_grads(params)
            if log_now and grads:
                norm = self._grad_norm.total(grads)
                log_step_metrics(trainer, self, {"train/grad_norm": norm}, logging_step(trainer))
            if grads and clips_by_norm_like_lightning(self, optimizer, gradient_clip_val, gradient_clip_algorithm):
                torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, self._grad_norm.total(grads))
                return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def perplexity(loss: float) -> float:
    """exp(loss); inf where that overflows a float (a loss past ~709.8). It was capped at exp(50): a diverged run's
    val_loss 68.37 reported ppl 5.18e21, as if measured, where exp(68.37) is 5.0e29."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
