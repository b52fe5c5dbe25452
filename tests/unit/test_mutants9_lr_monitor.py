"""Exact rows of ``OncePerStepLRMonitor`` (callbacks/lr_monitor.py) where single-point mutants passed
test_callback_logging.py and test_user_project_lr.py (ninth hand mutation audit): one monitor over two fits, the
second resumed at the logging step the first saw last (Lightning's ``Trainer`` reuse, or ``Tuner`` then fit); an epoch
start off the logging cadence, and one on it, under Lightning's default ``logging_interval=None``."""

from __future__ import annotations

import csv

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lit_dtrain.callbacks import OncePerStepLRMonitor
from tests.unit.test_callback_logging import LinearLR


def _fit(root, name, max_steps, callbacks=(), ckpt_path=None):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, log_every_n_steps=1,
                        callbacks=list(callbacks), enable_checkpointing=False,
                        logger=CSVLogger(str(root), name=name, version=0), enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(LinearLR(), ckpt_path=ckpt_path)
    return trainer


def test_a_second_fit_starting_at_the_step_the_first_saw_last_logs_that_step(tmp_path):
    """The first fit's last step is 2; the second resumes a step-2 checkpoint: its step 2 is a new step of a new fit
    and gets its row (the monitor kept the step it saw last from the first fit and skipped it as a micro-batch)."""
    _fit(tmp_path, "source", 2).save_checkpoint(tmp_path / "2.ckpt")
    monitor = OncePerStepLRMonitor(logging_interval="step")
    _fit(tmp_path, "first", 3, [monitor])
    _fit(tmp_path, "second", 4, [monitor], ckpt_path=tmp_path / "2.ckpt")
    with open(tmp_path / "second" / "version_0" / "metrics.csv", newline="") as f:
        rows = [(int(r["step"]), round(float(r["lr-SGD"]), 6)) for r in csv.DictReader(f) if r.get("lr-SGD")]
    assert rows == [(2, 0.3), (3, 0.4)]


def test_an_optimizer_without_a_scheduler_keeps_its_epoch_start_row_off_the_logging_cadence(tmp_path):
    """``logging_interval=None``, ``log_every_n_steps=3``, epochs of 4 steps: the steps logged are 2, 5, 8, 11, and
    Lightning's monitor logs an optimizer without an LR scheduler (the one a ``WSDScheduler`` drives) at each epoch
    start too, 0, 4 and 8; step 8 is both, and has one row."""
    from tests.unit.test_user_project_lr import UserModule, regression_data

    trainer = L.Trainer(accelerator="cpu", max_epochs=3, limit_train_batches=4, log_every_n_steps=3,
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[OncePerStepLRMonitor()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(UserModule(scheduler=False), regression_data())
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["lr-AdamW"])) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    assert rows == [(step, 1e-2) for step in (0, 2, 4, 5, 8, 11)]


def test_a_step_interval_scheduler_has_one_row_at_an_epochs_first_step(tmp_path):
    """``logging_interval=None`` over two epochs of 4 steps, logging each step, an LR scheduler stepped per step:
    the epoch start logs only the schedulers stepped per epoch (none), so steps 0 and 4 have one row each, the
    first batch's."""
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=4, log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[OncePerStepLRMonitor()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LinearLR())
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [(int(r["step"]), round(float(r["lr-SGD"]), 6)) for r in csv.DictReader(f) if r.get("lr-SGD")]
    assert rows == [(step, round(0.1 * (step + 1), 6)) for step in range(8)]
