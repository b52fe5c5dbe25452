"""Pure LR schedules (functions of the step) and their LRScheduler adapters."""

from lit_dtrain.schedules.lr import (
    DECAY_TYPES,
    StepLambdaLR,
    check_wsd_args,
    constant_lr_factor,
    constant_scheduler,
    cosine_lr_factor,
    cosine_scheduler,
    lambda_scheduler,
    resolve_decay_steps,
    wsd_lr_factor,
    wsd_scheduler,
)

__all__ = [
    "DECAY_TYPES",
    "StepLambdaLR",
    "check_wsd_args",
    "constant_lr_factor",
    "constant_scheduler",
    "cosine_lr_factor",
    "cosine_scheduler",
    "lambda_scheduler",
    "resolve_decay_steps",
    "wsd_lr_factor",
    "wsd_scheduler",
]
