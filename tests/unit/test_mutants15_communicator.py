"""``lit_dtrain.strategies._communicator`` where the fifteenth hand mutation audit's mutants passed its tests: on a
torch with ``dist.all_gather_single`` (2.13) the gather calls it, not the name 2.13 deprecates (the fallback to
``all_gather_into_tensor`` on older torch: test_compressors_resume.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lit_dtrain.strategies import _communicator


def test_all_gather_calls_all_gather_single_where_torch_has_it(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather_single", lambda out, t, group=None, async_op=False:
                        calls.append((out, t, group, async_op)) or "work", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: "deprecated")
    out, t = torch.empty(4), torch.ones(2)
    assert _communicator._all_gather_single(out, t, group="g", async_op=True) == "work"
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is t and calls[0][2:] == ("g", True)


class _Work:
    def __init__(self, future: torch.futures.Future) -> None:
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future


class _TwoRanks(_communicator.Communicator):
    world_size = 2


def test_a_failed_gather_raises_its_error_rather_than_returning_the_unwritten_buffer(monkeypatch):
    """A gather whose work failed (a dead or hung peer): its error, not ``torch.empty``'s garbage as every rank's."""
    failed = torch.futures.Future()
    failed.set_exception(RuntimeError("Connection closed by peer"))
    monkeypatch.setattr(_communicator, "_all_gather_single", lambda out, t, group=None, async_op=False: _Work(failed))
    comm = _TwoRanks()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        comm.all_gather_async(torch.ones(3)).wait()
    done = torch.futures.Future()
    done.set_result([torch.empty(6)])
    monkeypatch.setattr(_communicator, "_all_gather_single",
                        lambda out, t, group=None, async_op=False: (out.copy_(torch.arange(6.0)), _Work(done))[1])
    assert torch.equal(comm.all_gather_async(torch.ones(3)).wait(), torch.arange(6.0).view(2, 3))
    assert comm.take_step_record()["sent_log"] == [("all_gather", 12), ("all_gather", 12)]


def test_the_time_of_a_step_counts_overlapping_collectives_once():
    """Two async collectives in flight over [0, 2) and [1, 3) s: 3000 ms of communication, not their sum 4000."""
    comm = _communicator.LoopbackCommunicator()
    comm.intervals = [(1.0, 3.0), (0.0, 2.0)]
    assert comm.take_step_record()["time_ms"] == 3000.0
