"""``comm/time_ms_avg``: the mean collective time over every step so far, the time analogue of
``comm/bytes_per_step_avg``."""

from __future__ import annotations

import pytest

from lit_dtrain.strategies import CommSession, LoopbackCommunicator


class _TimedLoopback(LoopbackCommunicator):
    """A one-rank communicator whose steps took the given milliseconds, in turn."""

    def __init__(self, times_ms: list[float]) -> None:
        super().__init__()
        self.times_ms = list(times_ms)

    def take_step_record(self) -> dict:
        record = super().take_step_record()
        record["time_ms"] = self.times_ms.pop(0)
        return record


def test_time_avg_is_over_every_step_logged_or_not_and_goes_on_across_a_resume():
    """Only ``comm/time_ms``, the last step's time, was logged: with ``log_every_n_steps=10`` nine steps in ten were
    timed, summed into the checkpointed ``total_time_ms`` and never shown (a 2-rank ``topk`` run logging every step
    read 13.8, 34.1, 36.1, 259.7 ms at steps 0-3: one logged sample says little of the mean)."""
    session = CommSession()
    session.comm = _TimedLoopback([10.0, 20.0, 60.0])
    for _ in range(3):
        metrics = session.after_optimizer_step([])
    assert metrics["comm/time_ms"] == 60.0
    assert metrics["comm/time_ms_avg"] == pytest.approx(30.0)

    resumed = CommSession()
    resumed.load_counters_state_dict(session.counters_state_dict())
    resumed.comm = _TimedLoopback([130.0])
    metrics = resumed.after_optimizer_step([])
    assert metrics["comm/time_ms"] == 130.0
    assert metrics["comm/time_ms_avg"] == pytest.approx(55.0)  # (10 + 20 + 60 + 130) / 4
