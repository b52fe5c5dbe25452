"""Exact results of ``lit_dtrain.callbacks.memory_monitor`` where single-point mutants passed test_memory_monitor.py
and test_mutants10_new_memory.py (thirteenth hand mutation audit): ``ranks_peak_rss_mib`` (the summary's figure,
before only in a slow 2-rank e2e test) is the highest of the ranks' peaks (not the current RSS), in int64 (a peak
past 2 GiB), None only where no rank read one; ``highest`` of the figures read; ``memory_mib`` of a CPU device reads
no CUDA counter; rank 1 resets no CUDA peak; a stop's step gets a row off the cadence; and the one-time warning
names where the peak comes from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_dtrain.callbacks import MemoryMonitor
from lit_dtrain.callbacks import memory_monitor as monitor_module
from lit_dtrain.callbacks.memory_monitor import highest, memory_mib, ranks_peak_rss_mib
from tests.unit.test_memory_monitor import _fake

MiB = 1 << 20
GiB = 1 << 30


def _two_ranks(monkeypatch, mine: tuple[int | None, int | None], other_peak: int) -> SimpleNamespace:
    """A 2-rank trainer whose rank reads ``mine`` (current, peak) and whose other rank's gathered entry is
    ``other_peak`` (-1: none read), stacked in rank order as ``all_gather_stacked`` does."""
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: mine)

    def gather(tensor):
        assert tensor.dtype == torch.int64  # bytes: a peak past 2 GiB does not fit int32
        return torch.stack([tensor, torch.tensor(other_peak, dtype=tensor.dtype)])

    monkeypatch.setattr(monitor_module, "all_gather_stacked", gather)
    return SimpleNamespace(world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu")))


@pytest.mark.parametrize(("mine", "other", "expected"), [
    ((300 * MiB, 700 * MiB), 500 * MiB, 700.0),  # this rank's peak, not its current RSS (300)
    ((300 * MiB, 400 * MiB), 900 * MiB, 900.0),  # the other rank's, higher: the highest, not the lowest
    ((100 * MiB, 3 * GiB), 1 * GiB, 3072.0),  # past int32's 2 GiB
    ((None, 400 * MiB), -1, 400.0),  # the other rank read none: this one's
    ((None, None), 600 * MiB, 600.0),  # this rank read none: the other's
    ((None, None), -1, None),  # no rank read one: None, not 0 MiB
])
def test_the_summarys_peak_is_the_highest_peak_any_rank_read(monkeypatch, mine, other, expected):
    assert ranks_peak_rss_mib(_two_ranks(monkeypatch, mine, other)) == expected


def test_one_process_reads_its_own_peak_without_a_gather(monkeypatch):
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (300 * MiB, 700 * MiB))
    monkeypatch.setattr(monitor_module, "all_gather_stacked", lambda t: pytest.fail("one process gathered"))
    trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert ranks_peak_rss_mib(trainer) == 700.0


@pytest.mark.parametrize(("peaks", "expected"), [
    ((None, 512.0), 512.0), ((700.0, 512.0), 700.0), ((512.0, 700.0, None), 700.0), ((None, None), None), ((), None),
])
def test_highest_is_the_largest_figure_read_and_none_where_none_was(peaks, expected):
    assert highest(*peaks) == expected


def test_a_cpu_device_reads_no_cuda_counter(monkeypatch):
    """``memory_mib(device)`` of a CPU device (its public signature takes any device) has the RSS figures only."""
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (300 * MiB, 400 * MiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: pytest.fail("a CUDA counter was read"))
    assert memory_mib(torch.device("cpu")) == {"memory/rss_mib": 300.0, "memory/peak_rss_mib": 400.0}


def test_rank_1_resets_no_cuda_peak_at_the_fits_start(monkeypatch):
    """Only rank 0 logs, so only rank 0's window starts at the fit's training: another rank's process-wide peak (which
    code of one's own may read) is left alone."""
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(device))
    trainer, module, _ = _fake(rank=1, device="cuda:1")
    MemoryMonitor().on_train_start(trainer, module)
    assert calls == []
    trainer, module, _ = _fake(rank=0, device="cuda:0")
    MemoryMonitor().on_train_start(trainer, module)
    assert calls == [torch.device("cuda:0")]


def test_the_step_a_stopped_fit_ends_at_gets_a_row_off_the_cadence(monkeypatch):
    """Lightning writes ``train/loss`` at the last step of a stopped run too (its ``should_update_logs``): so does
    the monitor, at step 4 of a cadence of 10."""
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (300 * MiB, 400 * MiB))
    trainer, module, logger = _fake(rank=0, device="cpu", step=4)
    MemoryMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert logger.rows == []
    trainer.should_stop = True
    MemoryMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert logger.rows == [(4, {"memory/rss_mib": 300.0, "memory/peak_rss_mib": 400.0})]


@pytest.mark.parametrize(("peak", "said"), [
    (400 * MiB, "memory/peak_rss_mib is resource's ru_maxrss"), (None, "nor is memory/peak_rss_mib"),
])
def test_the_warning_without_proc_says_where_the_peak_comes_from(monkeypatch, peak, said):
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (None, peak))
    trainer, module, _ = _fake(rank=0, device="cpu")
    with pytest.warns(UserWarning) as record:
        MemoryMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert [said in str(w.message) for w in record] == [True]
