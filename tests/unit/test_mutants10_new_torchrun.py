"""Exact results of this stop's torchrun code where single-point mutants passed test_configs_run_dirs.py and
test_strategy_first_connection.py (tenth hand mutation audit): torchrun's agent read from the stat line of a session
leader whose name holds ') ' (the name is cut at its last ')') or under a wrapper whose `timeout` makes a process
group of its own, and no attempt keys of its own for a worker whose
restart count is not given (not torchrun's agent, which always sets it)."""

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
