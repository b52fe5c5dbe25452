"""``lit_dtrain.strategies._communicator.Communicator`` on 2 gloo ranks, its results and its accounting exact
(fourteenth hand mutation audit: the codecs' 2-rank tests check the bytes of all-reduces and all-gathers in a fit, but
no test ran ``all_to_all`` apart from the int8_rs fits, nor read ``time_ms`` against a known clock): a mean, a gather
of rank-dependent values, an all-to-all of unequal pieces, the bytes that leave each rank, the collectives counted,
and in-flight time as the union of each collective's [start, end) on a clock that ticks 1 s a reading."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from lit_dtrain.strategies import Communicator, _communicator
from tests.conftest import leave_rank
from tests.dist._compressed_ddp_helpers import run_rank_processes

pytestmark = pytest.mark.dist


class _TickingClock:
    """``time`` for the communicator: each ``perf_counter()`` reads 1 s later than the one before."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def perf_counter(self) -> float:
        return float(next(self._ticks))


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _communicator.time = _TickingClock()
    comm, res = Communicator(), {}
    res["mean"] = comm.all_reduce_mean_async(torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)).wait()
    res["gathered"] = comm.all_gather_async(torch.tensor([rank, 10 + rank], dtype=torch.float64)).wait()
    res["first"] = comm.take_step_record()
    # piece 0 (1 element) goes to rank 0, piece 1 (3 elements) to rank 1, on every rank
    res["a2a"] = comm.all_to_all(torch.arange(4.0) + 10 * rank, [1, 3])
    res["second"] = comm.take_step_record()
    res["third"] = comm.take_step_record()
    torch.save(res, f"{out}/rank{rank}.pt")
    leave_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("communicator")
    run_rank_processes(_worker, str(out), timeout=120, world=2)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_a_mean_and_a_gather_hold_every_ranks_values(ranks):
    for res in ranks:
        assert torch.equal(res["mean"], torch.tensor([1.5, 3.0, 4.5]))  # (x + 2x) / 2
        assert torch.equal(res["gathered"], torch.tensor([[0.0, 10.0], [1.0, 11.0]], dtype=torch.float64))


def test_an_all_to_all_gives_each_rank_its_pieces_in_rank_order(ranks):
    assert torch.equal(ranks[0]["a2a"], torch.tensor([0.0, 10.0]))
    assert torch.equal(ranks[1]["a2a"], torch.tensor([1.0, 2.0, 3.0, 11.0, 12.0, 13.0]))


def test_the_bytes_collectives_and_time_of_a_step_are_exact_and_reset(ranks):
    """12 bytes of fp32 all-reduced, 16 of fp64 gathered; an all-to-all counts only the pieces that leave the rank
    (rank 0 keeps 1 of 4 elements: 12 bytes; rank 1 keeps 3: 4). Each collective reads the clock at its start and
    end, 1 s apart, and the readings of two collectives do not overlap: 2000 ms, then 1000 ms."""
    for rank, res in enumerate(ranks):
        first, second, third = res["first"], res["second"], res["third"]
        assert (first["bytes"], first["collectives"], first["time_ms"]) == (28, 2, 2000.0)
        assert first["sent_log"] == [("all_reduce", 12), ("all_gather", 16)]
        a2a_bytes = [12, 4][rank]
        assert (second["bytes"], second["collectives"], second["time_ms"]) == (a2a_bytes, 1, 1000.0)
        assert second["sent_log"] == [("all_to_all", a2a_bytes)]
        assert (third["bytes"], third["collectives"], third["time_ms"], third["sent_log"]) == (0, 0, 0.0, [])
