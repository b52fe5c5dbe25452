"""The group ``strategies/_rendezvous.py`` makes under Lightning's own launcher is made as Lightning's
``_init_dist_connection`` makes it, which then finds it made and returns at once: every 2-rank run had lost Lightning's
lines ('Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2', 'All distributed processes registered. Starting with
2 processes'), and a GPU rank's ``device_id`` was not given (NCCL's communicator not bound to the rank's GPU)."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lit_dtrain.strategies import _rendezvous
from tests.conftest import free_port


class _Launcher(_SubprocessScriptLauncher):
    def __init__(self):  # Lightning's launcher of ranks as new processes of the script: no children in a run of one
        self.procs = []


class _Strategy:
    def __init__(self, device: torch.device):
        self.cluster_environment, self.launcher, self.root_device = LightningEnvironment(), _Launcher(), device


@pytest.fixture
def port(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_group_is_made_with_lightnings_lines(port, caplog):
    strategy = _Strategy(torch.device("cpu"))
    assert _rendezvous.launched_by_lightning(strategy)
    with caplog.at_level(logging.INFO):
        _rendezvous.meet(strategy, "gloo", timedelta(seconds=30))
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1" in caplog.messages
    assert any("distributed_backend=gloo\nAll distributed processes registered. Starting with 1 processes" in m
               for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("device, device_id", [(torch.device("cuda", 1), torch.device("cuda", 1)),
                                               (torch.device("cpu"), None)])
def test_a_gpu_ranks_device_is_given_as_lightning_gives_it(port, monkeypatch, device, device_id):
    calls = []
    monkeypatch.setattr(_rendezvous.dist, "init_process_group", lambda *a, **kw: calls.append(kw))
    _rendezvous.meet(_Strategy(device), "nccl", timedelta(seconds=30))
    assert [call["device_id"] for call in calls] == [device_id]


def test_spawned_ranks_meet_in_torchs_rendezvous():
    """``ddp_spawn`` (or a project's own ``start_method="spawn"``): the spawn launcher's ranks learn their rank only
    later in ``setup_environment``, so each read rank 0 here and both bound the store's port (``EADDRINUSE`` in
    ``tests/dist/test_compressed_ddp_failures.py``): they keep torch's own rendezvous."""
    strategy = _Strategy(torch.device("cpu"))
    strategy.launcher = _MultiProcessingLauncher.__new__(_MultiProcessingLauncher)
    strategy.launcher.procs = []
    assert not _rendezvous.launched_by_lightning(strategy)
