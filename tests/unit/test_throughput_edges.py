"""token_throughput_monitor's validation FLOP rates in a project of one's own: each validation's own, and none for
one with a batch of unknown FLOPs."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lit_dtrain.callbacks import token_throughput_monitor
from tests.unit.test_throughput import Validated


def _fit(module: L.LightningModule, tmp_path: Path, steps: int) -> None:
    """``steps`` steps with a validation every 2, the throughput monitor alone, logging to ``csv/version_0``."""
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=2, log_every_n_steps=1,
              callbacks=[token_throughput_monitor(window_size=2)],
              logger=CSVLogger(str(tmp_path), name="csv", version=0),
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)


def _rows(tmp_path: Path, key: str) -> list[dict]:
    return [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r.get(key)]


def test_a_validation_batch_without_flops_leaves_the_validation_without_a_flop_rate(tmp_path: Path) -> None:
    """``flops_per_batch`` unknown (None) for one validation batch and known for the next: the validation's FLOP/s
    would be of part of it, so none is logged (and the sum does not fail on the None)."""

    class SomeFlops(Validated):
        def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
            self.flops_per_batch = None if batch_idx == 0 else 1e6

    _fit(SomeFlops(), tmp_path, steps=2)
    rows = _rows(tmp_path, "validate/batches")
    assert len(rows) == 1 and float(rows[0]["validate/batches"]) == 4
    assert not rows[0].get("validate/device/flops_per_sec")


def test_each_validations_flop_rate_counts_its_own_batches(tmp_path: Path) -> None:
    """Two validations of 4 batches of 1e6 FLOPs: each row's FLOP/s is 4e6 over its own time (the second's sum
    does not go on from the first's)."""

    class Flops(Validated):
        def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
            self.flops_per_batch = 1e6

    _fit(Flops(), tmp_path, steps=4)
    rows = _rows(tmp_path, "validate/batches")
    assert len(rows) == 2
    for r in rows:
        assert float(r["validate/device/flops_per_sec"]) * float(r["validate/time"]) == pytest.approx(4e6, rel=1e-6)


def test_a_start_shorter_than_the_window_logs_the_totals_and_no_rate(tmp_path: Path) -> None:
    """docs/running.md: the rates need a full window of the start's own steps. A 20-step `model=nano` run (window
    50) logged no train/device/*_per_sec tag at all, only the totals; a resumed start's window starts empty."""
    from tests.unit.test_throughput import Tokens

    def fit(version: int, steps: int, ckpt_path=None) -> list[dict]:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1,
                            callbacks=[token_throughput_monitor(window_size=3)],
                            logger=CSVLogger(str(tmp_path), name="csv", version=version),
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tokens(), ckpt_path=ckpt_path)
        trainer.save_checkpoint(tmp_path / f"{steps}.ckpt")
        rows = csv.DictReader(open(tmp_path / "csv" / f"version_{version}" / "metrics.csv"))
        return [(int(float(r["train/batches"])), bool(r.get("train/device/items_per_sec")))
                for r in rows if r.get("train/batches")]

    assert fit(0, 2) == [(1, False), (2, False)]  # shorter than the window: totals only
    assert fit(1, 4) == [(1, False), (2, False), (3, True), (4, True)]  # from the 3rd step on
    assert fit(2, 6, ckpt_path=tmp_path / "4.ckpt") == [(5, False), (6, False)]  # 2 steps of a start: none
