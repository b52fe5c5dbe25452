"""``AdaptiveGradClip``: z-score gradient clipping relative to the running grad-norm statistics (ZClip).

ZClip (Kumar et al., 2025) keeps an EMA of the mean and variance of the global grad norm; a norm whose
z-score exceeds ``z_threshold`` is clipped to ``mean + z_threshold * std`` (``mode="zscore"``) or to
``mean + z_threshold**2 / z * std`` (``mode="reciprocal"``, harder on large outliers), and the EMA
absorbs the clipped norm. OLMo's EMA-relative clipping is the same idea with a ratio instead of a z-score.

It runs in ``on_before_optimizer_step``: after backward (so after DDP's gradient all-reduce, every rank
sees the same norm and clips identically; under local SGD / DiLoCo, which skip that all-reduce, the norm is
the root mean square of the ranks' norms, so the statistics stay identical on every rank) and, under
``16-mixed``, after Lightning unscaled the grads (for optimizers that unscale inside ``step``, the loss scale
is divided out of the norm). Lightning's own
``gradient_clip_val`` is applied after this hook; set ``trainer.gradient_clip_val=null`` to use this alone.
A step whose grads are dropped after this hook (``LossSpikeMonitor``'s ``skip``/``rollback`` listed after this
callback; told by the grads the optimizer sees, in a step post-hook) is undone at batch end: its norm leaves the
statistics and it is neither counted nor logged, as when the
monitor comes first. Rows are written at ``on_train_batch_end``, under the step they describe.
The pure statistics live in :mod:`lit_dtrain.callbacks._spike_stats` (shared with ``LossSpikeMonitor``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, on_log_cadence
from lit_dtrain.callbacks._spike_stats import RobustStat, zclip_threshold
from lit_dtrain.callbacks._state_keys import load_state_under_old_key

MODES = ("zscore", "reciprocal")


def is_sharded(strategy) -> bool:
    """True when each rank holds only a shard of the gradients (FSDP), so squared norms must be summed."""
    name = type(strategy).__name__
    return "FSDP" in name or "ModelParallel" in name


def unsynced_grads(strategy) -> bool:
    """True under a local-update rule (``CompressedDDPStrategy`` with local SGD / DiLoCo): no per-step gradient
    all-reduce, so every rank holds its own gradients."""
    return getattr(strategy, "local_update", None) is not None


def loss_scale(trainer: L.Trainer, optimizer: torch.optim.Optimizer) -> float:
    """The factor by which the grads seen in ``on_before_optimizer_step`` are still scaled (1.0 normally).

    Lightning unscales before the hook except for optimizers that unscale inside ``step``
    (``_step_supports_amp_scaling``, e.g. fused Adam); their grads still carry the GradScaler's scale.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return 1.0
    return float(scaler.get_scale())


def has_grad_scaler(trainer: L.Trainer) -> bool:
    """True under ``16-mixed``: non-finite grads are then the GradScaler's business (it skips the step)."""
    return getattr(trainer.precision_plugin, "scaler", None) is not None


def grad_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of ``optimizer`` that currently hold a gradient."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def global_grad_norm(params: Iterable[torch.Tensor], trainer: L.Trainer | None = None) -> torch.Tensor | None:
    """The global L2 norm of the grads of ``params`` in fp32 (a 0-dim tensor), or None without grads.

    Under DDP the grads are already all-reduced, so the local norm is the global one; under FSDP the squared
    norms of the shards are summed across ranks. Under local updates (each rank its own grads) it is the root
    mean square of the ranks' norms, the same on every rank, so statistics built on it stay replicated (and the
    checkpoint, which keeps rank 0's callback state, resumes every rank).
    """
    sumsq = local_grad_sumsq(params)
    if sumsq is None:
        return None
    if trainer is not None and trainer.world_size > 1:
        if is_sharded(trainer.strategy):
            sumsq = trainer.strategy.reduce(sumsq, reduce_op="sum")
        elif unsynced_grads(trainer.strategy):
            sumsq = trainer.strategy.reduce(sumsq, reduce_op="sum") / trainer.world_size
    return sumsq.sqrt()


def local_grad_sumsq(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Sum of squared grad elements of this rank's tensors, in fp32 (a 0-dim tensor); None without grads."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    # torch._foreach_norm is what clip_grad_norm_ uses: one fused pass per device/dtype
    norms = torch._foreach_norm(grads, 2.0) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
    device = grads[0].device
    return torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]).square().sum()


class AdaptiveGradClip(L.Callback):
    """Clip the global grad norm to ``mean + z_threshold * std`` of its running EMA statistics (ZClip).

    Args:
        z_threshold: z-score above which a norm is clipped (ZClip's default 2.5).
        decay: EMA decay of the grad-norm mean and variance (ZClip's alpha 0.97).
        warmup_steps: steps of plain statistics gathering before adaptive clipping starts.
        mode: ``"zscore"`` clips to ``mean + z*std``; ``"reciprocal"`` to ``mean + z**2/z_t * std``.
        max_norm: an absolute clip applied during warmup and as a ceiling afterwards (None: none).
        log_every_n_steps: log norm/threshold/clip flags every N optimizer steps (after steps ``k`` with
            ``(k + 1) % N == 0``, where Lightning writes ``train/loss``) and on every clip event (None: the trainer's
            ``log_every_n_steps``). ``grad_clip/threshold`` is not logged while there is none (the warmup without
            ``max_norm``; with it, the warmup's threshold is ``max_norm``).
    """

    def __init__(
        self,
        z_threshold: float = 2.5,
        decay: float = 0.97,
        warmup_steps: int = 25,
        mode: str = "zscore",
        max_norm: float | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        if not z_threshold > 0:
            raise ValueError(f"AdaptiveGradClip: z_threshold must be > 0, got {z_threshold}")
        if mode not in MODES:
            raise ValueError(f"AdaptiveGradClip: mode must be one of {MODES}, got {mode!r}")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"AdaptiveGradClip: max_norm must be > 0 or None, got {max_norm}")
        if int(warmup_steps) < 2:  # (RobustStat's own message names its ``warmup``)
            raise ValueError(f"AdaptiveGradClip: warmup_steps must be >= 2, got {warmup_steps}")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"AdaptiveGradClip: log_every_n_steps must be >= 1 or None, got {log_every_n_steps}")
        self.z_threshold, self.mode, self.max_norm = float(z_threshold), mode, max_norm
        self.log_every_n_steps = log_every_n_steps
        self._decay, self._warmup_steps = decay, warmup_steps
        self._reset_state()

    def _reset_state(self) -> None:
        # clip_z=None: the EMA absorbs the value we pass, which is already the clipped norm (as in ZClip)
        self.stat = RobustStat("ema", decay=self._decay, scale_decay=self._decay, warmup=self._warmup_steps,
                               clip_z=None, min_rel_scale=0.0)
        self.clip_events = 0
        self.last: dict[str, float] = {}
        self._undo: tuple | None = None  # (optimizer, stat state, clip_events, last) from before this step
        self._applied = False
        self._hooks: list = []
        self._log_step: int | None = None  # this step's row is written at batch end, once the step was applied

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before Lightning restores a checkpoint: a fit without ckpt_path starts fresh, also when this object
        # already served another fit; a fit with ckpt_path then loads the checkpoint's statistics; the same Trainer
        # fitted again (a raised max_steps) continues its run, and these statistics with it
        if stage == "fit" and trainer.global_step == 0:
            self._reset_state()

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        load_state_under_old_key(self, checkpoint)  # state key: the class name, not the (retunable) thresholds

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        clip_val = trainer.gradient_clip_val
        if clip_val is not None and clip_val > 0:
            rank_zero_warn(
                f"AdaptiveGradClip runs before Lightning's gradient_clip_val={clip_val}, which still applies; "
                "set trainer.gradient_clip_val=null to clip adaptively only."
            )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if len(trainer.optimizers) > 1:
            names = [type(o).__name__ for o in trainer.optimizers]
            raise RuntimeError(
                f"AdaptiveGradClip keeps one grad-norm statistic, but {type(pl_module).__name__} configures "
                f"{len(names)} optimizers {names}: their norms would share it and it would fit none of them. Use one "
                f"optimizer (param groups for the parts), or clip each optimizer's grads yourself"
            )
        self._remove_hooks()
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in trainer.optimizers]

    def _after_step(self, optimizer, args, kwargs) -> None:
        # inside optimizer.step, before anything can zero the grads (a module's optimizer_step override may, right
        # after the step): grads here mean the update was applied; a step LossSpikeMonitor dropped has none (or,
        # under 16-mixed, never calls optimizer.step)
        if self._undo is not None and grad_params(optimizer):
            self._applied = True

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        if self._undo is not None and not self._applied:  # a step seen but never taken: a continued fit redoes it
            _, stat, self.clip_events, self.last = self._undo
            self.stat.load_state_dict(stat)
        self._undo, self._log_step = None, None

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def threshold(self) -> float | None:
        """The current clip value (None: no clipping yet)."""
        adaptive = zclip_threshold(self.stat, self.z_threshold)
        candidates = [v for v in (adaptive, self.max_norm) if v is not None]
        return min(candidates) if candidates else None

    def _clip_to(self, norm: float) -> float:
        """The norm after clipping (== ``norm`` when not clipped)."""
        limit = self.threshold()
        if limit is None or norm <= limit:
            return norm
        if self.mode == "reciprocal" and self.stat.ready:
            z = (norm - self.stat.location()) / self.stat.scale()
            limit = min(limit, self.stat.location() + self.z_threshold**2 / z * self.stat.scale())
        return limit

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = grad_params(optimizer)
        total = global_grad_norm(params, trainer)
        if total is None:  # no grads (e.g. LossSpikeMonitor skipped this step)
            return
        scale = loss_scale(trainer, optimizer)
        norm = float(total) / scale
        if not math.isfinite(norm):  # left to the GradScaler / LossSpikeMonitor; never absorbed in the EMA
            return
        threshold = self.threshold()
        clipped = self._clip_to(norm)
        # a callback listed after this one may still drop the step (LossSpikeMonitor's skip/rollback): what the step
        # adds is undone at batch end if its grads are gone, so the callback order does not matter
        self._undo = (optimizer, self.stat.state_dict(), self.clip_events, self.last)
        self._applied = False  # set by the step post-hook when the optimizer steps with grads
        if clipped < norm:
            coef = clipped / (norm + 1e-6)
            torch._foreach_mul_([p.grad for p in params], coef)
            self.clip_events += 1
        self.stat.add(clipped)
        self.last = {"norm": norm, "clipped": float(clipped < norm)}
        if threshold is not None:  # None in the warmup without max_norm: no threshold yet, none is logged
            self.last["threshold"] = threshold
        every = log_interval(self.log_every_n_steps, trainer)  # 0: only clips are written
        # global_step: this step, not taken yet; on Lightning's cadence, so rows line up with train/loss
        self._log_step = None
        if on_log_cadence(every, trainer.global_step, trainer) or clipped < norm:
            self._log_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._undo is None:
            return
        (_, stat, clip_events, last), self._undo = self._undo, None
        if not self._applied:  # the step was dropped after this callback saw it: as if never seen
            self.stat.load_state_dict(stat)
            self.clip_events, self.last, self._log_step = clip_events, last, None
            return
        if self._log_step is not None:
            metrics = {f"grad_clip/{k}": v for k, v in self.last.items()}
            metrics["grad_clip/clip_events"] = float(self.clip_events)
            log_step_metrics(trainer, pl_module, metrics, self._log_step)
            self._log_step = None

    @override
    def state_dict(self) -> dict:
        return {"stat": self.stat.state_dict(), "clip_events": self.clip_events}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.stat.load_state_dict(state_dict["stat"])
        self.clip_events = int(state_dict["clip_events"])
