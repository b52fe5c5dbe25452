"""Save a checkpoint and stop cleanly on SIGTERM, so a preempted or cancelled job can be requeued.

Lightning already catches SIGTERM (its signal connector sets ``trainer.received_sigterm`` and, after the
current batch, raises ``SIGTERMException``, a clean ``SystemExit``) but it saves nothing outside SLURM's
auto-requeue. This callback writes ``last.ckpt`` at the end of the batch during which the signal came,
before Lightning exits, so ``resume=auto`` continues exactly from there.
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, save ``<dirpath>/<filename>`` (default ``last.ckpt``) at the end of the current batch."""

    def __init__(self, dirpath: str, filename: str = "last.ckpt") -> None:
        self.dirpath, self.filename = dirpath, filename
        self.saved_step: int | None = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not trainer.received_sigterm or self.saved_step == trainer.global_step:
            return
        path = os.path.join(self.dirpath, self.filename)
        trainer.save_checkpoint(path, weights_only=False)  # every rank calls it; rank 0 writes; full state
        self.saved_step = trainer.global_step
        rank_zero_info(
            f"SIGTERM received: saved {path} at step {trainer.global_step}; exiting cleanly. "
            "Resume with resume=auto (same run_name) or ckpt_path=<that file>."
        )
