"""``MemoryMonitor`` (a default callback): ``memory/*`` in MiB at Lightning's logging cadence, on rank 0.

A run logged no memory figure at all before it. Here a callback allocates 200 MiB (touched) in one step of a real
run: the row of that step shows it in ``memory/rss_mib`` and ``memory/peak_rss_mib``, and each row equals
``/proc/self/status`` read by another callback right after it.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import MemoryMonitor
from lit_dtrain.callbacks import memory_monitor as monitor_module
from lit_dtrain.train import train
from lit_dtrain.utils.rss import reset_peak_rss

MiB = 1 << 20
BLOCK_MIB = 200
KEYS = ["memory/peak_rss_mib", "memory/rss_mib"]


def _status_mib() -> dict[str, float]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"memory/rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "memory/peak_rss_mib": int(fields["VmHWM"].split()[0]) / 1024}


class AllocateAtStep(L.Callback):
    """Holds ``BLOCK_MIB`` MiB of touched memory through optimizer step ``step`` (every micro-batch of it), after
    resetting the peak RSS; reads ``/proc/self/status`` itself at the end of every step, after ``MemoryMonitor``."""

    def __init__(self, step: int) -> None:
        self.step, self.block, self.peak_before = int(step), None, None
        self.status: dict[int, dict[str, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.block is None:
            reset_peak_rss()
            self.peak_before = _status_mib()["memory/peak_rss_mib"]
            self.block = torch.ones(BLOCK_MIB * MiB // 4)  # float32: BLOCK_MIB MiB, every page written

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        self.status[trainer.global_step - 1] = _status_mib()  # (the step just taken; global_step counts it)
        self.block = None


def _csv_rows(run_dir: Path) -> dict[str, dict[int, float]]:
    tags: dict[str, dict[int, float]] = {}
    for path in sorted(run_dir.glob("csv/**/metrics.csv")):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for name, value in row.items():
                    if name.startswith("memory/") and value != "":
                        tags.setdefault(name, {})[int(row["step"])] = float(value)
    return tags


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_a_step_that_holds_200_mib_shows_it_in_its_row_and_each_row_is_vmrss_and_vmhwm(tiny_cfg, tmp_path):
    common = ["logger=csv", "trainer.log_every_n_steps=2", "trainer.accumulate_grad_batches=2",
              "sample.max_new_tokens=0", "+callbacks.alloc._target_=tests.unit.test_memory_monitor.AllocateAtStep",
              "+callbacks.alloc.step=3"]
    _, objs = train(tiny_cfg(*common, "trainer.max_steps=6", run="mem"))
    alloc = next(c for c in objs["trainer"].callbacks if isinstance(c, AllocateAtStep))
    rows = _csv_rows(tmp_path / "mem")
    assert sorted(rows) == KEYS  # on CPU no memory/cuda_*
    assert [sorted(rows[key]) for key in KEYS] == [[1, 3, 5]] * 2  # Lightning's cadence, once per optimizer step
    for step in (1, 3, 5):  # each row is this process's VmHWM and VmRSS, read right after it by another callback
        assert rows["memory/peak_rss_mib"][step] == pytest.approx(alloc.status[step]["memory/peak_rss_mib"], abs=1)
        assert rows["memory/rss_mib"][step] == pytest.approx(alloc.status[step]["memory/rss_mib"], abs=8)
    assert rows["memory/peak_rss_mib"][3] - alloc.peak_before >= BLOCK_MIB - 2  # the step's 200 MiB raised the peak
    assert rows["memory/rss_mib"][3] - rows["memory/rss_mib"][5] >= BLOCK_MIB - 20  # held at step 3, freed by 5
    # since the process started, not reset (up to the kernel's slack: its RSS counters are cached per thread, and a
    # VmHWM read at step 5 was 0.2 MiB below step 3's)
    assert rows["memory/peak_rss_mib"][5] >= rows["memory/peak_rss_mib"][3] - 1

    # no checkpoint state: a resume logs on at the same cadence
    assert MemoryMonitor().state_dict() == {}
    ckpt = tmp_path / "mem" / "checkpoints" / "last.ckpt"
    train(tiny_cfg(*common, "trainer.max_steps=8", f"ckpt_path={ckpt}", run="mem"))
    assert sorted(_csv_rows(tmp_path / "mem")["memory/rss_mib"]) == [1, 3, 5, 7]


class HoldInTheFinalValidation(L.Callback):
    """On global rank ``rank``, holds ``mib`` MiB of touched memory through ``train(cfg)``'s final validation (after
    the fit, its checkpoint and its last logged row), after resetting the peak RSS; writes the process's VmHWM before
    and while it holds them to ``<record>.rank<rank>.json``."""

    def __init__(self, rank: int, mib: int, record: str) -> None:
        self.rank, self.mib, self.record, self.block, self.before = int(rank), int(mib), record, None, None

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate" and trainer.global_rank == self.rank:
            reset_peak_rss()
            self.before = _status_mib()["memory/peak_rss_mib"]
            self.block = torch.ones(self.mib * MiB // 4)  # float32: every page written

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.block is not None:
            held = _status_mib()["memory/peak_rss_mib"]
            Path(f"{self.record}.rank{self.rank}.json").write_text(json.dumps({"before": self.before, "held": held}))
            self.block = None


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_summary_json_holds_the_peak_of_the_final_validation(tiny_cfg, tmp_path):
    """The last logged memory/peak_rss_mib is of the last logged step: a 100-step run logged 593.0 MiB last, and its
    process peaked at 651.4 MiB (/usr/bin/time -v) in the final checkpoint and validation. summary.json holds the
    process's peak at the end."""
    record = tmp_path / "peak"
    cfg = tiny_cfg("logger=csv", "sample.max_new_tokens=0", "trainer.max_steps=4", "trainer.log_every_n_steps=2",
                   "+callbacks.hold._target_=tests.unit.test_memory_monitor.HoldInTheFinalValidation",
                   "+callbacks.hold.rank=0", f"+callbacks.hold.mib={BLOCK_MIB}", f"+callbacks.hold.record={record}")
    metrics, _ = train(cfg)
    peaks = json.loads(Path(f"{record}.rank0.json").read_text())
    assert peaks["held"] - peaks["before"] >= BLOCK_MIB - 2
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert summary["peak_rss_mib"] == metrics["peak_rss_mib"] >= peaks["held"] - 1
    assert summary["peak_rss_mib"] <= _status_mib()["memory/peak_rss_mib"] + 1  # the process's, not more


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def save(self) -> None:
        pass


def _fake(rank: int, device: str, step: int = 9, every: int = 10):
    logger = _Recorder()
    trainer = SimpleNamespace(
        is_global_zero=rank == 0, global_rank=rank, loggers=[logger], log_every_n_steps=every, should_stop=False,
        strategy=SimpleNamespace(root_device=torch.device(device)),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False,
                                                            _batches_that_stepped=step)))
    module = SimpleNamespace(automatic_optimization=True, log=lambda *args, **kwargs: None)
    return trainer, module, logger


def test_nothing_is_read_or_logged_on_a_rank_other_than_0(monkeypatch):
    def no_read():
        raise AssertionError("rank 1 read its memory")

    monkeypatch.setattr(monitor_module, "rss_bytes", no_read)
    trainer, module, logger = _fake(rank=1, device="cpu")
    MemoryMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert logger.rows == []


def test_a_row_only_at_the_cadence_steps():
    monitor = MemoryMonitor()
    for step in range(20):
        trainer, module, logger = _fake(rank=0, device="cpu", step=step)
        monitor.on_train_batch_end(trainer, module, None, None, 0)
        assert [s for s, _ in logger.rows] == ([step] if step in (9, 19) else []), step


def test_on_cuda_the_allocators_figures_are_logged_and_the_peak_is_reset_after_each_row(monkeypatch):
    """No GPU is needed to check the wiring: torch.cuda's counters are stood in for, in bytes."""
    calls = []
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (300 * MiB, 400 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1024 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3072 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 4096 * MiB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    trainer, module, logger = _fake(rank=0, device="cuda:0")
    monitor = MemoryMonitor()
    monitor.on_train_start(trainer, module)
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert logger.rows == [(9, {"memory/rss_mib": 300.0, "memory/peak_rss_mib": 400.0,
                                "memory/cuda_allocated_mib": 1024.0, "memory/cuda_peak_allocated_mib": 3072.0,
                                "memory/cuda_reserved_mib": 4096.0})]
    assert calls == [("reset", torch.device("cuda:0"))] * 2  # at the fit's start, and after the row


def test_without_proc_the_peak_is_logged_and_the_missing_rss_is_said_once(monkeypatch):
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (None, 400 * MiB))
    trainer, module, logger = _fake(rank=0, device="cpu")
    monitor = MemoryMonitor()
    with pytest.warns(UserWarning, match="memory/rss_mib is not logged"):
        monitor.on_train_batch_end(trainer, module, None, None, 0)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert [str(w.message) for w in later] == []  # said once
    assert logger.rows == [(9, {"memory/peak_rss_mib": 400.0})] * 2
