"""``LoopbackCommunicator`` (one rank, no ``torch.distributed``) exact, from the fourteenth hand mutation audit of
``strategies/_communicator.py``: its collectives are identities of the shapes the real ones return, every
collective is counted with the bytes that would leave the rank (an all-to-all's all stay) and its time read on the
communicator's clock. The 2-rank ``Communicator``: tests/dist/test_mutants14_communicator.py."""

from __future__ import annotations

import torch

from lit_dtrain.strategies import LoopbackCommunicator, _communicator
from tests.dist.test_mutants14_communicator import _TickingClock


def test_the_loopback_collectives_are_identities_counted_and_timed(monkeypatch):
    monkeypatch.setattr(_communicator, "time", _TickingClock())
    comm = LoopbackCommunicator()
    x = torch.tensor([1.0, 2.0, 3.0])
    assert comm.all_reduce_sum_async(x).wait() is x
    gathered = comm.all_gather_async(torch.tensor([4.0, 5.0], dtype=torch.float64)).wait()
    assert gathered.shape == (1, 2) and torch.equal(gathered[0], torch.tensor([4.0, 5.0], dtype=torch.float64))
    assert torch.equal(comm.all_to_all(torch.arange(4.0), [4]), torch.arange(4.0))
    record = comm.take_step_record()
    assert (record["bytes"], record["collectives"], record["time_ms"]) == (12 + 16, 3, 3000.0)
    assert record["sent_log"] == [("all_reduce", 12), ("all_gather", 16), ("all_to_all", 0)]
    assert comm.take_step_record() == {"bytes": 0, "collectives": 0, "time_ms": 0.0, "sent_log": []}
