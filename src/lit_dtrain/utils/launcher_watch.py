"""A rank that Lightning's own launcher started ends when the rank that launched it is gone.

Lightning's DDP launcher (``trainer=ddp_cpu``, ``trainer.devices=2`` without torchrun or srun) starts ranks 1..N-1 as
child processes of rank 0 (``subprocess.Popen``) and never tells them when it dies. A SIGKILL of rank 0 (the OOM
killer, a ``kill -9`` of the job's first process) while the ranks were still meeting left rank 1 waiting for rank 0's
store until ``strategy.connect_timeout_s`` (30 min by default): one such orphan was alive, 368 MB resident, 150 s
after the kill and still at 17 min, when it was ended by hand. Once training runs, a dead rank 0 fails rank 1's next
collective within seconds on gloo; the watch covers the rest. Ranks started by torchrun, srun or another cluster
launcher are left to it.

Rank 0 names itself to the ranks it launches (``LIT_DTRAIN_LAUNCHING_PID``, in the environment that Lightning's
launcher copies to them): a rank 1 whose imports were still running when rank 0 was killed reached ``train()`` as a
child of init already, so the parent it found there was alive, and it waited until the collective timeout as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

CLUSTER_LAUNCH_KEYS = (  # a launcher that starts every rank itself: torchrun, srun, LSF, Kubeflow, MPI
    "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "LSB_JOBID", "KUBERNETES_PORT", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
)
LAUNCHING_PID = "LIT_DTRAIN_LAUNCHING_PID"  # rank 0's process id, set while its train() runs
_started = threading.Event()
# train() calls in progress that still need rank 0 (a collective to come): a parent that exits after this rank's
# last collective of the run, or after its run returned, is no error
_running = [0]
_runs: list[dict] = []  # the calls in progress, innermost last: {"watched": whether it counts in _running}


@contextlib.contextmanager
def watched_run(env=os.environ, interval_s: float = 1.0):
    """Around one ``train()`` run: :func:`exit_when_the_launching_rank_dies` while it runs, until it returns or
    says it is :func:`past_the_last_collective`; on a local rank 0, its process id in ``env[LAUNCHING_PID]`` for the
    ranks Lightning's launcher starts in fit (restored at the end)."""
    exit_when_the_launching_rank_dies(env, interval_s)
    marked = int(env.get("LOCAL_RANK", "0") or 0) <= 0
    earlier = env.get(LAUNCHING_PID)
    if marked:
        env[LAUNCHING_PID] = str(os.getpid())
    run = {"watched": True}
    _runs.append(run)
    _running[0] += 1
    try:
        yield
    finally:
        _runs.remove(run)
        if run["watched"]:
            _running[0] -= 1
        if marked and earlier is None:
            env.pop(LAUNCHING_PID, None)
        elif marked:
            env[LAUNCHING_PID] = earlier


def past_the_last_collective() -> None:
    """The current run (:func:`watched_run`) waits for rank 0 no more: what is left of it is this rank's own
    work. Rank 0 may end its run first and exit normally; a rank 1 that was slower in its end-of-run work (5 s in a
    real 2-rank run) printed 'rank 0 ... is gone; ... Resume with resume=auto' after a finished run and exited 1
    before its run returned."""
    if _runs and _runs[-1]["watched"]:
        _runs[-1]["watched"] = False
        _running[0] -= 1


def exit_when_the_launching_rank_dies(env=os.environ, interval_s: float = 1.0) -> bool:
    """On a rank Lightning's launcher started (``LOCAL_RANK`` above 0, no cluster launcher), start a daemon thread
    that ends this process with status 1 and one ``error:`` line once rank 0 (``env[LAUNCHING_PID]``, else its
    parent process) is gone while a run is in progress (:func:`watched_run`); at once if it was gone before this
    rank's imports ended. Returns whether it started one (once per process)."""
    if _started.is_set() or int(env.get("LOCAL_RANK", "0") or 0) <= 0:
        return False
    if LAUNCHING_PID not in env and any(k in env for k in CLUSTER_LAUNCH_KEYS):  # rank 0 named: Lightning launched
        return False  # this rank even where such a key is only inherited (KUBERNETES_PORT is in every k8s pod)
    parent = int(env.get(LAUNCHING_PID) or os.getppid())
    child = os.getppid() == parent  # else a wrapper between them, or rank 0 is gone and this rank is init's
    rank = env.get("LOCAL_RANK")

    def watch() -> None:
        while not _running[0] or not _gone(parent, child):  # between runs (a multirun's jobs): at the next one
            time.sleep(interval_s)
        print(f"error: local rank {rank}: rank 0 (process {parent}), which launched this rank, is gone; nothing "
              "more can be trained or saved here, so this rank exits too. Resume with resume=auto.",
              file=sys.stderr, flush=True)
        os._exit(1)

    _started.set()
    threading.Thread(target=watch, name="lit_dtrain-launcher-watch", daemon=True).start()
    return True


def _gone(pid: int, child: bool) -> bool:
    """Whether process ``pid`` has exited: this process, its child, was handed to another parent, or (not its child)
    no process ``pid`` exists, or one not reaped yet: ``subprocess.run(capture_output=True)`` reaps rank 0 only once
    every holder of its output pipe, this rank too, has closed it."""
    if os.getppid() == pid:
        return False
    if child:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that id: not rank 0's, which this user started
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] == "Z"  # (a zombie: exited, not reaped)
    except OSError:  # no /proc (macOS): alive as far as can be told
        return False


def kill_launched_ranks(launcher, grace_s: float = 0.0) -> None:
    """SIGKILL the ranks that Lightning's launcher started (those still alive after ``grace_s`` seconds: ranks that
    were told to exit and end by themselves keep their last lines) and wait for them, taking them off its ``procs`` list
    first: Lightning's child-process observer polls that list every 5 s and, finding a rank ended by a signal, SIGKILLs
    this process too (lightning 2.6 private: the observer watches the launcher's ``procs`` list). A multirun whose job
    0 timed out in its first connection, a job failure after which the sweep goes on, was killed so in job 1: exit
    status 137 and no line. A launcher without such a list (torchrun's ranks, a stand-in) gets ``kill``."""
    procs = getattr(launcher, "procs", None)
    if not isinstance(procs, list):
        launcher.kill(signal.SIGKILL)
        return
    ranks = list(procs)
    procs.clear()  # before the kill: an empty list ends the observer's watch
    deadline = time.monotonic() + grace_s
    try:
        for proc in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:  # a stop signal to this rank in the grace (raised out of the wait) kills them too: it left a hung one
        for proc in ranks:  # alive, its parent gone (a Ctrl-C again, or a scheduler's SIGTERM, after a peer's stop)
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGKILL)
        for proc in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
