"""``WSDScheduler(total_steps=None)``: the schedule's horizon is the trainer's planned optimizer steps.

Lightning's ``trainer.estimated_stepping_batches`` is ``min(max_steps, max_epochs x ceil(batches / accumulate))``, with
``limit_train_batches`` and the ``DistributedSampler``'s share of each rank counted: the number of optimizer steps the
fit will take, which a ``max_epochs`` user otherwise computed by hand. It is taken at each fit start, so a resume with
a larger ``max_epochs``/``max_steps`` extends the schedule (as a larger ``total_steps`` does), and an identical resume
takes the same value (the callback's state records it).
"""

from __future__ import annotations

import math

import lightning as L
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lit_dtrain.errors import ConfigError

FROM_TRAINER = "WSDScheduler(total_steps=None) takes its horizon from trainer.estimated_stepping_batches"


def planned_steps(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
    """The optimizer steps the fit will take; a one-line ``ConfigError`` where the trainer's estimate is not that."""
    give = "give total_steps=<optimizer steps>"
    if not pl_module.automatic_optimization:
        raise ConfigError(
            f"{FROM_TRAINER}, which under manual optimization counts every optimizer.step call (2 a batch with two "
            f"optimizers), not one optimizer's updates; {give.replace('optimizer steps', 'updates of each optimizer')}"
        )
    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise ConfigError(
            f"{FROM_TRAINER}, which counts every epoch at the first epoch's accumulate_grad_batches, so it is wrong "
            f"beside a GradientAccumulationScheduler; {give}"
        )
    planned = trainer.estimated_stepping_batches
    if math.isfinite(planned) and planned >= 1:
        return int(planned)
    unsized = trainer.num_training_batches == math.inf if trainer.max_epochs != -1 else False
    why = " and the train DataLoader has no length" if unsized else ""
    raise ConfigError(
        f"{FROM_TRAINER}, which is {planned} here (max_steps={trainer.max_steps}, max_epochs={trainer.max_epochs}"
        f"{why}): the trainer knows no end of training; {give}, or set the Trainer's max_steps"
    )
