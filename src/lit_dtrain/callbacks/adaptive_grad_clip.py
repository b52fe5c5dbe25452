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
monitor comes first. Rows are written at ``on_train_batch_end``, under the step they describe. Each optimizer (several
under manual optimization) has its own statistic: their grad norms can differ by orders of magnitude.
The pure statistics live in :mod:`lit_dtrain.callbacks._spike_stats` (shared with ``LossSpikeMonitor``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, finite_number, whole_at_least
from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, logging_step, on_log_cadence
from lit_dtrain.callbacks._spike_stats import RobustStat, zclip_threshold
from lit_dtrain.callbacks._state_keys import load_state_under_old_key, note_stage, state_is_for_fit
from lit_dtrain.callbacks._step_hooks import StepHooksCallback
from lit_dtrain.module_grads import held_on_some_rank

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
    params = list(params)
    sumsq = local_grad_sumsq(params)
    if trainer is None or trainer.world_size < 2 or not (is_sharded(trainer.strategy) or
                                                         unsynced_grads(trainer.strategy)):
        return None if sumsq is None else sumsq.sqrt()
    # every rank reduces, also one holding no grad: under FSDP a rank whose shard held only a frozen backbone's
    # elements returned None before the all-reduce, and the other rank's waited in it
    device = trainer.strategy.root_device if sumsq is None else sumsq.device
    held = sum(p.grad is not None for p in params)
    mine = torch.stack([torch.zeros((), device=device) if sumsq is None else sumsq,
                        torch.tensor(float(held), device=device)])
    sumsq, held = trainer.strategy.reduce(mine, reduce_op="sum")
    if not held:
        return None
    return (sumsq if is_sharded(trainer.strategy) else sumsq / trainer.world_size).sqrt()


def local_grad_sumsq(params: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Sum of squared grad elements of this rank's tensors, in fp32 (a 0-dim tensor); None without grads."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    # torch._foreach_norm is what clip_grad_norm_ uses: one fused pass per device/dtype
    norms = torch._foreach_norm(grads, 2.0) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
    device = grads[0].device
    return torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]).square().sum()


class AdaptiveGradClip(StepHooksCallback):
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
            ``max_norm``; with it, the warmup's threshold is ``max_norm``). With several optimizers the names are
            ``grad_clip/opt<i>/...``, each optimizer with its own statistic, and the rows are written at the batch.
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
        check_arg("AdaptiveGradClip", "z_threshold", z_threshold, finite_number(lambda v: v > 0), "a finite number > 0")
        check_arg("AdaptiveGradClip", "mode", mode, lambda v: v in MODES, f"one of {MODES}")
        check_arg("AdaptiveGradClip", "max_norm", max_norm, finite_number(lambda v: v > 0, none_ok=True),
                  "a finite number > 0 or None")
        # (RobustStat's own message names its ``warmup``)
        check_arg("AdaptiveGradClip", "warmup_steps", warmup_steps, whole_at_least(2), "an integer >= 2")
        check_arg("AdaptiveGradClip", "log_every_n_steps", log_every_n_steps, whole_at_least(1, none_ok=True),
                  "an integer >= 1 or None")
        self.z_threshold, self.mode, self.max_norm = float(z_threshold), mode, max_norm
        self.log_every_n_steps = None if log_every_n_steps is None else int(log_every_n_steps)
        self._decay, self._warmup_steps = decay, int(warmup_steps)
        self._reset_state()

    def _new_stat(self) -> RobustStat:
        # clip_z=None: the EMA absorbs the value we pass, which is already the clipped norm (as in ZClip)
        return RobustStat(
            "ema", decay=self._decay, scale_decay=self._decay, warmup=self._warmup_steps, clip_z=None,
            min_rel_scale=0.0, owner="AdaptiveGradClip", warmup_name="warmup_steps",
        )

    def _reset_state(self) -> None:
        # one statistic (and clip count, and last row) per optimizer, by its position in trainer.optimizers: the grad
        # norms of two optimizers (a GAN's generator and discriminator) differ by orders of magnitude
        self.stats: list[RobustStat] = [self._new_stat()]
        self._clip_events: list[int] = [0]
        self._last: list[dict[str, float]] = [{}]
        self._optimizer_index: dict[int, int] = {}  # id(optimizer) -> its position, set at train start
        self._multi = False
        self._undo: dict[int, tuple] = {}  # optimizer index -> (stat state, clip events, last) before this batch's step
        self._applied: set[int] = set()  # optimizer indices whose step this batch was taken (step post-hook)
        self._log_rows: set[int] = set()  # optimizer indices whose row is due this batch (written at batch end)
        self._log_step: int | None = None
        self._hooks: list = []
        self._sharded: object | None = None  # the strategy under FSDP with several ranks (set at train start)

    @property
    def stat(self) -> RobustStat:
        """The grad-norm statistic of the (first) optimizer."""
        return self.stats[0]

    @property
    def clip_events(self) -> int:
        """Clips so far, over all optimizers."""
        return sum(self._clip_events)

    @property
    def last(self) -> dict[str, float]:
        """The last step's values (``norm``, ``clipped``, ``threshold``), as logged without the ``grad_clip/`` prefix:
        with several optimizers as ``opt<i>/norm``, ...."""
        if not self._multi:
            return dict(self._last[0])
        return {f"opt{i}/{k}": v for i, last in enumerate(self._last) for k, v in last.items()}

    def _ensure(self, count: int) -> None:
        """Statistics for ``count`` optimizers (fresh ones for those a checkpoint or an earlier step did not give)."""
        while len(self.stats) < count:
            self.stats.append(self._new_stat())
            self._clip_events.append(0)
            self._last.append({})

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before Lightning restores a checkpoint: a fit without ckpt_path starts fresh, also when this object
        # already served another fit; a fit with ckpt_path then loads the checkpoint's statistics; the same Trainer
        # fitted again (a raised max_steps) continues its run, and these statistics with it
        note_stage(self, stage)
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
                "to clip adaptively only, build the Trainer with gradient_clip_val=None (train.py: "
                "trainer.gradient_clip_val=null)"
            )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizers = trainer.optimizers
        self._ensure(len(optimizers))
        self._optimizer_index = {id(opt): i for i, opt in enumerate(optimizers)}
        self._multi = len(optimizers) > 1
        self._remove_hooks()
        self._sharded = trainer.strategy if trainer.world_size > 1 and is_sharded(trainer.strategy) else None
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in optimizers]

    def _index(self, optimizer: torch.optim.Optimizer) -> int:
        return self._optimizer_index.get(id(optimizer), 0)  # (0: a stand-in trainer in a unit test)

    def _remove_hooks(self) -> None:
        super()._remove_hooks()
        self._sharded = None  # (a copy of the callback after its fit holds no strategy)

    def _after_step(self, optimizer, args, kwargs) -> None:
        # inside optimizer.step, before anything can zero the grads (a module's optimizer_step override may, right
        # after the step): grads here mean the update was applied; a step LossSpikeMonitor dropped has none (or,
        # under 16-mixed, never calls optimizer.step). Under FSDP, grads on some rank: one whose shard holds no grad
        # (a frozen backbone's elements alone) took it back alone, and its statistic (rank 0's is checkpointed) lagged
        index = self._index(optimizer)
        if index in self._undo and held_on_some_rank(len(grad_params(optimizer)), self._sharded):
            self._applied.add(index)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)  # removes the step hooks
        self._undo_unapplied()  # a step seen but never taken: a continued fit redoes it
        self._log_rows, self._log_step = set(), None

    def _undo_unapplied(self) -> None:
        """Take the steps seen this batch whose update was not applied back out of the statistics; clear the undo."""
        for index, (stat, clip_events, last) in self._undo.items():
            if index not in self._applied:
                self.stats[index].load_state_dict(stat)
                self._clip_events[index], self._last[index] = clip_events, last
                self._log_rows.discard(index)
        self._undo, self._applied = {}, set()

    def threshold(self, optimizer_index: int = 0) -> float | None:
        """The current clip value of the optimizer at ``optimizer_index`` (None: no clipping yet)."""
        adaptive = zclip_threshold(self.stats[optimizer_index], self.z_threshold)
        candidates = [v for v in (adaptive, self.max_norm) if v is not None]
        return min(candidates) if candidates else None

    def _clip_to(self, norm: float, optimizer_index: int) -> float:
        """The norm after clipping (== ``norm`` when not clipped)."""
        limit, stat = self.threshold(optimizer_index), self.stats[optimizer_index]
        if limit is None or norm <= limit:
            return norm
        if self.mode == "reciprocal" and stat.ready:
            z = (norm - stat.location()) / stat.scale()
            limit = min(limit, stat.location() + self.z_threshold**2 / z * stat.scale())
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
        index = self._index(optimizer)
        self._ensure(index + 1)
        threshold = self.threshold(index)
        clipped = self._clip_to(norm, index)
        # a callback listed after this one may still drop the step (LossSpikeMonitor's skip/rollback): what the step
        # adds is undone at batch end if its grads are gone, so the callback order does not matter
        self._undo[index] = (self.stats[index].state_dict(), self._clip_events[index], self._last[index])
        self._applied.discard(index)  # added by the step post-hook when the optimizer steps with grads
        if clipped < norm:
            coef = clipped / (norm + 1e-6)
            if params:  # under FSDP a rank whose shard holds no grad has none to scale (foreach refuses an empty list)
                torch._foreach_mul_([p.grad for p in params], coef)
            self._clip_events[index] += 1
        self.stats[index].add(clipped)
        last = {"norm": norm, "clipped": float(clipped < norm)}
        if threshold is not None:  # None in the warmup without max_norm: no threshold yet, none is logged
            last["threshold"] = threshold
        self._last[index] = last
        every = log_interval(self.log_every_n_steps, trainer)  # 0: only clips are written
        # this step, not taken yet, on Lightning's axis (the batch under manual optimization) and cadence, so rows line
        # up with train/loss
        step = logging_step(trainer)
        self._log_rows.discard(index)
        if on_log_cadence(every, step, trainer) or clipped < norm:
            self._log_rows.add(index)
            self._log_step = step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._undo_unapplied()  # a step dropped after this callback saw it: as if never seen
        rows, self._log_rows = sorted(self._log_rows), set()
        if not rows:
            return
        metrics = {}
        for index in rows:
            prefix = f"grad_clip/opt{index}/" if self._multi else "grad_clip/"
            metrics.update({f"{prefix}{k}": v for k, v in self._last[index].items()})
            metrics[f"{prefix}clip_events"] = float(self._clip_events[index])
        log_step_metrics(trainer, pl_module, metrics, self._log_step)

    @override
    def state_dict(self) -> dict:
        per_optimizer = zip(self.stats, self._clip_events)
        return {"optimizers": [{"stat": stat.state_dict(), "clip_events": events} for stat, events in per_optimizer]}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        if not state_is_for_fit(self):
            return
        # a checkpoint from before per-optimizer statistics holds one {"stat", "clip_events"}: optimizer 0's
        per_optimizer = state_dict["optimizers"] if "optimizers" in state_dict else [state_dict]
        self.stats, self._clip_events, self._last = [], [], []
        self._ensure(len(per_optimizer))
        for stat, saved in zip(self.stats, per_optimizer):
            stat.load_state_dict(saved["stat"])
        self._clip_events = [int(saved["clip_events"]) for saved in per_optimizer]
