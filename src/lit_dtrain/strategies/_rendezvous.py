"""The ranks' first meeting under Lightning's own launcher, waited for in Python, where a stop signal is acted on.

Under Lightning's launcher (``trainer=ddp_cpu``, ``trainer.devices=2`` without torchrun or srun) rank 0 starts the
other ranks as child processes, then waits in torch's rendezvous (``init_process_group``: its store waiting for the
ranks to join) for them to import and reach theirs. That wait is C++, where no Python signal handler runs:

- a SIGTERM to rank 0 there was acted on only once rank 1 connected; rank 0 exited 143 with its line, and rank 1,
  waiting in the store of rank 0's exiting process, printed torch's TCPStore C++ traces and ``error: rank 1: a
  collective failed before training (DistNetworkError: Failed to recv ...)``, exit 1;
- a SIGTERM to rank 1 alone before it connected (its config checks or model build) ended rank 1 with 143 and its
  line, and rank 0, still waiting, was SIGKILLed by Lightning's observer of its child ranks within 5 s: 137, no line.

:func:`meet` does the same meeting through the same kind of store (torch's ``TCPStore`` on ``MASTER_ADDR`` and
``MASTER_PORT``, rank 0 its server), but each rank says it joined with a key, and the ranks wait for each other in
short polls of it: a stop signal is raised between two polls (``StopsBeforeTraining``), and rank 0 sees a child rank
that ended. The group is then made on that store (``init_process_group(store=...)``, as torch's own rendezvous hands
it its store), once every rank is there, so its own connection waits for no one.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from lit_dtrain.utils.launcher_watch import kill_launched_ranks

JOINED_KEY, GO_KEY = "lit_dtrain/meet/joined", "lit_dtrain/meet/go"
POLL_S = 0.01  # (Lightning's observer, every 5 s, SIGKILLs this rank if it sees an ended child first)
log = logging.getLogger(__name__)


def launched_by_lightning(strategy) -> bool:
    """Whether the strategy's ranks are Lightning's launcher's (its ``_SubprocessScriptLauncher``, whose ``procs``
    are ``Popen`` objects; Lightning's own environment, not torchrun's, Slurm's or another cluster's). Not the spawn
    launcher's (``ddp_spawn``, a project's own ``start_method="spawn"``): its ranks learn their rank only later in
    ``setup_environment`` (``set_world_ranks``), so each here read rank 0 and both bound the store's port
    (``EADDRINUSE``, ``tests/dist/test_compressed_ddp_failures.py``)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(strategy, "launcher", None)
    return isinstance(launcher, _SubprocessScriptLauncher) and isinstance(getattr(launcher, "procs", None), list) \
        and type(getattr(strategy, "cluster_environment", None)) is LightningEnvironment


def meet(strategy, backend: str, timeout: timedelta) -> None:
    """Make the default group of Lightning's launched ranks (:func:`launched_by_lightning`), the ranks having met as
    the module docstring says. Rank 0, stopped by a signal while it waits, forwards a SIGTERM or SIGHUP to the ranks
    it launched and gives them up to 5 s to end with their own line (Lightning forwards a SIGTERM in training alike); a
    child rank that ended before it joined stops rank 0 too: with its signal (a line names the rank), else with a
    ``FirstConnectionError`` naming its exit status."""
    env = strategy.cluster_environment
    rank, world = env.global_rank(), env.world_size()
    deadline = time.monotonic() + timeout.total_seconds()
    store = dist.TCPStore(env.main_address, env.main_port, world, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False, multi_tenant=True, use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    if rank == 0:
        _wait_for_the_ranks(strategy.launcher, store, world, deadline, timeout)
    else:
        store.add(JOINED_KEY, 1)
        while not store.check([GO_KEY]):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: "
                                          f"{GO_KEY} (rank 0 did not see every rank join)")
            time.sleep(POLL_S)
    _init_group_as_lightning(strategy, backend, store, rank, world, timeout)


def _init_group_as_lightning(strategy, backend: str, store, rank: int, world: int, timeout: timedelta) -> None:
    """``init_process_group`` on ``store`` as Lightning's ``_init_dist_connection`` calls it (which then finds the group
    made and returns at once): its ``device_id``, the rank's device where that is no CPU (NCCL's communicator bound to
    the rank's GPU at once; none was given), and its lines ('Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2'
    and rank 0's 'All distributed processes registered. Starting with 2 processes', which every 2-rank run had lost)."""
    from lightning.fabric.utilities.distributed import log as lightning_log
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    device = getattr(strategy, "root_device", None)
    device_id = device if device is not None and device.type != "cpu" else None
    lightning_log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world}")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id)
    rank_zero_info(f"{'-' * 100}\ndistributed_backend={backend}\nAll distributed processes registered. Starting with "
                   f"{world} processes\n{'-' * 100}\n")


def _wait_for_the_ranks(launcher, store, world: int, deadline: float, timeout: timedelta) -> None:
    from lit_dtrain.stops_before_training import StoppedBeforeTraining

    try:
        while (joined := store.add(JOINED_KEY, 0)) < world - 1:
            ended = next(((i + 1, p.returncode) for i, p in enumerate(launcher.procs) if p.poll() is not None), None)
            if ended is not None:
                kill_launched_ranks(launcher, grace_s=5.0)  # (off the observer's list first: it SIGKILLs this rank)
                raise _a_rank_ended(*ended)
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"Timed out after {timeout.total_seconds():.0f} seconds waiting for "
                                          f"clients. {joined + 1}/{world} clients joined.")
            time.sleep(POLL_S)
    except (StoppedBeforeTraining, KeyboardInterrupt) as e:  # this rank's stop: the others' too (a Ctrl-C is not
        for proc in launcher.procs if isinstance(e, StoppedBeforeTraining) else ():  # forwarded: a terminal sends it
            if proc.poll() is None:  # to every rank, and a second copy reads as a second Ctrl-C)
                proc.send_signal(e.signum)
        kill_launched_ranks(launcher, grace_s=5.0)
        if isinstance(e, StoppedBeforeTraining):  # (its line is said after Lightning's teardown deleted WORLD_SIZE)
            e.world_size = world
        raise
    store.set(GO_KEY, "1")


def _a_rank_ended(rank: int, status: int) -> BaseException:
    """What rank 0 raises for a child rank that ended before it joined: a stop by its signal (128 + the signal, or
    killed by it), or an error naming its status."""
    from lit_dtrain.callbacks.preemption import STOP_SIGNALS
    from lit_dtrain.stops_before_training import StoppedBeforeTraining
    from lit_dtrain.utils.distributed import FirstConnectionError

    signum = status - 128 if status > 128 else -status
    if signum in [int(s) for s in STOP_SIGNALS]:
        name = signal.Signals(signum).name
        log.warning("rank %d was stopped by %s before the ranks connected (exit status %d): this rank stops with it",
                    rank, name, status)
        return KeyboardInterrupt() if signum == signal.SIGINT else StoppedBeforeTraining(signum)
    return FirstConnectionError(f"rank 0: rank {rank} exited with status {status} before the ranks connected (its own "
                                "output names why)")
