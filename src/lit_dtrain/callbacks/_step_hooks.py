"""Torch optimizer step hooks that a callback registers for one fit.

A callback that acts inside ``optimizer.step`` (``register_step_pre_hook``/``register_step_post_hook``) registers
them at train start and must remove them when the fit ends, fails or is torn down: an optimizer reused by a later fit
(a sweep loop, staged training) must not carry this fit's hooks, which would act twice or on a finished run.
"""

from __future__ import annotations

import lightning as L
from typing_extensions import override


class StepHooksCallback(L.Callback):
    """A ``Callback`` holding step-hook handles in ``self._hooks``, removed at train end, on an exception and at
    teardown (subclasses that override these hooks call ``super()``)."""

    _hooks: list

    def _remove_hooks(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_hooks()
