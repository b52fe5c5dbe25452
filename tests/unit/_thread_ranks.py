"""Ranks as threads of one process, for codecs whose reduce needs several ranks' collectives (all_to_all,
all_gather) without spawning gloo processes: each rank's :class:`ThreadRankComm` swaps tensors with the others
through a barrier, in rank order, and still counts its bytes as :class:`LoopbackCommunicator` does."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from lit_dtrain.strategies import LoopbackCommunicator
from lit_dtrain.strategies.compressors import completed_future


class _Exchange:
    def __init__(self, world: int) -> None:
        self.world, self.barrier, self.slots = world, threading.Barrier(world, timeout=60), [None] * world

    def swap(self, rank: int, item):
        """Every rank's ``item``, in rank order (each rank calls it once per collective, in the same order)."""
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()  # nobody writes the next collective's item before all have read this one's
        return items


class ThreadRankComm(LoopbackCommunicator):
    """Rank ``rank`` of the threads sharing ``exchange``."""

    def __init__(self, exchange: _Exchange, rank: int) -> None:
        super().__init__()
        self.exchange, self._rank = exchange, rank

    @property
    def world_size(self) -> int:
        return self.exchange.world

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce_sum_async(self, tensor):
        self._finish(self._record("all_reduce", tensor))
        tensor.copy_(torch.stack(self.exchange.swap(self._rank, tensor.clone())).sum(0))
        return completed_future(tensor)

    def all_gather_async(self, tensor):
        self._finish(self._record("all_gather", tensor))
        return completed_future(torch.stack(self.exchange.swap(self._rank, tensor.clone())))

    def all_to_all(self, tensor, send_sizes: Sequence[int]):
        self._finish(self._record("all_to_all", tensor, exclude=send_sizes[self._rank]))
        pieces = self.exchange.swap(self._rank, list(tensor.clone().split(list(send_sizes))))
        return torch.cat([pieces[r][self._rank] for r in range(self.world_size)])


def run_ranks(world: int, fn: Callable[[ThreadRankComm], object]) -> list:
    """``fn(comm)`` on ``world`` thread ranks at once; their results in rank order (a rank's error is raised)."""
    exchange, results, errors = _Exchange(world), [None] * world, []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadRankComm(exchange, rank))
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
