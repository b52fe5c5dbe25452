"""The accounted collectives of :mod:`lit_dtrain.strategies.comm` (:class:`Communicator`, the only place that calls
``torch.distributed``, and the one-rank :class:`LoopbackCommunicator`); moved out of it, which still exports them."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lit_dtrain.strategies.compressors import completed_future


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _all_gather_single(output: Tensor, tensor: Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_single``, new in torch 2.13 (the new name of ``all_gather_into_tensor``, deprecated there);
    older torch has only the old name. Looked up at each call, so a test's replacement of either is seen."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


class Communicator:
    """Collectives on a process group (default: WORLD) with exact byte and time accounting.

    ``bytes_sent`` and ``intervals`` accumulate until :meth:`take_step_record` returns and resets them.
    Async collectives record their end time in a future callback; on CUDA that is when the work
    completed on the device stream, so ``time_ms`` is approximate there.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.num_collectives = 0
        self.intervals: list[tuple[float, float]] = []
        self.sent_log: list[tuple[str, int]] = []  # (op, bytes) of the current step, for tests

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def _record(self, op: str, tensor: Tensor, exclude: int = 0) -> float:
        nbytes = (tensor.numel() - exclude) * tensor.element_size()  # exclude: elements that stay on this rank
        with self._lock:
            self.bytes_sent += nbytes
            self.num_collectives += 1
            self.sent_log.append((op, nbytes))
        return time.perf_counter()

    def _finish(self, start: float) -> None:
        end = time.perf_counter()
        with self._lock:
            self.intervals.append((start, end))

    def all_reduce_sum_async(self, tensor: Tensor) -> torch.futures.Future:
        """Sum ``tensor`` over ranks in place; the future holds it."""
        start = self._record("all_reduce", tensor)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)

        def done(fut: torch.futures.Future) -> Tensor:
            self._finish(start)
            return fut.value()[0]

        return work.get_future().then(done)

    def all_reduce_mean_async(self, tensor: Tensor) -> torch.futures.Future:
        """Average ``tensor`` over ranks in place (uncompressed, fp32 or whatever its dtype is)."""
        world = self.world_size
        return self.all_reduce_sum_async(tensor).then(lambda fut: fut.value().div_(world))

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Blocking :meth:`all_reduce_sum_async`."""
        return self.all_reduce_sum_async(tensor).wait()

    def all_gather_async(self, tensor: Tensor) -> torch.futures.Future:
        """Gather every rank's 1-D ``tensor`` (same size everywhere); the future holds a (world, numel) tensor."""
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        start = self._record("all_gather", tensor)
        work = _all_gather_single(out, tensor, group=self.group, async_op=True)

        def done(fut: torch.futures.Future) -> Tensor:
            self._finish(start)
            fut.value()  # raises a failed gather's error (a dead or hung peer); else ``out`` would be read unwritten
            return out.view(self.world_size, -1)

        return work.get_future().then(done)

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int]) -> Tensor:
        """Blocking all-to-all of a 1-D ``tensor`` cut into ``send_sizes`` pieces, piece ``r`` going to rank ``r``.

        Every rank sends this rank the same number of elements, ``send_sizes[rank]`` (the caller's layout is the same
        on every rank); the result holds them in rank order. Counted: the pieces that leave this rank.
        """
        rank, world = self.rank, self.world_size
        own = send_sizes[rank]
        out = torch.empty(world * own, dtype=tensor.dtype, device=tensor.device)
        start = self._record("all_to_all", tensor, exclude=own)
        dist.all_to_all_single(out, tensor, output_split_sizes=[own] * world, input_split_sizes=list(send_sizes),
                               group=self.group)
        self._finish(start)
        return out

    def take_step_record(self) -> dict:
        """Bytes, collectives and in-flight milliseconds since the last call; resets them."""
        with self._lock:
            record = {
                "bytes": self.bytes_sent,
                "collectives": self.num_collectives,
                "time_ms": 1000.0 * _union_seconds(self.intervals),
                "sent_log": list(self.sent_log),
            }
            self.bytes_sent, self.num_collectives = 0, 0
            self.intervals, self.sent_log = [], []
        return record


class LoopbackCommunicator(Communicator):
    """A one-rank communicator without ``torch.distributed``: collectives are identities, bytes still count."""

    def __init__(self) -> None:
        super().__init__(group=None)

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def all_reduce_sum_async(self, tensor: Tensor) -> torch.futures.Future:
        self._finish(self._record("all_reduce", tensor))
        return completed_future(tensor)

    def all_gather_async(self, tensor: Tensor) -> torch.futures.Future:
        self._finish(self._record("all_gather", tensor))
        return completed_future(tensor.view(1, -1))

    def all_to_all(self, tensor: Tensor, send_sizes: Sequence[int]) -> Tensor:
        self._finish(self._record("all_to_all", tensor, exclude=tensor.numel()))
        return tensor
