"""Exact results of ``FirstConnection.setup_environment`` (lit_dtrain.strategies._connect) where single-point mutants
passed test_strategy_first_connection.py (its 2-rank runs are e2e tests, too slow to audit by): the bound the
connection waits, the collective bound put back after it, and which failures become a one-line
``FirstConnectionError`` (with the waiting child rank killed) and which are raised as they are."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import torch.distributed as dist

from lit_dtrain.strategies._connect import FirstConnection
from lit_dtrain.utils.distributed import FirstConnectionError
from tests.conftest import free_port


class _Launcher:
    def __init__(self) -> None:
        self.signals: list[int] = []

    def kill(self, signum: int) -> None:
        self.signals.append(signum)


class _Lightning:
    """Stands in for Lightning's strategy: records the bound its setup_environment was given, then fails or not."""

    def __init__(self, collective_s: float | None, error: Exception | None = None, connect: bool = False) -> None:
        self._timeout = None if collective_s is None else timedelta(seconds=collective_s)
        self.error, self.connect, self.seen = error, connect, None
        self.global_rank, self.world_size, self.launcher = 0, 2, _Launcher()

    def setup_environment(self) -> None:
        self.seen = self._timeout
        if self.connect:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        if self.error is not None:
            raise self.error


class _Strategy(FirstConnection, _Lightning):
    pass


@pytest.mark.parametrize("collective_s, connect_s, waited_s", [(3, 1800, 1800), (2400, 1800, 2400), (None, 60, 60)])
def test_the_connection_waits_the_longer_bound_and_the_collectives_get_theirs_after(collective_s, connect_s, waited_s):
    strategy = _Strategy(collective_s)
    strategy._connect_timeout = timedelta(seconds=connect_s)
    strategy.setup_environment()
    assert strategy.seen == timedelta(seconds=waited_s)
    assert strategy._timeout == (None if collective_s is None else timedelta(seconds=collective_s))


@pytest.mark.parametrize("text, said", [
    ("Timed out after 4 seconds waiting for clients. 1/2 clients joined.", "only 1 of 2 ranks connected within 1800 s"),
    ("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1", "the 2 ranks did not all connect within 1800 s"),
])
def test_a_first_connection_that_times_out_is_one_line_and_kills_the_waiting_child(text, said):
    strategy = _Strategy(3, RuntimeError(text))
    with pytest.raises(FirstConnectionError, match=f"^rank 0: {said} "):
        strategy.setup_environment()
    assert strategy.launcher.signals == [signal.SIGKILL]
    assert strategy._timeout == timedelta(seconds=3)  # the collective bound put back


def test_other_failures_are_raised_as_they_are(no_group_left):
    """An error that is no timeout; and a timeout after the group was made (the connection had worked)."""
    strategy = _Strategy(3, ValueError("bad device"))
    with pytest.raises(ValueError, match="^bad device$"):
        strategy.setup_environment()
    assert strategy.launcher.signals == [] and strategy._timeout == timedelta(seconds=3)
    connected = _Strategy(3, RuntimeError("barrier timed out"), connect=True)
    try:
        with pytest.raises(RuntimeError, match="^barrier timed out$"):
            connected.setup_environment()
        assert connected.launcher.signals == []
    finally:
        dist.destroy_process_group()



class _Connecting(FirstConnection, _Lightning):
    """Connects as Lightning's strategy does (rank ``rank`` of 2 at ``port``, 1 s), with no other rank started."""

    def __init__(self, rank: int, port: int) -> None:
        super().__init__(1)
        self.global_rank, self.port = rank, port

    def setup_environment(self) -> None:
        self._connect_timeout = timedelta(seconds=1)
        super().setup_environment()

    def _connect_this_torchrun_attempt(self, timeout) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.global_rank,
                                world_size=2, timeout=timeout)


@pytest.mark.parametrize("libuv", ["1", "0"])
def test_torchs_own_connection_failures_are_told_apart(libuv, monkeypatch, no_group_left):
    """torch's real errors, whose types do not tell a timeout (``_timed_out`` reads their text): rank 0 alone
    (``DistStoreError``) and rank 1 alone (``DistNetworkError``) time out; rank 0's port taken by another process
    (``DistNetworkError``, 'EADDRINUSE') is no timeout, and read as 'a collective failed before training ... Another
    rank probably died or hung'. ``USE_LIBUV=0`` (torch's own socket code): 'errno: 98 - Address already in use'."""
    import socket

    monkeypatch.setenv("USE_LIBUV", libuv)

    with pytest.raises(FirstConnectionError, match="^rank 0: only 1 of 2 ranks connected within 1 s "):
        _Connecting(0, free_port()).setup_environment()
    with pytest.raises(FirstConnectionError, match=r"^rank 1: the 2 ranks did not all connect within 1 s \(DistNet"):
        _Connecting(1, free_port()).setup_environment()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        strategy = _Connecting(0, port)
        with pytest.raises(FirstConnectionError, match=f"^rank 0: the ranks' first connection could not start: port "
                                                       f"{port} is taken by another process .* set MASTER_PORT to a "
                                                       "free port, or leave it unset"):
            strategy.setup_environment()
    assert strategy.launcher.signals == [signal.SIGKILL]
