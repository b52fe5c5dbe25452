"""What else sets the LR beside ``WSDScheduler``: refused (an LR scheduler of the module's, returned or stepped by the
module itself; a ``BaseFinetuning`` callback, which adds param groups and sets their LR) or warned about
(``StochasticWeightAveraging``'s SWALR). Two setters of the LR mix their schedules without an error."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_warn


def refuse_an_unreturned_scheduler(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """At fit start, before a checkpoint's optimizer state is restored: an LR scheduler built on the optimizers and
    not returned to Lightning (stepped by the module itself)."""
    # torch's LRScheduler writes 'initial_lr' into every param group it is built on. Here, before a checkpoint's
    # optimizer state is restored, the optimizers are fresh from configure_optimizers: such a key means a
    # scheduler built on them, and one Lightning does not hold (a returned one is refused at train start) is
    # one the module steps itself. Both set the LR and the schedules mixed, silently (0.01, 0.005, 0.01, 0.005)
    if trainer.lr_scheduler_configs:
        return
    built_on = [i for i, o in enumerate(trainer.optimizers) if any("initial_lr" in g for g in o.param_groups)]
    if built_on:
        raise RuntimeError(
            f"WSDScheduler sets the LR itself, but an LR scheduler was built on optimizer(s) {built_on} of "
            f"{type(pl_module).__name__} (their param groups hold torch's 'initial_lr') and configure_optimizers "
            "did not return it: stepped by the module, it sets the LR too and the two schedules mix; use one of "
            "them (remove that LR scheduler, or leave WSDScheduler out)"
        )


def refuse_other_lr_setters(trainer: L.Trainer) -> None:
    """At train start: an LR scheduler Lightning holds, a ``BaseFinetuning`` callback (refused), SWA (warned)."""
    if trainer.lr_scheduler_configs:
        names = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs]
        raise RuntimeError(
            f"WSDScheduler sets the LR itself, but the LightningModule also configures LR scheduler(s) {names}; "
            f"use one of them (with lit_dtrain's trainer: '~scheduler' 'callbacks=[default,wsd]')"
        )
    finetuning = [type(c).__name__ for c in trainer.callbacks if isinstance(c, BaseFinetuning)]
    if finetuning:  # (it failed when the first group was added, after the frozen epochs had trained)
        raise RuntimeError(
            f"WSDScheduler sets the LR of the param groups it finds at fit start, but {finetuning} adds param "
            "groups during training (at an unfreeze) and sets their LR itself; use one of them (under WSD: give "
            "the frozen part its own param group in configure_optimizers and set its requires_grad yourself)"
        )
    if any(isinstance(c, StochasticWeightAveraging) for c in trainer.callbacks):
        rank_zero_warn(  # (its SWALR took over a module's own scheduler; this callback sets the LR at every step)
            "WSDScheduler sets the LR at every step, so StochasticWeightAveraging's swa_lrs (its SWALR schedule) "
            "do not apply: the LR stays WSD's and SWA only averages the weights (at each epoch start from "
            "swa_epoch_start). For SWA's LR, leave WSDScheduler out"
        )
