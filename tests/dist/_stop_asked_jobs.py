"""The 2-rank fits test_local_update_stop_asked.py's module fixture runs in one pair of launched rank processes: a stop
asked before an optimizer step's end (in ``training_step``), under automatic and manual optimization, and a stop asked
after a micro-batch where a validation falls anyway (``val_check_interval``). Each fit writes into its own directory."""

from __future__ import annotations

import torch.nn.functional as F

from tests.dist._compressed_ddp_fit_jobs import EPOCH_UPDATES, ValidatingModule
from tests.dist._compressed_ddp_helpers import regression_batch
from tests.dist._kept_state_jobs import ManualModule, _fits


class StopInStep(ValidatingModule):
    """Asks the fit to stop inside ``training_step`` of optimizer step ``stop_at`` (a loss target, a NaN guard of
    one's own), before that step's optimizer step runs."""

    stop_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.stop_at:
            self.trainer.should_stop = True
        x, y = regression_batch(self.global_step, self.global_rank)
        return F.mse_loss(self.net(x), y)


class ManualStopInStep(ManualModule):
    """:class:`ManualModule` that asks the fit to stop inside ``training_step`` of optimizer step ``stop_at``."""

    stop_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.stop_at:
            self.trainer.should_stop = True
        super().training_step(batch, batch_idx)


def _stopping(cls, step: int):
    return type(f"{cls.__name__}At{step}", (cls,), {"stop_at": step})


def _fit_stopped_in_step(tmp, key: str) -> None:
    """``straight`` to 10; ``stopped`` asked to stop in step 6's ``training_step`` (period 4; Lightning validates
    after it); ``resumed`` from its ``last.ckpt`` to 10."""
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 10, None, None),), module=StopInStep)
    _fits(tmp, EPOCH_UPDATES[key], (("stopped", 10, None, None),), module=_stopping(StopInStep, 6))
    _fits(tmp, EPOCH_UPDATES[key], (("resumed", 10, None, "stopped/last.ckpt"),), module=StopInStep)


def _fit_manual_stopped_in_step(tmp, key: str) -> None:
    """As :func:`_fit_stopped_in_step` under manual optimization (the batch's sync runs after ``training_step``)."""
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 10, None, None),), module=ManualStopInStep)
    _fits(tmp, EPOCH_UPDATES[key], (("stopped", 10, None, None),), module=_stopping(ManualStopInStep, 6))
    _fits(tmp, EPOCH_UPDATES[key], (("resumed", 10, None, "stopped/last.ckpt"),), module=ManualStopInStep)


class StopAfterBatch5(ValidatingModule):
    """:class:`ValidatingModule` that asks the fit to stop after the epoch's 5th batch (as a callback's
    ``on_train_batch_end`` does)."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if batch_idx == 4:
            self.trainer.should_stop = True


def _fit_stopped_at_a_scheduled_validation(tmp, key: str) -> None:
    """Accumulation 2, a validation every 5 batches (after batch 5: mid-accumulation, step 2), period 4: ``straight``
    to 8; ``stopped`` asked to stop after batch 5, where its validation falls anyway; ``from_straight`` and
    ``from_stopped`` resume both to 8 from the checkpoints written after that validation."""
    trainer_kwargs = {"accumulate_grad_batches": 2, "val_check_interval": 5}
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 8, None, None),), **trainer_kwargs)
    _fits(tmp, EPOCH_UPDATES[key], (("stopped", 8, None, None),), module=StopAfterBatch5, **trainer_kwargs)
    _fits(tmp, EPOCH_UPDATES[key], (("from_straight", 8, None, "straight/step=2.ckpt"),
                                    ("from_stopped", 8, None, "stopped/step=2.ckpt")), **trainer_kwargs)
