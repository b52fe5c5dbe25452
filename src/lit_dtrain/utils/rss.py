"""The resident set size (RSS) of this process: now and its peak, and a reset of the peak.

Linux reports both in ``/proc/self/status`` (``VmRSS``, ``VmHWM``) and resets the peak through
``/proc/self/clear_refs``; elsewhere only ``resource``'s ``ru_maxrss``, the peak since start, is read. psutil, which
Lightning's ``DeviceStatsMonitor`` needs on CPU, is no dependency, and gives no peak on Linux (its ``memory_info()``
reads ``/proc/<pid>/statm``: rss, vms, shared, text, lib, data, dirty; giampaolo/psutil#1540). No torch import here:
the callback that logs these in every run reads them through this module.
"""

from __future__ import annotations

import ctypes
import gc
import sys


def rss_bytes() -> tuple[int | None, int | None]:
    """``(current, peak)`` resident set size of this process in bytes: Linux ``VmRSS`` and ``VmHWM`` (the peak since
    start or the last :func:`reset_peak_rss`) from one read of ``/proc/self/status``. Where that file is absent
    (macOS) the current RSS is None and the peak is ``resource``'s ``ru_maxrss`` (since start); without ``resource``
    either (Windows) both are None."""
    current = peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    current = int(line.split()[1]) * 1024
                    break  # (VmRSS follows VmHWM: the rest of the file is not read)
    except OSError:
        pass
    if peak is None:
        try:
            import resource  # (POSIX only)
        except ImportError:
            return current, None
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # bytes on macOS, KiB on Linux and the BSDs (getrusage(2) of each): macOS read 1024 times too high
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    return current, peak


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process since start or the last :func:`reset_peak_rss` (None on Windows)."""
    return rss_bytes()[1]


def reset_peak_rss() -> bool:
    """Return freed heap to the OS and reset the peak-RSS mark; False where the OS cannot."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def own_peaks_for_a_multirun_job() -> bool:
    """At the start of a Hydra multirun's job after the first, in the process of the earlier jobs (the basic
    launcher's): collect their garbage, give their freed heap back and reset the peak RSS (:func:`reset_peak_rss`),
    and on CUDA empty the allocator's cache and reset its peak statistics, so the job's ``memory/*`` figures and
    ``summary.json``'s ``peak_rss_mib`` are its own, not the highest of the jobs so far. Returns whether the RSS peak
    was reset (False: not such a job, or no writable ``/proc/self/clear_refs``, as on macOS). Never in a single run
    or a sweep's first job, whose peak stays the process's, what ``/usr/bin/time -v`` reports."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or hc.job.num == 0:
        return False
    gc.collect()
    torch = sys.modules.get("torch")  # (not imported here: a job before this one has imported it)
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return reset_peak_rss()
