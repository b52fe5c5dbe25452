"""``OptimizerDiagnostics``: per-param-group AdamW health numbers every N steps (the epsilon effect).

Adam's update is ``m_hat / (sqrt(v_hat) + eps)``. Where ``sqrt(v_hat)`` falls below ``eps`` (rare or
vanishing gradients, e.g. embedding rows, deep layers late in training) the update is dominated by ``eps``
and shrinks towards plain SGD with LR ``lr/eps``; when gradients then grow again, the update jumps, one
of the loss-spike mechanisms discussed for AdamW. This callback logs, per param group (``name`` key or
position), every ``every_n_steps`` optimizer steps:

- ``optim/<group>/eps_dominated_frac``: fraction of elements with ``sqrt(v_hat) < eps`` (Adam-family
  optimizers holding ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad``; others log nothing for it and warn once);
- ``optim/<group>/update_to_param_rms``: RMS of this step's parameter change over the parameters' RMS;
- ``optim/<group>/grad_rms``: RMS of the gradient seen by the optimizer hook (before Lightning's clipping; unscaled
  under ``16-mixed``, also for optimizers that unscale inside ``step`` such as fused Adam).

Cost: nothing on other steps; on a diagnostic step one copy of the parameters and a few reductions.
``scripts/bench_optim_diag.py`` measures the overhead (target <= 2% at the default interval).
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._logging import log_step_metrics
from lit_dtrain.callbacks.adaptive_grad_clip import loss_scale


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


class OptimizerDiagnostics(Callback):
    """Logs the AdamW epsilon effect, update/param RMS and grad RMS per param group every ``every_n_steps``.

    Args:
        every_n_steps: diagnostic cadence in optimizer steps (the only steps that cost anything).
        prefix: metric name prefix.
    """

    def __init__(self, every_n_steps: int = 100, prefix: str = "optim") -> None:
        super().__init__()
        if int(every_n_steps) < 1:
            raise ValueError(f"OptimizerDiagnostics: every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.prefix = int(every_n_steps), prefix
        self.last: dict[str, float] = {}
        self._before: list[list[torch.Tensor]] | None = None
        self._grad_rms: list[float] = []
        self._warned = False

    def _due(self, trainer: Trainer) -> bool:
        return trainer.global_step % self.every_n_steps == 0

    @staticmethod
    def _group_name(group: dict, i: int) -> str:
        return str(group.get("name", i))

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        self._before = None
        if not self._due(trainer):
            return
        self._grad_rms = []
        before = []
        scale = loss_scale(trainer, optimizer)  # 16-mixed with fused Adam: the grads here are still loss-scaled
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            numel = sum(p.numel() for p in params)
            self._grad_rms.append((_sumsq([p.grad for p in params]) / max(numel, 1)) ** 0.5 / scale)
            before.append([p.detach().clone() for p in group["params"]])
        self._before = before
        self._optimizer = optimizer
        self._step = trainer.global_step  # this step, before it is taken

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        if self._before is None:
            return
        optimizer, before, self._before = self._optimizer, self._before, None
        metrics = {}
        for i, (group, old) in enumerate(zip(optimizer.param_groups, before)):
            name = f"{self.prefix}/{self._group_name(group, i)}"
            params = list(group["params"])
            numel = max(sum(p.numel() for p in params), 1)
            deltas = [p.detach() - o for p, o in zip(params, old)]
            update_rms = (_sumsq(deltas) / numel) ** 0.5
            param_rms = (_sumsq(old) / numel) ** 0.5
            metrics[f"{name}/update_to_param_rms"] = update_rms / max(param_rms, 1e-30)
            metrics[f"{name}/grad_rms"] = self._grad_rms[i]
            frac = self._eps_fraction(optimizer, group)
            if frac is not None:
                metrics[f"{name}/eps_dominated_frac"] = frac
        self.last = metrics
        log_step_metrics(trainer, pl_module, metrics, self._step)

    def _eps_fraction(self, optimizer, group: dict) -> float | None:
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
        return count / total if total else None

    def _warn_unsupported(self, optimizer) -> None:
        if not self._warned:
            rank_zero_warn(f"OptimizerDiagnostics: {type(optimizer).__name__} holds no Adam 'exp_avg_sq'/'eps'; "
                           "eps_dominated_frac is not logged (update and grad RMS still are).")
            self._warned = True
        return None
