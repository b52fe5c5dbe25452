"""Pure LR-factor functions of the step, and ``LambdaLR`` adapters over them.

A factor multiplies each param group's base LR. Schedules are pure functions (as in torchtitan) so the
scheduler, callbacks and tests all use one definition.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _check_min_factor(min_lr_factor: float) -> None:
    if not 0.0 <= min_lr_factor <= 1.0:
        raise ValueError(f"min_lr_factor must be in [0, 1], got {min_lr_factor}")


def constant_lr_factor(step: int, *, warmup_steps: int = 0) -> float:
    """1.0 after an optional linear warmup of ``warmup_steps`` ((step + 1) / warmup_steps)."""
    _check_non_negative(step=step, warmup_steps=warmup_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0


def cosine_lr_factor(step: int, *, total_steps: int, warmup_steps: int = 0, min_lr_factor: float = 0.1) -> float:
    """Linear warmup, then a cosine from 1 down to ``min_lr_factor`` reached on the last step."""
    _check_non_negative(step=step, total_steps=total_steps, warmup_steps=warmup_steps)
    _check_min_factor(min_lr_factor)
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps})")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr_factor
    decay_steps = total_steps - warmup_steps
    p = (step - warmup_steps + 1) / decay_steps
    return min_lr_factor + (1 - min_lr_factor) * 0.5 * (1 + math.cos(math.pi * p))


def lambda_scheduler(optimizer: Optimizer, factor_fn, **kwargs) -> LambdaLR:
    """A ``LambdaLR`` stepping once per optimizer step with ``factor_fn(step, **kwargs)``."""
    factor_fn(0, **kwargs)  # validate arguments now, not at the first step
    return LambdaLR(optimizer, partial(factor_fn, **kwargs))


def cosine_scheduler(optimizer: Optimizer, *, total_steps: int, warmup_steps: int = 0, min_lr_factor: float = 0.1):
    """``LambdaLR`` over :func:`cosine_lr_factor`."""
    return lambda_scheduler(
        optimizer, cosine_lr_factor, total_steps=total_steps, warmup_steps=warmup_steps, min_lr_factor=min_lr_factor
    )


def constant_scheduler(optimizer: Optimizer, *, warmup_steps: int = 0):
    """``LambdaLR`` over :func:`constant_lr_factor`."""
    return lambda_scheduler(optimizer, constant_lr_factor, warmup_steps=warmup_steps)
