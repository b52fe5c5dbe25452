"""``MemoryMonitor``: the process's memory under ``memory/``, in MiB, at Lightning's logging cadence.

At the steps Lightning writes ``train/loss`` (``(k + 1) % trainer.log_every_n_steps == 0``, and the last step of a
stopped run), on global rank 0 only (rank 0's own process; no collective, so no other rank's figure; ``train(cfg)``
writes the ranks' highest peak, the final checkpoint and validation included, in ``summary.json``:
:func:`ranks_peak_rss_mib`):

- ``memory/rss_mib``: the resident set size now (``VmRSS`` of ``/proc/self/status``);
- ``memory/peak_rss_mib``: the peak RSS since the process started (``VmHWM``; ``resource``'s ``ru_maxrss`` where
  ``/proc`` is absent, and no ``memory/rss_mib`` there, said once). Not reset in a run (``/usr/bin/time -v`` reports the
  same); in a multirun whose jobs share one process (Hydra's basic launcher) each job after the first starts with it
  reset to the RSS it has (``utils.rss.own_peaks_for_a_multirun_job``), so its figure is its own, not the jobs' highest;
- on CUDA, of the training device, from torch's caching allocator: ``memory/cuda_allocated_mib``
  (``torch.cuda.memory_allocated``, tensors now), ``memory/cuda_reserved_mib`` (``memory_reserved``, what the
  allocator holds from the driver now) and ``memory/cuda_peak_allocated_mib`` (``max_memory_allocated``) over the
  window since the previous row (or since this fit's training started): the peak is reset after each row, as
  torchtitan's memory monitor does, so each point tells that window's peak, a validation's included. That reset is
  process-wide: code of one's own reading ``max_memory_allocated`` across a fit sees the window's peak.

Cost: one read of ``/proc/self/status`` and, on CUDA, four host-side allocator counters per logged row; nothing on
other steps or other ranks, and nothing in the checkpoint (no state: a resume logs on at the same cadence).

Lightning's ``DeviceStatsMonitor`` was checked (lightning 2.6.6) and not used: on CPU it needs psutil and logs
system-wide percentages, not this process's RSS; on CUDA it logs every key of ``torch.cuda.memory_stats`` (dozens)
at both the start and the end of every micro-batch of a logged step and at validation batches under the training
step's number, and its peaks are never reset (since the process started).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, on_log_cadence
from lit_dtrain.utils.distributed import all_gather_stacked
from lit_dtrain.utils.loop import logging_axis_step, mid_accumulation
from lit_dtrain.utils.rss import rss_bytes

MiB = float(1 << 20)


def memory_mib(device: torch.device | None = None) -> dict[str, float]:
    """This process's ``memory/*`` figures in MiB (see the module docstring): the RSS now and its peak, and where
    ``device`` is a CUDA device its allocator's allocated, reserved and peak-allocated bytes. Without
    ``/proc/self/status`` there is no ``memory/rss_mib`` (and without ``resource``, on Windows, no peak either)."""
    current, peak = rss_bytes()
    metrics = {}
    if peak is not None:
        metrics["memory/peak_rss_mib"] = peak / MiB
    if current is not None:
        metrics["memory/rss_mib"] = current / MiB
    if device is not None and device.type == "cuda":
        metrics["memory/cuda_allocated_mib"] = torch.cuda.memory_allocated(device) / MiB
        metrics["memory/cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MiB
        metrics["memory/cuda_reserved_mib"] = torch.cuda.memory_reserved(device) / MiB
    return metrics


def ranks_peak_rss_mib(trainer: L.Trainer) -> float | None:
    """``summary.json``'s ``peak_rss_mib``: the highest peak RSS (``VmHWM``, ``ru_maxrss`` without ``/proc``) of the
    ranks' processes so far, in MiB; None where none can be read. Called by every rank after ``train(cfg)``'s final
    validation, past the ranks' agreement on a signal there (lockstep): one all-gather of one integer where there
    are several ranks (~1.4 ms on 2 busy gloo CPU ranks). The last logged ``memory/peak_rss_mib`` (rank 0's, at the
    last logged step) missed the final checkpoint and validation: 593.0 MiB of a 100-step ``model=nano`` run whose
    process peaked at 651.4 MiB by ``/usr/bin/time -v``."""
    peak = rss_bytes()[1]
    if trainer.world_size > 1:
        mine = torch.tensor(-1 if peak is None else peak, dtype=torch.int64, device=trainer.strategy.root_device)
        peak = int(all_gather_stacked(mine).max())
        peak = None if peak < 0 else peak
    return None if peak is None else peak / MiB


def highest(*peaks: float | None) -> float | None:
    """The highest of ``peaks`` that were read (None where none was)."""
    return max((p for p in peaks if p is not None), default=None)


class MemoryMonitor(L.Callback):
    """Logs the process's RSS and peak RSS, and on CUDA the allocator's allocated, reserved and per-window peak
    memory, in MiB under ``memory/``, on global rank 0 at the trainer's ``log_every_n_steps`` (module docstring).
    It has no arguments and no checkpoint state."""

    def __init__(self) -> None:
        super().__init__()
        self._warned = False

    @staticmethod
    def _cuda_device(trainer: L.Trainer) -> torch.device | None:
        device = trainer.strategy.root_device
        return device if device.type == "cuda" else None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = self._cuda_device(trainer)
        if device is not None and trainer.is_global_zero:  # the first window starts with this fit's training
            torch.cuda.reset_peak_memory_stats(device)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero or mid_accumulation(trainer):
            return
        step = logging_axis_step(trainer)  # the optimizer step just taken (0-based), where train/loss is written
        if not on_log_cadence(log_interval(None, trainer), step, trainer):
            return
        device = self._cuda_device(trainer)
        metrics = memory_mib(device)
        if "memory/rss_mib" not in metrics and not self._warned:
            self._warned = True
            peak = ("memory/peak_rss_mib is resource's ru_maxrss (the peak since the process started)"
                    if "memory/peak_rss_mib" in metrics else "nor is memory/peak_rss_mib (no resource module)")
            rank_zero_warn(f"MemoryMonitor: /proc/self/status cannot be read here: memory/rss_mib is not logged, "
                           f"{peak}")
        # to the loggers only: a figure no monitor or progress bar needs, where self.log costs ~0.8 ms of CPU a name
        log_step_metrics(trainer, pl_module, metrics, step, callback_metrics=False)
        if device is not None:  # the next row's peak is its own window's
            torch.cuda.reset_peak_memory_stats(device)
