"""How a :class:`FourierSampler` update travels to every rank's table.

A micro-step's update is one uint8 record per sample (:func:`_pack`: int64 index | fp32 score | fp16 band profile,
``12 + 2F`` bytes). Every rank all-gathers the records of every other rank (:func:`gather_update`, optionally with
``async_op=True``: the gather is waited on before the next draw), so every rank applies the same updates to the
same table. An :class:`_Update` carries one step's records from the gather to the table: with ``lag=1`` it also
copies them (and the rank's logging stats) from a GPU to pinned host memory without waiting, so that the sampler
reads them only at the next step's ``observe``. The one synchronous collective is :func:`all_reduce_sum` (the
global band energy, needed before a step can be scored).

:class:`UpdateQueue` holds the updates not applied yet and applies them, identically on every rank, when the
sampler's ``lag`` says: before the next draw (``lag=0``) or at the next step's ``observe`` (``lag=1``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_dtrain.errors import ConfigError


def world_and_rank(group=None) -> tuple[int, int]:
    """World size and rank in ``group`` (None: the default group); ``(1, 0)`` without ``torch.distributed``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def comm_device(group, default: torch.device) -> torch.device:
    """The device the collectives of ``group`` take: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if default.type != "cpu" else default


def all_reduce_sum(tensor: torch.Tensor, group=None) -> tuple[torch.Tensor, int]:
    """Sum ``tensor`` over the ranks of ``group``, synchronously, on :func:`comm_device`; returns the sum (on that
    device) and the bytes handed to the collective."""
    tensor = tensor.to(comm_device(group, tensor.device))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor, tensor.numel() * tensor.element_size()


def gather_update(
    step: int, record: torch.Tensor, stats: torch.Tensor | None, world: int, group=None, overlap: bool = False
) -> tuple[_Update, int]:
    """All-gather this rank's ``record`` of ``step`` from the ``world`` ranks of ``group`` into an :class:`_Update`
    (with ``overlap``, asynchronously: the update waits for the gather when its records are read); returns it and
    the bytes handed to the collective."""
    record = record.to(comm_device(group, record.device))
    gathered = [torch.empty_like(record) for _ in range(world)]
    handle = dist.all_gather(gathered, record, group=group, async_op=overlap)
    update = _Update(step, parts=gathered, handle=handle if overlap else None, stats=stats)
    return update, record.numel() * record.element_size()


class _Update:
    """One observed update on its way to the table: the packed records (one part per rank once gathered), the
    handle of an asynchronous gather, this rank's logging stats (``lag=1``: ``[top_band_energy]``, None when restored
    from a checkpoint), and, on a GPU under ``lag=1``, host copies of those being made without waiting."""

    def __init__(self, step: int, parts: list[torch.Tensor], handle=None, stats: torch.Tensor | None = None) -> None:
        self.step, self.parts, self.handle, self.stats = step, parts, handle, stats
        self.event = None
        self._sources: list[torch.Tensor] = []  # the device tensors being copied, kept alive until the copies land

    def to_host_async(self) -> None:
        """Start copying the records and stats that are on a GPU to pinned host memory; :meth:`records` waits for
        the copies. Records not on a GPU (CPU, a gloo gather) are left as they are."""
        if self.parts[0].is_cuda:
            if self.handle is not None:  # an NCCL gather: its wait() only orders the current stream after it
                self.handle.wait()
                self.handle = None
            self.parts = [self._copy_to_host(torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0])]
        if self.stats is not None and self.stats.is_cuda:
            self.stats = self._copy_to_host(self.stats)
        if self._sources:
            self.event = torch.cuda.Event()
            # the copies' stream, not the current device's
            self.event.record(torch.cuda.current_stream(self._sources[0].device))

    def _copy_to_host(self, device: torch.Tensor) -> torch.Tensor:
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        self._sources.append(device)
        return host

    def records(self) -> torch.Tensor:
        """The update's records on the host (waits for the gather or the copies if they are still running); the
        stats are on the host after it too."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.event is not None:
            self.event.synchronize()
            self.event, self._sources = None, []
        if len(self.parts) > 1 or self.parts[0].device.type != "cpu":
            self.parts = [torch.cat([part.cpu() for part in self.parts])]
        return self.parts[0]


class UpdateQueue:
    """The observed updates on their way to the table, oldest first, and when they are applied (a mixin of
    :class:`.fourier.FourierSampler`, which provides ``lag``, ``fine_bands``, ``num_samples`` and ``_apply``, the
    table update of one step's records).

    ``lag=0``: :meth:`flush` (before a draw, at the next ``observe``, or at once where there is nothing to overlap
    with) waits for the pending gathers and applies them. ``lag=1``: a step's update waits for the next step's
    ``observe`` (or :meth:`step_not_observed`), so the draw of step ``s`` sees the table through step ``s - 2``."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[_Update] = []  # observed updates not yet applied to the table, oldest first
        self._landed: dict | None = None  # lag=1: the logging stats of the last applied update (see landed_stats)

    def flush(self) -> None:
        """Wait for the pending gathered updates (if any) and apply them to the table, identically on every rank.

        With ``lag=1`` this does nothing: a step's update waits for the next step's :meth:`observe`."""
        if not self.lag:
            self._apply_pending()

    def step_not_observed(self, step: int) -> None:
        """Optimizer step ``step`` ends without an :meth:`observe` (``LossSpikeMonitor`` dropped it, or the module
        skipped its batches). With ``lag=1`` the earlier steps' updates are applied now, as its ``observe`` would have
        applied them, so the draw of step ``step + 1`` still sees the table through step ``step - 1``."""
        if self.lag:
            self._apply_pending(keep=step)

    def _apply_pending(self, keep: int | None = None) -> None:
        """Apply the pending updates, oldest first, up to the first one of step ``keep`` (the step being observed,
        whose earlier micro-batches wait for the next step; None: all). Not ``step < keep``: a new fit on the same
        sampler counts from 0 again, and its updates queued behind the last one of the earlier fit."""
        while self._pending and self._pending[0].step != keep:
            update = self._pending.pop(0)
            index, score, profile = _unpack(update.records(), self.fine_bands)
            self._apply(index, score, profile, update.step)
            if update.stats is not None:  # on the host now (records() waited for the copy)
                self._landed = _add_stat(self._landed if self._landed and self._landed["step"] == update.step
                                         else {"step": update.step, "sum": 0.0, "count": 0}, update.stats)

    def landed_stats(self, step: int, wait: bool = False) -> dict | None:
        """``lag=1``: this rank's ``top_band_energy`` of ``step`` (the mean over the micro-batches it observed at that
        step, as the callback logs it under ``lag=0``), read on the host,
        as ``{"step", "top_band_energy"}``, once that step's update has been applied (at the next step's
        :meth:`observe` or :meth:`step_not_observed`), so reading it never waits for the device. With ``wait``, a
        step whose update is still pending is read from it (this waits for its copy: for the end of training).
        None when the value is not known (lag 0, another step, or an update restored from a checkpoint)."""
        landed = self._landed if self._landed is not None and self._landed["step"] == step else None
        if wait:  # (a step's micro-batches are applied together, so they are all landed or all pending)
            for update in self._pending:
                if update.step == step and update.stats is not None:
                    update.records()  # waits for the copy of the records and of the stats
                    landed = _add_stat(landed or {"step": step, "sum": 0.0, "count": 0}, update.stats)
        if landed is None:
            return None
        return {"step": step, "top_band_energy": landed["sum"] / landed["count"]}

    def _restore_pending(self, step: int, records: torch.Tensor) -> None:
        """Take back an update saved before it was applied (``lag=1``); under ``lag=0`` it is applied at once."""
        width = 12 + 2 * self.fine_bands
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != width or not self.fine_bands:
            raise ValueError(
                f"FourierSampler state 'pending_records' of step {step}: expected uint8 records [n, {width}] for "
                f"{self.fine_bands} bands, got {records.dtype} {tuple(records.shape)} (a damaged checkpoint?)"
            )
        index = _unpack(records, self.fine_bands)[0]
        if len(index) and not bool(((index >= 0) & (index < self.num_samples)).all()):
            raise ConfigError(
                f"FourierSampler state 'pending_records' of step {step} names samples outside [0, {self.num_samples})"
                ": the checkpoint belongs to another corpus or block_size"
            )
        self._pending.append(_Update(step, parts=[records.clone()]))
        self.flush()  # lag=0 applies it now; lag=1 at the next observe, as the run that saved it would have


def _add_stat(landed: dict, stats: torch.Tensor) -> dict:
    """``landed`` (``{"step", "sum", "count"}``) with one more micro-batch's ``top_band_energy`` (on the host)."""
    return {"step": landed["step"], "sum": landed["sum"] + float(stats), "count": landed["count"] + 1}


def _pack(index: torch.Tensor, score: torch.Tensor, profile: torch.Tensor) -> torch.Tensor:
    """One uint8 record per sample: int64 index | fp32 score | fp16 band profile (12 + 2F bytes)."""
    B = index.numel()
    parts = [
        index.contiguous().view(torch.uint8).reshape(B, 8),
        score.float().contiguous().view(torch.uint8).reshape(B, 4),
        profile.half().contiguous().view(torch.uint8).reshape(B, -1),
    ]
    return torch.cat(parts, dim=1)


def _unpack(records: torch.Tensor, fine_bands: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def field(start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return records[:, start:stop].reshape(-1).clone().view(dtype)  # fresh 1-D storage: aligned for view

    index, score = field(0, 8, torch.int64), field(8, 12, torch.float32)
    return index, score, field(12, records.shape[1], torch.float16).reshape(-1, fine_bands)
