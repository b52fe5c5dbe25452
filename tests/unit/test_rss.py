"""``lit_dtrain.utils.rss``: the process's RSS now and its peak, from ``/proc/self/status`` or ``resource``."""

from __future__ import annotations

import builtins
import resource
import sys
from types import SimpleNamespace

import pytest

from lit_dtrain.utils import rss

MiB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_the_current_and_peak_rss_are_vmrss_and_vmhwm_and_the_peak_resets():
    if not rss.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs cannot be written here")
    current, peak = rss.rss_bytes()
    assert abs(current - _status_kib("VmRSS") * 1024) < 8 * MiB and peak >= current
    block = bytearray(200 * MiB)  # (zero-filled: every page touched)
    _, raised = rss.rss_bytes()
    assert raised - peak >= 190 * MiB
    # (within 2 MiB: another thread of the test process may touch pages between the two reads; 8 KiB in one CI run)
    assert abs(rss.peak_rss_bytes() - _status_kib("VmHWM") * 1024) < 2 * MiB
    del block
    rss.reset_peak_rss()
    assert rss.peak_rss_bytes() < raised - 150 * MiB  # the 200 MiB were returned, and the mark fell with them


@pytest.mark.parametrize("platform, maxrss, expected", [("linux", 1024, MiB), ("darwin", MiB, MiB)])
def test_without_proc_the_peak_is_ru_maxrss_in_its_platforms_unit(monkeypatch, platform, maxrss, expected):
    """Where ``/proc/self/status`` is absent (macOS), the peak is ``ru_maxrss``: KiB on Linux, bytes on macOS, which
    ``peak_rss_bytes`` multiplied by 1024 there too (a 1 GiB peak read 1 TiB)."""
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=maxrss))
    assert rss.rss_bytes() == (None, expected)
    assert rss.peak_rss_bytes() == expected


@pytest.mark.parametrize("mode, num, resets", [("MULTIRUN", 1, True), ("MULTIRUN", 0, False), ("RUN", 0, False)])
def test_a_multiruns_later_job_starts_with_its_own_peak_rss(monkeypatch, mode, num, resets):
    """Hydra's basic launcher runs a sweep's jobs in one process: job 1's 300 MiB peak was job 2's too (VmHWM never
    reset: the policy sweep of activation_checkpointing.md wrote peak_rss_mib 567, 619, 692, 692 MiB). Job 2 on
    now starts from the RSS it has; a single run and a sweep's first job keep the process's peak (``time -v``'s)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not rss.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs cannot be written here")
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    hc = SimpleNamespace(mode=getattr(RunMode, mode), job=SimpleNamespace(num=num))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hc))
    block = bytearray(300 * MiB)  # the earlier job's peak
    del block
    before = rss.peak_rss_bytes()
    assert rss.own_peaks_for_a_multirun_job() is resets
    if resets:
        assert rss.peak_rss_bytes() < before - 250 * MiB
    else:
        assert rss.peak_rss_bytes() >= before
