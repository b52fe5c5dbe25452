"""The total gradient norm of an optimizer step, computed once for ``LitLLM``'s three readers of it: the non-finite
check (``on_before_optimizer_step``), ``train/grad_norm`` and the clip by norm (``configure_gradient_clipping``).

Each used to compute it on its own: two passes over every gradient per step, three at the steps ``train/grad_norm``
is logged (~0.7 ms each for the default model on a CPU). :class:`StepGradNorm` keeps the norm that
``torch.nn.utils.get_total_norm`` gives while the gradient tensors are the same objects, unmodified (weak references
and version counters; a clip's in-place scaling or a callback's edit bumps the version), and
:func:`clips_by_norm_like_lightning` says when ``torch.nn.utils.clip_grads_with_norm_`` with that norm does exactly
what Lightning's clip would (``clip_grad_norm_`` is ``get_total_norm`` then ``clip_grads_with_norm_``, so the
clipped gradients are bitwise the same).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import MixedPrecision, Precision


def step_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params`` that exist, in order (what ``clip_grad_norm_`` takes the norm of)."""
    return [p.grad for p in params if p.grad is not None]


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, group by group: Lightning's ``Precision.main_params`` order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class StepGradNorm:
    """``get_total_norm(grads)`` (L2), computed once for the same, unmodified gradient tensors."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._versions: list[int] = []
        self._norm: torch.Tensor | None = None

    def total(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not self._holds(grads):
            self._norm = torch.nn.utils.get_total_norm(grads)
            self._refs = [weakref.ref(g) for g in grads]
            self._versions = [g._version for g in grads]
        return self._norm

    def __getstate__(self) -> dict:
        # A cache of this process's tensors: a copy starts empty. Its weakrefs do not pickle, so a LitLLM that had
        # clipped by norm in a fit failed torch.save(module) and a Trainer(strategy="ddp_spawn") fit of it.
        return {"_refs": [], "_versions": [], "_norm": None}

    def _holds(self, grads: list[torch.Tensor]) -> bool:
        return (self._norm is not None and len(grads) == len(self._refs)
                and all(r() is g for r, g in zip(self._refs, grads))
                and all(g._version == v for g, v in zip(grads, self._versions)))


def held_on_some_rank(count: int, strategy) -> bool:
    """Whether ``count`` (this rank's gradients) is above 0 on some rank of ``strategy`` (None or one rank: this rank):
    under FSDP a rank whose shard holds a frozen backbone's elements alone holds no gradient while the others do (a
    rank 0 so sharded logged no ``train/grad_norm`` at all)."""
    if strategy is None or getattr(strategy, "world_size", 1) < 2:
        return count > 0
    return bool(strategy.reduce(torch.tensor(float(count), device=strategy.root_device), reduce_op="sum") > 0)


def clips_by_norm_like_lightning(module, optimizer, gradient_clip_val, gradient_clip_algorithm) -> bool:
    """True when Lightning's ``LightningModule.configure_gradient_clipping`` with these arguments would end in its
    precision plugin's ``torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), gradient_clip_val)``, with
    nothing else to check or raise: the trainer's own value (> 0) and algorithm (norm), a Trainer-run module, and a
    plugin that clips as the base ``Precision`` does (32/64-bit, ``*-true``, or ``MixedPrecision`` with an optimizer
    that leaves unscaling to it). Anything else (FSDP's or DeepSpeed's plugin, clip by value, other arguments) goes
    through Lightning's own path."""
    trainer = module.trainer
    if module.fabric is not None or isinstance(gradient_clip_val, bool):
        return False
    if not isinstance(gradient_clip_val, (int, float)) or not gradient_clip_val > 0:
        return False
    if gradient_clip_val != trainer.gradient_clip_val or gradient_clip_algorithm != trainer.gradient_clip_algorithm:
        return False
    if (gradient_clip_algorithm or "norm") != "norm":  # (GradClipAlgorithmType is a str enum)
        return False
    plugin = type(trainer.precision_plugin)
    if plugin.clip_grad_by_norm is not Precision.clip_grad_by_norm or plugin.main_params is not Precision.main_params:
        return False
    if plugin.clip_gradients is Precision.clip_gradients:
        return True
    return plugin.clip_gradients is MixedPrecision.clip_gradients and not _optimizer_handles_unscaling(optimizer)
