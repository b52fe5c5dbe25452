"""Whether the optimizer step now running is the last of the fit, for a local-update rule's final synchronization.

Under local SGD / DiLoCo the ranks' parameters differ between syncs. ``CompressedDDPStrategy`` synchronizes at the
fit's last optimizer step (``sync_on_last_step``), before the callbacks of that step run, so that the checkpoints
written at its end (``ModelCheckpoint``'s ``last.ckpt``, written in ``on_train_epoch_end`` or after the step's
validation) hold the synchronized model. The strategy's ``on_train_end`` synchronizes too, but after every
checkpoint of the fit is written: the in-memory model then differs from the files.

The last step is known ahead when the fit ends by ``max_steps`` or by ``max_epochs``. Only ``max_steps`` was
checked, so a project of one's own that trains by epochs (Lightning's default ``max_steps=-1``) wrote a
``last.ckpt`` holding rank 0's unsynchronized parameters (DiLoCo: without its last outer step). A stop that
is decided after the step (``EarlyStopping``, ``max_time``, ``trainer.should_stop``) cannot be known ahead; there
only ``on_train_end`` synchronizes.
"""

from __future__ import annotations

from typing import Any


def _reached(count: int, limit: Any) -> bool:
    return isinstance(limit, int) and limit >= 0 and count >= limit


def is_last_optimizer_step(trainer: Any) -> bool:
    """Whether the optimizer step in progress ends the fit: the ``max_steps``-th step, or the last step of the
    ``max_epochs``-th epoch (Lightning steps on an epoch's final batch even mid-accumulation)."""
    if trainer is None:
        return False
    if _reached(trainer.global_step + 1, trainer.max_steps) and trainer.max_steps > 0:
        return True
    if not _reached(trainer.current_epoch + 1, trainer.max_epochs) or trainer.max_epochs == 0:
        return False
    # what Lightning's epoch loop reads to end the epoch (its _num_ready_batches_reached)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch or progress.current.ready == trainer.num_training_batches)
