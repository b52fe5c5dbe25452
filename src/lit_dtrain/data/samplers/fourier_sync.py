"""How a :class:`FourierSampler` update travels to every rank's table.

A micro-step's update is one uint8 record per sample (:func:`_pack`: int64 index | fp32 score | fp16 band profile,
``12 + 2F`` bytes). Every rank all-gathers the records of every other rank (:func:`gather_update`, optionally with
``async_op=True``: the gather is waited on before the next draw), so every rank applies the same updates to the
same table. An :class:`_Update` carries one step's records from the gather to the table: with ``lag=1`` it also
copies them (and the rank's logging stats) from a GPU to pinned host memory without waiting, so that the sampler
reads them only at the next step's ``observe``. The one synchronous collective is :func:`all_reduce_sum` (the
global band energy, needed before a step can be scored).

Which updates are applied when (``lag``, ``flush``) is the sampler's: see :mod:`.fourier`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
