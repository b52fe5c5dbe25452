"""What else sets the LR beside ``WSDScheduler``: refused (an LR scheduler of the module's, returned or stepped by the
module itself; a ``BaseFinetuning`` callback, which adds param groups and sets their LR) or warned about
(``StochasticWeightAveraging``'s SWALR), and an LR set by other code between the callback's setting and the update
(:class:`LRSetElsewhere`). Two setters of the LR mix their schedules without an error."""

from __future__ import annotations

import math
from functools import partial

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_warn

from lit_dtrain.callbacks._lr_scaling import unscaled_lrs


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


class LRSetElsewhere:
    """Refuses an LR that other code set over the one ``WSDScheduler`` set: the module's own (a manual-optimization
    ``training_step`` that sets ``group["lr"]`` before ``opt.step()``, or Lightning's warmup recipe in
    ``optimizer_step``, which sets it after the step) or a callback's. Checked before each update (a step pre-hook)
    and at each batch's end, on the LRs without this step's scalings (``lr_cooldown``, the FourierSampler's stage
    multiplier). Unchecked, the update used the other code's LR (a hand warmup to 0.5) while ``OncePerStepLRMonitor``
    logged WSD's (0.005 .. 0), or the other code's LR never applied; either way without a word. Tensor LRs are not
    read (a GPU sync each step)."""

    def __init__(self) -> None:
        self.expected: dict[int, list] = {}  # id(optimizer) -> the LRs WSDScheduler set last
        self._handles: list = []

    def note(self, optimizer, lrs: list) -> None:
        self.expected[id(optimizer)] = lrs

    def register(self, optimizers) -> None:
        self.remove()
        self._handles = [o.register_step_pre_hook(partial(self._before_update, index=i))
                         for i, o in enumerate(optimizers)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_update(self, optimizer, args, kwargs, index: int) -> None:
        self.check(optimizer, index, "at its update")

    def check_at_batch_end(self, trainer: L.Trainer) -> None:
        """An LR set after the update (Lightning's warmup recipe in ``optimizer_step``), before WSD sets the next. Not
        beside an LR scheduler Lightning holds, which it steps before this hook: only SWA's SWALR, added mid-fit and
        warned about at train start (WSD's LR wins at every step), gets here; others are refused at train start. Under
        manual optimization WSD sets no LR at a batch's end: the pre-hook finds such an LR at the next update."""
        if not trainer.lr_scheduler_configs and trainer.lightning_module.automatic_optimization:
            for index, optimizer in enumerate(trainer.optimizers):
                self.check(optimizer, index, "at the batch's end")

    def check(self, optimizer, index: int, when: str) -> None:
        effect = {"at its update": "and the update would use that LR while the LR logged is WSD's",
                  "at the batch's end": "and WSD sets its own again before the next update: that LR never applies"}
        if not self._handles:  # (no fit of this callback is training)
            return
        expected = self.expected.get(id(optimizer))
        for group, (lr, want) in enumerate(zip(unscaled_lrs(optimizer), expected or ())):
            if isinstance(lr, torch.Tensor) or isinstance(want, torch.Tensor):
                continue
            if not math.isclose(lr, want, rel_tol=1e-6, abs_tol=1e-12):
                raise RuntimeError(
                    f"WSDScheduler sets the LR itself, but param group {group} of optimizer {index} holds lr={lr:.6g} "
                    f"{when}, not the {want:.6g} WSDScheduler set: other code sets the LR too (the LightningModule's "
                    f"training_step or optimizer_step, or a callback), {effect[when]}; use one of them (remove that "
                    "code, or leave WSDScheduler out)"
                )
