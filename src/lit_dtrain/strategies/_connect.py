"""The ranks' first connection (torch's ``init_process_group``), bounded apart from the collectives after it.

Lightning hands its strategy's ``timeout`` to ``init_process_group``, which bounds both the rendezvous (rank 0's store
waiting for every rank to join; under torchrun, gloo's mesh of the ranks' addresses) and every collective. A short
``collective_timeout_s``, set to catch a hung rank quickly, then failed a run whose other rank started slowly: with
8 s, on a loaded 2-core machine, ``CollectiveError: rank 0: a collective failed at step 0 (DistStoreError: Timed out
after 9 seconds waiting for clients. 1/2 clients joined.). Another rank probably died or hung`` before training.
Here the connection waits ``connect_timeout_s`` (at least ``collective_timeout_s``; 1800 s by default, Lightning's and
torch's bound of a gloo process group), then the process group's collectives get ``collective_timeout_s``; a
connection that times out says so in one line (:class:`~lit_dtrain.utils.distributed.FirstConnectionError`).

Under ``torchrun --max-restarts`` on one node, each attempt's ranks connect under keys of their own in torchrun's store
(:func:`torchrun_attempt_store`): a restart under ``--master-port`` failed in seconds without them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from lit_dtrain.strategies._rendezvous import launched_by_lightning, meet
from lit_dtrain.utils.distributed import (
    FirstConnectionError,
    agent_store,
    can_set_collective_timeout,
    destroy_process_group_at_exit,
    set_collective_timeout,
)
from lit_dtrain.utils.launcher_watch import kill_launched_ranks

DEFAULT_CONNECT_S = 1800.0
log = logging.getLogger(__name__)

# The default group a FirstConnection strategy connected, while it lives: Lightning leaves it initialized after a fit,
# and a later Trainer's strategy in the same process (a second fit, a Hydra multirun's next job) finds it and does not
# connect again. Its collective timeout is then this strategy's, as for the first: the second Trainer's
# make_ddp(collective_timeout_s=7) kept the first one's 4 s. A group made elsewhere (the user's own
# init_process_group) keeps its own bound, as under Lightning.
_made_here: weakref.ref | None = None


class FirstConnection:
    """Mixin for a Lightning DDP / FSDP strategy (``timeout``: the collective timeout): ``_connect_timeout`` bounds the
    ranks' first connection, at least as long as ``timeout``. (No ``__init__`` here: the config's key check follows a
    strategy's ``**kwargs`` through the ``__init__`` of the classes it derives from, and would stop at a mixin's.)"""

    _connect_timeout: timedelta = timedelta(seconds=DEFAULT_CONNECT_S)

    def setup_environment(self) -> None:
        collective = self._timeout
        connect = max(self._connect_timeout, collective) if collective is not None else self._connect_timeout
        ours = not dist.is_initialized()
        if not can_set_collective_timeout():  # (a torch without the private setter: one bound for both, as Lightning)
            connect = collective
        self._timeout = connect
        started = time.monotonic()
        try:
            if ours and launched_by_lightning(self):  # waited for in Python: a stop signal is acted on (_rendezvous)
                meet(self, self._get_process_group_backend(), connect or timedelta(seconds=DEFAULT_CONNECT_S))
                destroy_process_group_at_exit()
            elif ours:
                self._connect_this_torchrun_attempt(connect)
            super().setup_environment()
        except Exception as e:
            if not (ours and not dist.is_initialized() and (_timed_out(e) or _port_in_use(e))):
                raise
            launcher = getattr(self, "launcher", None)
            if launcher is not None and hasattr(launcher, "kill"):  # do not leave a child rank waiting to connect
                kill_launched_ranks(launcher)  # (nor Lightning's observer of it to kill this process: a multirun's)
            seconds = connect.total_seconds() if connect is not None else DEFAULT_CONNECT_S  # (None: torch's 30 min)
            raise FirstConnectionError(first_connection_message(e, self.global_rank, self.world_size, seconds,
                                                                time.monotonic() - started)) from e
        finally:
            self._timeout = collective
        if not dist.is_initialized() or collective is None or not can_set_collective_timeout():
            return
        global _made_here
        group = dist.distributed_c10d._get_default_group()
        if ours:
            _made_here = weakref.ref(group)
        if ours or (_made_here is not None and _made_here() is group):
            set_collective_timeout(collective)

    def _connect_this_torchrun_attempt(self, timeout: timedelta | None) -> None:
        """Connect the default group under keys of this torchrun attempt's own (:func:`torchrun_attempt_store`), where
        it needs them; Lightning then finds the group made and does not connect again."""
        attempt = torchrun_attempt_store(timeout if timeout is not None else timedelta(seconds=DEFAULT_CONNECT_S))
        if attempt is None:
            return
        env = self.cluster_environment
        if attempt[0] != "0" and env.global_rank() == 0:
            log.info("torchrun restart %s: the ranks connect under this attempt's own keys in torchrun's store (%s)",
                     attempt[0], ATTEMPT_PREFIX.format(attempt[0]))
        dist.init_process_group(self._get_process_group_backend(), store=attempt[1], rank=env.global_rank(),
                                world_size=env.world_size(), timeout=timeout)
        destroy_process_group_at_exit()  # (Lightning's connection registers one for NCCL; train() for every backend)


ATTEMPT_PREFIX = "lit_dtrain/torchrun_attempt{}"


def torchrun_attempt_store(timeout: timedelta) -> tuple[str, dist.Store] | None:
    """Under ``torchrun --max-restarts`` (N > 0) on one node with the agent's store (``TORCHELASTIC_USE_AGENT_STORE``):
    (attempt, a client of torchrun's store whose keys are this attempt's alone); else None (torch's own connection).

    Torchrun's workers connect through the store its agent holds: always under static rendezvous (``--master-port`` or
    ``--rdzv-endpoint`` without ``--rdzv-backend``; ``static_tcp_rendezvous.py`` keeps one store and one key prefix
    for the whole launch), and under c10d unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. That store outlives the
    workers, and torch's keys for the ranks' addresses are the same in every attempt, so a restarted rank could read
    a dead worker's gloo address before its peer wrote its new one: under ``--master-port`` every restart failed within
    seconds ('Gloo connectFullMesh failed ... Connection refused', 2 of 2 here, whichever rank started first;
    pytorch#135712). The attempt is torchrun's ``TORCHELASTIC_RESTART_COUNT``, which every worker of one agent
    shares; agents on several nodes keep their own counts (c10d restarts the other nodes without counting:
    pytorch#135712), so there torch's connection is left as it is."""
    env = os.environ
    attempt, restarts = env.get("TORCHELASTIC_RESTART_COUNT", ""), env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1" or \
            not attempt.isdigit() or not restarts.isdigit() or int(restarts) == 0:
        return None
    return attempt, agent_store(ATTEMPT_PREFIX.format(attempt), timeout)


@contextlib.contextmanager
def waiting_as_for_a_connection(strategy):
    """Bound the default group's collectives by the strategy's ``connect_timeout_s`` (not ``collective_timeout_s``)
    inside this block, where the other ranks wait for rank 0's work alone, as they wait for a rank that starts slowly:
    a multirun job's end-of-run sample, which only rank 0 draws. With ``collective_timeout_s=10`` and a 1200-token
    sample, a healthy 2-rank sweep failed there ('Timed out waiting 10000ms for send operation to complete') and was
    SIGKILLed, status 137. A group made elsewhere keeps its own bound, as :class:`FirstConnection` leaves it."""
    collective, connect = getattr(strategy, "_timeout", None), getattr(strategy, "_connect_timeout", None)
    group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    ours = group is not None and _made_here is not None and _made_here() is group and can_set_collective_timeout()
    if not ours or collective is None or connect is None or connect <= collective:
        yield
        return
    set_collective_timeout(connect)
    try:
        yield
    finally:
        set_collective_timeout(collective)


def _timed_out(exc: BaseException) -> bool:
    """Whether the first connection timed out, told by its text: torch 2.13's types do not tell it. Its timeouts are a
    ``DistStoreError`` (rank 0 alone: 'Timed out after 4 seconds waiting for clients. 1/2 clients joined.'; under
    torchrun: 'wait timeout after 3000ms, keys: ...'), a ``DistNetworkError`` (rank 1 alone: 'The client socket has
    timed out after 3000ms while trying to connect to ...') and gloo's plain ``RuntimeError`` ('Gloo connectFullMesh
    failed with [...pair.h:311] Connect timeout'); a ``DistNetworkError`` is no timeout as well (rank 0's port taken,
    'EADDRINUSE'; rank 0 gone while rank 1 connected, 'Failed to recv, got 0 bytes. Connection was likely closed')."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or "clients joined" in text


def _port_in_use(exc: BaseException) -> bool:
    """Whether rank 0's store could not listen on its port (``MASTER_PORT``), which another process holds: libuv's
    'EADDRINUSE', or torch's own socket code's 'errno: 98 - Address already in use' (``USE_LIBUV=0``, which read as 'a
    collective failed before training ... Another rank probably died or hung')."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistNetworkError) and ("eaddrinuse" in text or "address already in use" in text)


def first_connection_message(exc: BaseException, rank: int, world_size: int, seconds: float,
                             elapsed: float | None = None) -> str:
    """One line for a first connection that timed out: how many ranks joined rank 0's store (on rank 0), else that the
    ranks did not all connect (another rank not reaching rank 0's store; under torchrun, gloo's wait for a rank's
    address: 'DistStoreError: wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1'). A connection refused
    (gloo's 'timed out connecting: SO_ERROR: Connection refused') failed after ``elapsed`` seconds, not the bound: the
    line said 'did not all connect within 1800 s' of a torchrun restart that failed in 3 s. Rank 0's port taken by
    another process ('EADDRINUSE') read as 'a collective failed before training ... Another rank probably died or
    hung ... Resume with resume=auto'."""
    first = (str(exc).splitlines() or [""])[0][:200]
    joined = re.search(r"(\d+)/(\d+) clients joined", first)
    if _port_in_use(exc):
        port = re.search(r"port[:=] ?(\d+)", str(exc))
        return (f"rank {rank}: the ranks' first connection could not start: port "
                f"{port.group(1) if port else os.environ.get('MASTER_PORT', '?')} is taken by another process (another "
                f"run's rank 0?) ({type(exc).__name__}: {first}): set MASTER_PORT to a free port, or leave it unset "
                "where Lightning launches the ranks (it picks a free one)")
    if "connection refused" in first.lower():
        took = f" after {elapsed:.0f} s" if elapsed is not None else ""
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
        why = ("torchrun restarted the ranks, and a restarted rank read the failed attempt's address from torchrun's "
               "store, which the attempts share on several nodes (pytorch#135712): launch with --rdzv-backend=c10d "
               "and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment" if restarted else
               "the rank that wrote it ended or restarted since (its own output names why)")
        return (f"rank {rank}: a connection to another rank was refused{took}, not timed out (strategy."
                f"connect_timeout_s is {seconds:g} s) ({type(exc).__name__}: {first}): nothing listened at the "
                f"address the store gave for it; {why}")
    if joined:
        what = f"only {joined.group(1)} of {joined.group(2)} ranks connected within {seconds:g} s"
    else:
        what = f"the {world_size} ranks did not all connect within {seconds:g} s"
    return (f"rank {rank}: {what} ({type(exc).__name__}: {first}); a rank has not started, is still starting (slow "
            "imports on a loaded node or network file system) or failed before connecting (its own output names "
            "why): raise strategy.connect_timeout_s if the ranks start slowly")


def ends_the_sweep(error: BaseException) -> BaseException | None:
    """The error that ends a multirun at this job, saying so, or None where the sweep runs its next job. A first
    connection that timed out (``FirstConnectionError``) ends it with status 1: every later job waited
    ``strategy.connect_timeout_s`` (30 min by default) and failed alike, since Lightning launches a sweep's other
    ranks once and this job's were killed (:func:`lit_dtrain.sweeps.reports_user_errors`). So does a failed
    collective (``CollectiveError``): the group the jobs share is broken and its child ranks killed, so each later job
    failed in its first collective (a 3-job sweep whose rank 1 hung in job 0: jobs 1 and 2 failed at step 0 in 1 s,
    'Application timeout caused pair closure')."""
    from lit_dtrain.sigterm_exit import train_resume_hint
    from lit_dtrain.train import CollectiveError

    if isinstance(error, FirstConnectionError):
        text, why = str(error), "its later jobs would wait for ranks that are gone"
    elif isinstance(error, CollectiveError):  # its single run's 'Resume with resume=auto.' is refused under -m
        text = str(error).removesuffix(" Resume with resume=auto.").removesuffix(".")
        why = "its later jobs would fail in their first collective: the ranks' connections are gone"
    else:
        return None
    return type(error)(f"{text}; the sweep stops at this job ({why}): resume with {train_resume_hint(None)}")
