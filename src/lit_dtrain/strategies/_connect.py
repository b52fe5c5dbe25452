"""The ranks' first connection (torch's ``init_process_group``), bounded apart from the collectives after it.

Lightning hands its strategy's ``timeout`` to ``init_process_group``, which bounds both the rendezvous (rank 0's store
waiting for every rank to join; under torchrun, gloo's mesh of the ranks' addresses) and every collective. A short
``collective_timeout_s``, set to catch a hung rank quickly, then failed a run whose other rank started slowly: with
8 s, on a loaded 2-core machine, ``CollectiveError: rank 0: a collective failed at step 0 (DistStoreError: Timed out
after 9 seconds waiting for clients. 1/2 clients joined.). Another rank probably died or hung`` before training.
Here the connection waits ``connect_timeout_s`` (at least ``collective_timeout_s``; 1800 s by default, Lightning's and
torch's bound of a gloo process group), then the process group's collectives get ``collective_timeout_s``; a
connection that times out says so in one line (:class:`~lit_dtrain.utils.distributed.FirstConnectionError`).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from datetime import timedelta

import torch.distributed as dist

from lit_dtrain.utils.distributed import FirstConnectionError, can_set_collective_timeout, set_collective_timeout
from lit_dtrain.utils.launcher_watch import kill_launched_ranks

DEFAULT_CONNECT_S = 1800.0

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
        try:
            super().setup_environment()
        except Exception as e:
            if not (ours and not dist.is_initialized() and _timed_out(e)):
                raise
            launcher = getattr(self, "launcher", None)
            if launcher is not None and hasattr(launcher, "kill"):  # do not leave a child rank waiting to connect
                kill_launched_ranks(launcher)  # (nor Lightning's observer of it to kill this process: a multirun's)
            seconds = connect.total_seconds() if connect is not None else DEFAULT_CONNECT_S  # (None: torch's 30 min)
            raise FirstConnectionError(first_connection_message(e, self.global_rank, self.world_size, seconds)) from e
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
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or "clients joined" in text


def first_connection_message(exc: BaseException, rank: int, world_size: int, seconds: float) -> str:
    """One line for a first connection that timed out: how many ranks joined rank 0's store (on rank 0), else that the
    ranks did not all connect (another rank not reaching rank 0's store; under torchrun, gloo's wait for a rank's
    address: 'DistStoreError: wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1')."""
    first = (str(exc).splitlines() or [""])[0][:200]
    joined = re.search(r"(\d+)/(\d+) clients joined", first)
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
