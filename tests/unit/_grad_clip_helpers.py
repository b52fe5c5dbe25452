"""Helpers shared by test_grad_clip_diag*.py: a fake trainer and module log, the gradient norm, and a run of
``AdaptiveGradClip`` over gradients of given norms."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from lit_dtrain.callbacks import AdaptiveGradClip


def fake_trainer(step: int, scale: float | None = None):
    scaler = None if scale is None else SimpleNamespace(get_scale=lambda: scale)
    return SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler), world_size=1, strategy=object(),
                           global_step=step, gradient_clip_val=None)


class Logs:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def log(self, name, value, **kwargs):
        self.values.setdefault(name, []).append(float(value))


def grad_norm(params) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))


def run_clip(norms: list[float], scale: float | None = None, **kwargs):
    """Feeds grads with the given global norms (fixed random directions) through the callback."""
    clip = AdaptiveGradClip(**kwargs)
    params = [torch.nn.Parameter(torch.zeros(7)), torch.nn.Parameter(torch.zeros(3, 4))]
    opt = torch.optim.SGD(params, lr=0.1)
    if scale is not None:
        opt._step_supports_amp_scaling = True  # grads arrive still scaled (fused optimizers under 16-mixed)
    g = torch.Generator().manual_seed(0)
    module, seen = Logs(), []
    for step, norm in enumerate(norms):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        total = math.sqrt(sum(float(x.square().sum()) for x in grads))
        for p, x in zip(params, grads):
            p.grad = x * (norm / total) * (scale or 1.0)
        threshold = clip.threshold()
        clip.on_before_optimizer_step(fake_trainer(step, scale), module, opt)
        clip._after_step(opt, (), {})  # the optimizer step's post-hook: the step was applied
        clip.on_train_batch_end(fake_trainer(step + 1, scale), module, None, None, step)  # (writes the step's row)
        seen.append((threshold, grad_norm(params) / (scale or 1.0), [p.grad.clone() for p in params],
                     [x.clone() for x in grads]))
    return clip, module, seen
