"""Exact results of ``MemoryMonitor`` and ``lit_dtrain.utils.rss`` where single-point mutants passed
test_memory_monitor.py and test_rss.py (tenth hand mutation audit): a ``/proc/self/status`` that gives ``VmRSS`` but no
``VmHWM`` still has a peak (``ru_maxrss``), a micro-batch that is not its step's last writes no row, and the figures
go to the loggers alone (not ``self.log``, ~0.8 ms of CPU a name, into ``trainer.callback_metrics``)."""

from __future__ import annotations

import builtins
import io
import resource
import sys
from types import SimpleNamespace

import torch

from lit_dtrain.callbacks import MemoryMonitor
from lit_dtrain.callbacks import memory_monitor as monitor_module
from lit_dtrain.utils import rss
from tests.unit.test_memory_monitor import _Recorder

MiB = 1 << 20


def test_a_status_without_vmhwm_still_gives_the_peak_from_ru_maxrss(monkeypatch):
    """A kernel or sandbox whose status has VmRSS but no VmHWM (gVisor lists fewer fields): the peak is resource's."""
    real_open = builtins.open

    def status_without_vmhwm(path, *args, **kwargs):
        if str(path) == "/proc/self/status":
            return io.StringIO("Name:\tpython\nVmPeak:\t 9000 kB\nVmRSS:\t   2048 kB\nThreads:\t1\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", status_without_vmhwm)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=4096))
    assert rss.rss_bytes() == (2 * MiB, 4 * MiB)  # (VmPeak is virtual memory, not the RSS's peak)


def _fake(step: int = 9, accumulating: bool = False):
    logger, logged = _Recorder(), []
    trainer = SimpleNamespace(
        is_global_zero=True, global_rank=0, loggers=[logger], log_every_n_steps=10, should_stop=False,
        global_step=step + 1, strategy=SimpleNamespace(root_device=torch.device("cpu")),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: accumulating,
                                                            _batches_that_stepped=step)))
    module = SimpleNamespace(automatic_optimization=True, log=lambda name, *a, **k: logged.append(name))
    return trainer, module, logger, logged


def test_a_micro_batch_that_is_not_its_steps_last_writes_no_row(monkeypatch):
    """With accumulate_grad_batches=4 each logged step's four micro-batches end at the same step: one row, its last."""
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (300 * MiB, 400 * MiB))
    monitor = MemoryMonitor()
    rows = []
    for accumulating in (True, True, True, False):
        trainer, module, logger, _ = _fake(step=9, accumulating=accumulating)
        monitor.on_train_batch_end(trainer, module, None, None, 0)
        rows += logger.rows
    assert rows == [(9, {"memory/peak_rss_mib": 400.0, "memory/rss_mib": 300.0})]


def test_the_figures_go_to_the_loggers_alone_under_the_step_just_taken(monkeypatch):
    """Not through self.log (the callback's cost: 217 us a step against 60 us), so not in callback_metrics; the row's
    step is Lightning's logging axis (the step just taken), not global_step (already counting it)."""
    monkeypatch.setattr(monitor_module, "rss_bytes", lambda: (300 * MiB, 400 * MiB))
    trainer, module, logger, logged = _fake(step=19)
    MemoryMonitor().on_train_batch_end(trainer, module, None, None, 0)
    assert logged == []
    assert logger.rows == [(19, {"memory/peak_rss_mib": 400.0, "memory/rss_mib": 300.0})]
