"""Exact results of this stop's torchrun code where single-point mutants passed test_configs_run_dirs.py and
test_strategy_first_connection.py (tenth hand mutation audit): torchrun's agent read from the stat line of a session
leader whose name holds ') ' (the name is cut at its last ')') or under a wrapper whose `timeout` makes a process
group of its own, and no attempt keys of its own for a worker whose
restart count is not given (not torchrun's agent, which always sets it); and (left untested by that audit) a
strategy connecting the attempt's keys again where a process group exists."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lit_dtrain.strategies._connect import torchrun_attempt_store
from tests.unit.test_configs_run_dirs import torchrun_none_without_a_log_dir


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the agent is read from /proc")
def test_the_agent_is_read_past_a_session_leaders_name_that_holds_a_parenthesis(monkeypatch, tmp_path):
    """/proc/<pid>/stat is 'pid (comm) state ppid ...', and comm is the program's file name, which may hold ') ':
    a wrapper shell called 'run) 1 2' (a link to bash here) must not be read as ppid 2."""
    torchrun_none_without_a_log_dir(monkeypatch)
    shell = tmp_path / "run) 1 2"
    shell.symlink_to("/bin/bash")
    code = "from lit_dtrain.config_resolvers import launch_run_name; print(launch_run_name('stamp'))"
    worker = subprocess.run([str(shell), "-c", f"{sys.executable} -c \"{code}\"; true"], capture_output=True,
                            text=True, start_new_session=True, timeout=120, check=True)
    assert worker.stdout.strip() == f"torchrun-{socket.gethostname()}-{os.getpid()}"


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the agent is read from /proc")
def test_the_agent_is_the_session_leaders_parent_not_a_process_groups(monkeypatch):
    """A wrapper running `timeout 3600 python train.py`: timeout makes a process group of its own (setpgid), inside
    the session torchrun started; read by the group, the 'agent' was each rank's own wrapper shell."""
    torchrun_none_without_a_log_dir(monkeypatch)
    code = "from lit_dtrain.config_resolvers import launch_run_name; print(launch_run_name('stamp'))"
    worker = subprocess.run(["bash", "-c", f"timeout 100 {sys.executable} -c \"{code}\"; true"], capture_output=True,
                            text=True, start_new_session=True, timeout=120, check=True)
    assert worker.stdout.strip() == f"torchrun-{socket.gethostname()}-{os.getpid()}"


def test_no_attempt_keys_without_torchruns_restart_count(monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert torchrun_attempt_store(timedelta(seconds=10)) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert torchrun_attempt_store(timedelta(seconds=10))[0] == "2"
    del agent


def test_a_restart_alone_says_its_ranks_connect_under_its_own_keys(monkeypatch, caplog):
    """The group connects through the attempt's store (its prefix: the test above); the info line is for a restart
    only (attempt 0 of every torchrun launch said it too)."""
    import logging
    from types import SimpleNamespace

    from lit_dtrain.strategies._connect import FirstConnection

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "TORCHELASTIC_MAX_RESTARTS": "1", "MASTER_PORT": str(agent.port)}.items():
        monkeypatch.setenv(key, value)
    strategy = SimpleNamespace(cluster_environment=SimpleNamespace(global_rank=lambda: 0, world_size=lambda: 1),
                               _get_process_group_backend=lambda: "gloo")
    said = {}
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lit_dtrain.strategies._connect"):
            FirstConnection._connect_this_torchrun_attempt(strategy, timedelta(seconds=30))
        try:
            assert dist.is_initialized() and dist.get_world_size() == 1
        finally:
            dist.destroy_process_group()
        said[attempt] = [r.getMessage() for r in caplog.records]
    assert said == {"0": [], "1": ["torchrun restart 1: the ranks connect under this attempt's own keys in "
                                   "torchrun's store (lit_dtrain/torchrun_attempt1)"]}
    del agent


def test_a_group_that_exists_is_not_connected_again_under_torchrun_restarts(monkeypatch):
    """A group already made (a project's own ``init_process_group``, or the group an earlier fit left) is kept under
    ``torchrun --max-restarts``: connecting the attempt's keys again raised torch's 'trying to initialize the default
    process group twice!' (the mutant of the new-code audit left untested). Its own collective bound is kept too."""
    from types import SimpleNamespace

    from lit_dtrain.strategies._connect import FirstConnection

    class Connected:  # Lightning's setup_environment, which finds the group made and does not connect again
        def setup_environment(self) -> None:
            pass

    class Strategy(FirstConnection, Connected):
        global_rank, world_size, _timeout = 0, 1, timedelta(seconds=7)
        cluster_environment = SimpleNamespace(global_rank=lambda: 0, world_size=lambda: 1)

        def _get_process_group_backend(self) -> str:
            return "gloo"

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1",
                       "MASTER_PORT": str(agent.port)}.items():
        monkeypatch.setenv(key, value)
    assert torchrun_attempt_store(timedelta(seconds=10)) is not None  # (the attempt's keys would be used)
    bounds = []
    monkeypatch.setattr("lit_dtrain.strategies._connect.set_collective_timeout", bounds.append)
    own = dist.HashStore()
    dist.init_process_group("gloo", store=own, rank=0, world_size=1, timeout=timedelta(seconds=40))
    try:
        group = dist.distributed_c10d._get_default_group()
        Strategy().setup_environment()
        assert dist.distributed_c10d._get_default_group() is group
        assert not agent.check(["lit_dtrain/torchrun_attempt1/0"])  # no rank of this attempt wrote its address
        assert bounds == []  # its own bound (40 s) kept, not this strategy's 7 s
    finally:
        dist.destroy_process_group()
    del agent
