"""What rank 0 raises for a child rank that ended before the ranks connected (``strategies/_rendezvous.py``): it was
SIGKILLed by Lightning's observer of its child ranks, status 137 and no line, whatever the child's status."""

from __future__ import annotations

import signal

import pytest

from lit_dtrain.stops_before_training import StoppedBeforeTraining
from lit_dtrain.strategies._rendezvous import _a_rank_ended
from lit_dtrain.utils.distributed import FirstConnectionError


@pytest.mark.parametrize("status, signum", [(143, signal.SIGTERM), (129, signal.SIGHUP), (-15, signal.SIGTERM)])
def test_a_rank_stopped_by_sigterm_or_sighup_stops_rank_0_with_its_signal(status, signum, caplog):
    raised = _a_rank_ended(1, status)
    assert type(raised) is StoppedBeforeTraining and raised.signum == signum and raised.code == 128 + signum
    assert caplog.messages == [f"rank 1 was stopped by {signum.name} before the ranks connected (exit status "
                               f"{status}): this rank stops with it"]


def test_a_rank_stopped_by_ctrl_c_is_rank_0s_ctrl_c():
    assert type(_a_rank_ended(1, 130)) is KeyboardInterrupt


@pytest.mark.parametrize("status", [1, 0, 137, -9])
def test_a_rank_that_ended_otherwise_is_named_with_its_status(status):
    raised = _a_rank_ended(1, status)
    assert type(raised) is FirstConnectionError
    assert str(raised) == f"rank 0: rank 1 exited with status {status} before the ranks connected (its own output " \
                          "names why)"
