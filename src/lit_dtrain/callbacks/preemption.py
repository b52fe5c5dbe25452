"""Save a checkpoint and stop cleanly on SIGTERM, so a preempted or cancelled job can be requeued.

Lightning already catches SIGTERM (its signal connector sets ``trainer.received_sigterm`` and, after the
current batch, raises ``SIGTERMException``, a clean ``SystemExit``) but it saves nothing outside SLURM's
auto-requeue. This callback writes ``last.ckpt`` at the end of the optimizer step during which the signal
came, before Lightning exits, so ``resume=auto`` continues exactly from there.

With gradient accumulation a checkpoint in the middle of an optimizer step would lose the grads accumulated
so far (a resume could not be exact), so a signal that comes mid-accumulation is held back until the step's
last micro-batch: the callback clears Lightning's flag (``trainer._signal_connector.received_sigterm``, which
has no public setter) and sets it again once the step is done and saved. That waits at most
``accumulate_grad_batches - 1`` micro-batches.
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, save ``<dirpath>/<filename>`` (default ``last.ckpt``) at the end of the current optimizer step."""

    def __init__(self, dirpath: str, filename: str = "last.ckpt") -> None:
        self.dirpath, self.filename = dirpath, filename
        self.saved_step: int | None = None
        self.deferred = False  # a SIGTERM held back until the current accumulation ends

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not (trainer.received_sigterm or self.deferred) or self.saved_step == trainer.global_step:
            return
        if trainer.fit_loop.epoch_loop._should_accumulate():  # mid-accumulation: finish the step first
            if not self.deferred:
                rank_zero_info("SIGTERM received in the middle of gradient accumulation: finishing the optimizer "
                               "step before saving")
            self.deferred = True
            trainer._signal_connector.received_sigterm = False
            return
        if self.deferred:
            self.deferred = False
            trainer._signal_connector.received_sigterm = True  # Lightning exits after this batch
        path = os.path.join(self.dirpath, self.filename)
        trainer.save_checkpoint(path, weights_only=False)  # every rank calls it; rank 0 writes; full state
        self.saved_step = trainer.global_step
        rank_zero_info(
            f"SIGTERM received: saved {path} at step {trainer.global_step}; exiting cleanly. "
            "Resume with resume=auto (same run_name) or ckpt_path=<that file>."
        )
