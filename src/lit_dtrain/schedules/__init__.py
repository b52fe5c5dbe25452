"""Pure LR schedules (functions of the step) and their LRScheduler adapters."""

from lit_dtrain.schedules.lr import (
    constant_lr_factor,
    constant_scheduler,
    cosine_lr_factor,
    cosine_scheduler,
    lambda_scheduler,
)

__all__ = ["constant_lr_factor", "constant_scheduler", "cosine_lr_factor", "cosine_scheduler", "lambda_scheduler"]
