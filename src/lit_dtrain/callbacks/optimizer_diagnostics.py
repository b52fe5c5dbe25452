"""``OptimizerDiagnostics``: per-param-group AdamW health numbers every N steps (the epsilon effect).

Adam's update is ``m_hat / (sqrt(v_hat) + eps)``. Where ``sqrt(v_hat)`` falls below ``eps`` (rare or
vanishing gradients, e.g. embedding rows, deep layers late in training) the update is dominated by ``eps``
and shrinks towards plain SGD with LR ``lr/eps``; when gradients then grow again, the update jumps, one
of the loss-spike mechanisms discussed for AdamW. This callback logs, per param group (``name`` key or
position), every ``every_n_steps`` optimizer steps (steps ``k`` with ``(k + 1) % every_n_steps == 0``, Lightning's own
logging cadence, so the rows line up with ``train/loss`` when ``every_n_steps`` is a multiple of ``log_every_n_steps``):

- ``optim/<group>/eps_dominated_frac``: fraction of elements with ``sqrt(v_hat) < eps`` (Adam-family
  optimizers holding ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad``; others log nothing for it and warn once);
- ``optim/<group>/update_to_param_rms``: RMS of this step's parameter change over the parameters' RMS, both over the
  parameters the step updated (those with a grad: a frozen or unused parameter in the group is left out, as from
  ``grad_rms``);
- ``optim/<group>/grad_rms``: RMS of the gradient as backward left it (``on_after_backward``: before any callback's
  clipping, such as ``AdaptiveGradClip``'s, whatever the callback order, and before Lightning's; unscaled under
  ``16-mixed``, also for optimizers that unscale inside ``step`` such as fused Adam).

The parameter change is measured inside ``optimizer.step`` (torch step pre/post hooks), so it is the update the
optimizer applied, in any callback order. A step that applies no update logs nothing: one whose grads were all
dropped (``LossSpikeMonitor``'s ``skip``/``rollback``, whether listed before or after this callback; a rollback is
never measured as an update) or that the ``16-mixed`` GradScaler skipped (inf/NaN grads; also with fused Adam, which
the scaler still calls, with its ``found_inf``, and which then leaves the parameters alone). With several optimizers
(manual optimization) the names are ``optim/opt<i>/<group>/...``.

Under FSDP, where each rank holds a shard of every parameter, gradient and Adam state, the sums behind the three
figures are summed over the ranks (one all-reduce a diagnostic step, on every rank: also on one whose shard
holds no grad, such as a frozen backbone's elements alone), so every rank logs the whole model's.

Cost: nothing on other steps; on a diagnostic step one copy of the parameters and a few reductions.
``scripts/bench_optim_diag.py`` measures the overhead (target <= 2% at the default interval).
"""

from __future__ import annotations

from functools import partial

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, whole_at_least
from lit_dtrain.callbacks._logging import log_step_metrics, logging_step
from lit_dtrain.callbacks.adaptive_grad_clip import is_sharded


def eps_dominated_fraction(exp_avg_sq: torch.Tensor, step: float, beta2: float, eps: float) -> tuple[int, int]:
    """(count, numel) of elements with ``sqrt(v / (1 - beta2**step)) < eps``, i.e. ``v < eps**2 * bias_c2``."""
    bias_correction2 = 1.0 - beta2**step
    limit = eps * eps * bias_correction2
    return int((exp_avg_sq.float() < limit).sum()), exp_avg_sq.numel()


def _sumsq(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(tensors, 2.0)
    return float(torch.stack([n.float().cpu() for n in norms]).square().sum())


def _summed_over_shards(trainer: Trainer | None, sums: list[list[float]]) -> list[list[float]]:
    """``sums`` (sums of squares and counts per param group) over every rank's shard under a sharding strategy
    (FSDP) with several ranks, whose ranks each hold a shard of every parameter, gradient and Adam state; as they
    are elsewhere (DDP: every rank holds the whole model and the same all-reduced gradients). Under FSDP on 2 gloo
    ranks rank 0's shard alone gave a grad RMS of 0.0945 where the model's is 0.1446."""
    if trainer is None or trainer.world_size < 2 or not is_sharded(trainer.strategy):
        return sums
    flat = torch.tensor(sums, dtype=torch.float64, device=trainer.strategy.root_device)
    return trainer.strategy.reduce(flat, reduce_op="sum").cpu().tolist()


class OptimizerDiagnostics(Callback):
    """Logs the AdamW epsilon effect, update/param RMS and grad RMS per param group every ``every_n_steps``.

    Args:
        every_n_steps: diagnostic cadence in optimizer steps (the only steps that cost anything).
        prefix: metric name prefix.
    """

    def __init__(self, every_n_steps: int = 100, prefix: str = "optim") -> None:
        super().__init__()
        check_arg("OptimizerDiagnostics", "every_n_steps", every_n_steps, whole_at_least(1), "an integer >= 1")
        # prefix=3 logged "3/decay/grad_rms", prefix="" "/decay/grad_rms"
        check_arg("OptimizerDiagnostics", "prefix", prefix, lambda v: isinstance(v, str) and v != "",
                  "a non-empty string such as 'optim'")
        self.every_n_steps, self.prefix = int(every_n_steps), prefix
        self.last: dict[str, float] = {}
        self._before: list[list[torch.Tensor]] | None = None
        self._grad_rms: dict[int, list[tuple[float, int]]] = {}  # per optimizer (id): on_after_backward's sums
        self._pending: dict[str, float] = {}  # this step's metrics, logged at on_train_batch_end
        self._hooks: list = []
        self._trainer: Trainer | None = None
        self._multi = False
        self._step = 0
        self._warned = False

    def _due(self, trainer: Trainer) -> bool:
        # after steps k with (k + 1) % N == 0, where Lightning writes train/loss when N is a multiple of its interval
        return (logging_step(trainer) + 1) % self.every_n_steps == 0

    @staticmethod
    def _group_name(group: dict, i: int) -> str:
        return str(group.get("name", i))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the update is measured inside optimizer.step (torch step pre/post hooks): after every callback's
        # on_before_optimizer_step (one may drop the step's grads: LossSpikeMonitor's skip/rollback) and before
        # on_train_batch_end (where a rollback restores older weights), so the callback order does not matter
        self._remove_hooks()
        self._trainer = trainer
        self._multi = len(trainer.optimizers) > 1
        for i, optimizer in enumerate(trainer.optimizers):
            self._hooks.append(optimizer.register_step_pre_hook(partial(self._pre_step, index=i)))
            self._hooks.append(optimizer.register_step_post_hook(partial(self._post_step, index=i)))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._before, self._grad_rms, self._pending = None, {}, {}

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # grad RMS as backward left it: before any callback's on_before_optimizer_step (AdaptiveGradClip's clipping,
        # LossSpikeMonitor dropping the grads) and Lightning's gradient clipping, in any callback order. With gradient
        # accumulation this runs after every micro-batch of a diagnostic step; the last one's grads are the step's.
        if not self._due(trainer):
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # 16-mixed: every optimizer's grads are still loss-scaled here (Lightning unscales them after the closure)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        for optimizer in trainer.optimizers:
            sums = []  # (sum of squares, numel) per group; RMS taken in _post_step, over every rank's shard under FSDP
            for group in optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                sums.append((_sumsq([p.grad for p in params]) / scale**2, sum(p.numel() for p in params)))
            self._grad_rms[id(optimizer)] = sums

    def _pre_step(self, optimizer, args, kwargs, index: int) -> None:
        trainer = self._trainer
        self._before = None
        if trainer is None or not self._due(trainer):
            return
        # (under 32-true Lightning runs the forward/backward closure inside optimizer.step, after this hook)
        self._step = logging_step(trainer)  # this step (Lightning counts it as completed after step() returns)
        # only what can be updated: a frozen backbone in the group (AdamW(self.parameters())) is not copied
        self._before = [[(p, p.detach().clone()) for p in group["params"] if p.requires_grad]
                        for group in optimizer.param_groups]

    def _post_step(self, optimizer, args, kwargs, index: int) -> None:
        before, self._before = self._before, None
        grad_rms = self._grad_rms.pop(id(optimizer), None)
        if before is None:
            return
        found_inf = getattr(optimizer, "found_inf", None)
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.any()):
            # the GradScaler skips this step: an optimizer that unscales inside step (fused Adam) is still called, with
            # the scaler's found_inf (torch.amp.GradScaler.step sets it for the call), and leaves the parameters alone;
            # others are not called at all. Either way no update: nothing to log
            return
        if grad_rms is None:  # no backward through Lightning for it (an optimizer stepped by hand)
            grad_rms = [(float("nan"), 1)] * len(optimizer.param_groups)
        prefix = f"{self.prefix}/opt{index}" if self._multi else self.prefix
        sums = []  # per group: grad sumsq, grad numel, update sumsq, param sumsq, updated numel, eps count, eps total,
        # and the parameters with a grad
        for group, old, (grad_sumsq, grad_numel) in zip(optimizer.param_groups, before, grad_rms):
            # the parameters this update changed (with a grad): a frozen or unused one, which the optimizer skips, in
            # the same group diluted the ratio (a frozen backbone in AdamW(self.parameters()): 3.4x smaller)
            old = [(p, o) for p, o in old if p.grad is not None]
            eps = self._eps_fraction(optimizer, group)
            sums.append([grad_sumsq, grad_numel, _sumsq([p.detach() - o for p, o in old]), _sumsq([o for _, o in old]),
                         sum(p.numel() for p, _ in old), *(eps or (0, 0)),
                         sum(p.grad is not None for p in group["params"])])
        # every rank reduces, also one whose shard holds no grad: under FSDP a rank whose shard held only a frozen
        # backbone's elements (grads None on it alone) returned before the all-reduce, and the other rank's waited
        sums = _summed_over_shards(self._trainer, sums)
        if not any(group_sums[-1] for group_sums in sums):
            return  # the step was dropped (no grads: the optimizer left every parameter alone): nothing to log
        for i, (group, (g2, g_n, u2, p2, n, count, total, _)) in enumerate(zip(optimizer.param_groups, sums)):
            name = f"{prefix}/{self._group_name(group, i)}"
            self._pending[f"{name}/update_to_param_rms"] = (u2 / max(n, 1)) ** 0.5 / max((p2 / max(n, 1)) ** 0.5, 1e-30)
            self._pending[f"{name}/grad_rms"] = (g2 / max(g_n, 1)) ** 0.5
            if total:
                self._pending[f"{name}/eps_dominated_frac"] = count / total

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self._grad_rms = {}
        if not self._pending:
            return
        metrics, self._pending = self._pending, {}
        self.last = metrics
        log_step_metrics(trainer, pl_module, metrics, self._step)

    def _eps_fraction(self, optimizer, group: dict) -> tuple[int, int] | None:
        if "eps" not in group or "betas" not in group:
            return self._warn_unsupported(optimizer)
        count = total = 0
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "exp_avg_sq" not in state or "step" not in state:
                if state:
                    return self._warn_unsupported(optimizer)
                continue  # no step taken for this param yet
            step = float(state["step"])
            # amsgrad divides by the running maximum of exp_avg_sq (torch.optim.Adam/AdamW), not by exp_avg_sq
            v = state["max_exp_avg_sq"] if group.get("amsgrad") and "max_exp_avg_sq" in state else state["exp_avg_sq"]
            c, n = eps_dominated_fraction(v, step, group["betas"][1], group["eps"])
            count, total = count + c, total + n
        return count, total

    def _warn_unsupported(self, optimizer) -> None:
        if not self._warned:
            rank_zero_warn(f"OptimizerDiagnostics: {type(optimizer).__name__} holds no Adam 'exp_avg_sq'/'eps'; "
                           "eps_dominated_frac is not logged (update and grad RMS still are).")
            self._warned = True
        return None
