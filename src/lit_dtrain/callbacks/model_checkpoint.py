"""Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is the state of the newest save point, as before lightning 2.6.

From lightning 2.6 ``ModelCheckpoint(save_last=True)`` rewrites ``last.ckpt`` only at a save point where a top-k
checkpoint was saved too (its ``on_validation_end``: "Only save last checkpoint if a checkpoint was actually saved in
this step"). With ``monitor=val/loss`` and ``save_top_k=1`` that is a validation whose loss is a new best, so once the
loss stalls, rises or is noisy, ``last.ckpt`` stays at the best step: a run killed later (SIGKILL, the OOM killer, a
node failure, an exception) resumed with ``resume=auto`` from there and trained every step since again. Here
``last.ckpt`` is written at every validation the callback saves at (and at every train-epoch-end save point), whether
or not the top-k checkpoint changed. A validation is a save point as in Lightning: in an epoch that ``every_n_epochs``
selects (1 when no trigger is given). With ``every_n_train_steps`` or ``train_time_interval`` alone (``every_n_epochs``
then 0) or ``every_n_epochs=2``, a validation outside that schedule writes nothing (it wrote ``last.ckpt`` at every
validation: with ``every_n_train_steps=1000`` and a validation every 100 steps, ten times the checkpoint I/O asked for).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from typing_extensions import override


class ModelCheckpoint(_LightningModelCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments, files and checkpoint state) that writes
    ``last.ckpt`` at every validation it saves at when ``save_last=True``, not only when the top-k checkpoint
    changed. A drop-in replacement in a Lightning project of one's own."""

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def _save_last_if_behind(self, trainer: L.Trainer) -> None:
        # _should_skip_saving_checkpoint is also true when this step was saved already (top-k or last): then
        # Lightning wrote last.ckpt itself
        save_point = self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0
        if self.save_last is True and save_point and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
