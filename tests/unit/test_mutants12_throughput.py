"""Exact results of ``token_throughput_monitor`` (lit_dtrain.callbacks.throughput) where single-point mutants passed
test_throughput.py, test_throughput_edges.py, test_throughput_partial_steps.py and test_callback_arguments.py
(twelfth hand mutation audit): the peak table's other rows, MFU with several ranks computed by hand, the step window
under an accumulation of 2 and the checkpointed counts between logged steps."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import RunningStage

from lit_dtrain.callbacks import token_throughput_monitor
from lit_dtrain.callbacks.throughput import peak_flops_lightning_lacks as peak
from tests.unit.test_throughput import Tokens, fit


def _rows(tmp_path: Path) -> list[dict]:
    return [r for r in csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")) if r.get("train/samples")]


def test_the_peak_table_matches_lightnings_reading_of_the_matmul_precision():
    """fp32 under "medium" runs on tensor cores as under "high" (Lightning counts TF32 for anything but "highest");
    fp64 has its own row; the name is matched as torch reports it, whatever its case and surrounding spaces."""
    assert peak("NVIDIA H200", "32-true", "medium") == peak("NVIDIA H200", "32", "high") == 494.7e12
    assert peak("NVIDIA H200", "64-true") == 33.5e12 and peak("NVIDIA H100 NVL", "64-true") == 30e12
    assert peak(" nvidia h200 nvl\n", "32-true", "highest") == 60e12


def test_mfu_with_two_ranks_divides_by_one_devices_peak() -> None:
    """``available_flops`` is one device's peak: with 2 ranks each device's MFU is its own FLOP/s over that peak. By
    hand: a window of 2 steps 0.5 s apart, the second a batch of 4e9 FLOPs on each rank -> 8e9 FLOP/s a device,
    1.6e10 on the 2 ranks, MFU 0.8 of a 1e10 peak (0.4 if the peak were counted once per rank)."""
    from lightning.pytorch.plugins.precision import Precision

    trainer = SimpleNamespace(
        precision_plugin=Precision(), precision="32-true", world_size=2,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        enable_validation=False, global_step=0, state=SimpleNamespace(stage=RunningStage.TRAINING),
        accumulate_grad_batches=1)
    monitor = token_throughput_monitor(window_size=2, available_flops=1e10)
    monitor.setup(trainer, None, "fit")
    throughput = monitor._throughputs[RunningStage.TRAINING]
    throughput.update(time=1.0, batches=1, samples=4, lengths=24, flops=4e9)
    throughput.update(time=1.5, batches=2, samples=8, lengths=48, flops=4e9)
    rates = throughput.compute()
    assert rates["device/flops_per_sec"] == pytest.approx(8e9) and rates["flops_per_sec"] == pytest.approx(1.6e10)
    assert rates["device/mfu"] == pytest.approx(0.8)
    assert rates["device/items_per_sec"] == pytest.approx(48.0) and rates["items_per_sec"] == pytest.approx(96.0)


def test_an_accumulation_of_two_widens_the_window_to_two_steps(tmp_path: Path) -> None:
    """accumulate_grad_batches=2, window_size=2: the rate needs 2 optimizer steps = 4 micro-batches, first logged at
    the end of the 2nd step (batches 4), not at the 1st (a window of 2 micro-batches)."""
    fit(Tokens(), tmp_path, accumulate=2)
    rows = _rows(tmp_path)
    assert [int(float(r["train/batches"])) for r in rows] == [2, 4, 6, 8]
    assert [int(float(r["train/batches"])) for r in rows if r.get("train/device/items_per_sec")] == [4, 6, 8]


def test_the_checkpointed_counts_are_the_last_steps_also_when_it_logged_no_row(tmp_path: Path) -> None:
    """log_every_n_steps=3 and 4 steps of 4 sequences of 6 tokens: the state a checkpoint keeps holds all 4 steps
    (16 samples, 96 tokens), not those of step 3, the last one that logged a row."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, callbacks=[token_throughput_monitor(window_size=2)],
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), log_every_n_steps=3,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tokens())
    state = trainer.callbacks[0].state_dict()
    assert {k: state[k] for k in ("batches", "samples", "lengths", "tokens")} == {
        "batches": 4, "samples": 16, "lengths": 96, "tokens": 96}
    assert [float(r["train/batches"]) for r in _rows(tmp_path)] == [3.0]

