"""A rank that Lightning's launcher started ends when rank 0, its parent, is gone (lit_dtrain.utils.launcher_watch)."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lit_dtrain.utils.launcher_watch import LAUNCHING_PID, exit_when_the_launching_rank_dies, watched_run
from tests.conftest import ROOT

# the child stands in for rank 1: it watches, then waits as rank 1 waited for a dead rank 0's store (30 min)
_CHILD = "from lit_dtrain.utils.launcher_watch import watched_run\nimport time\nwith watched_run(interval_s=0.05):\n" \
         "    print('watching', flush=True)\n    time.sleep(60)\n"
_PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID")}
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**env, "LOCAL_RANK": "1"})
    print(child.pid, flush=True)
    time.sleep(60)
""")


def test_a_rank_launched_by_rank_0_exits_when_rank_0_is_killed():
    """SIGKILL of rank 0 while the ranks met left rank 1 waiting for it (alive 150 s later, and at 17 min, in a real
    2-rank run): it now exits within a poll, with status 1 and a line that says why and what to do."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        parent.kill()
        parent.wait()
        started = time.monotonic()
        stderr = parent.stderr.read()  # EOF once the child, which shares the pipe, has exited too
        assert time.monotonic() - started < 10
        assert f"error: local rank 1: rank 0 (process {parent.pid}), which launched this rank, is gone" in stderr
        assert "Resume with resume=auto" in stderr
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if _alive(parent.pid) else None
    deadline = time.monotonic() + 5  # its stderr closes a moment before the process is gone
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


# rank 0 as train() runs it: its launcher copies os.environ, with rank 0's LIT_DTRAIN_LAUNCHING_PID, to rank 1
_PARENT_IN_TRAIN = textwrap.dedent("""
    import os, subprocess, sys, time
    from lit_dtrain.utils.launcher_watch import watched_run
    for key in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        os.environ.pop(key, None)
    with watched_run():
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "LOCAL_RANK": "1"})
        print(child.pid, flush=True)
        time.sleep(60)
""")
# rank 1 still importing when rank 0 is killed: it reaches train() (watched_run) as another process's child
_CHILD_IMPORTING = "import os, time\nparent = os.getppid()\nprint('importing', flush=True)\n" \
    "while os.getppid() == parent:\n    time.sleep(0.01)\n" + _CHILD


@pytest.mark.parametrize("pod", [False, True], ids=["plain", "kubernetes_pod"])
def test_a_rank_whose_imports_outlast_rank_0_exits_when_it_reaches_train(pod):
    """A real 2-rank trainer=ddp_cpu run whose rank 0 was SIGKILLed while rank 1 imported: rank 1 was still waiting
    at 'Initializing distributed' 40 s later (its watch took init, its parent by then, for rank 0). In a Kubernetes
    pod (KUBERNETES_PORT, set in every pod, is one of the cluster keys) the watch was never started. Under a driver's
    subprocess.run(capture_output=True), which reaps rank 0 once rank 1 closed the pipes too, rank 1 took the
    unreaped rank 0 for alive: the driver still waited 60 s after the kill."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if pod:
        env["KUBERNETES_PORT"] = "tcp://10.96.0.1:443"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_IN_TRAIN, _CHILD_IMPORTING], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "importing"
        parent.kill()  # not reaped until rank 1 closes the pipes, as subprocess.run(capture_output=True) does
        assert parent.stdout.readline().strip() == "watching"  # it reached train() after rank 0's end
        started = time.monotonic()
        stderr = parent.stderr.read()
        assert time.monotonic() - started < 10
        parent.wait()
        assert f"error: local rank 1: rank 0 (process {parent.pid}), which launched this rank, is gone" in stderr
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if _alive(parent.pid) else None
        alive = _wait_gone(child)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL) if alive else None  # not left waiting 60 s when the watch fails
    assert not alive


def test_rank_0_names_itself_to_the_ranks_it_launches_only_while_it_runs():
    env = {"KEEP": "1"}
    with watched_run(env=env):
        assert env == {"KEEP": "1", LAUNCHING_PID: str(os.getpid())}
    assert env == {"KEEP": "1"}
    env = {"LOCAL_RANK": "0", LAUNCHING_PID: "1"}  # a train() inside a run (a project calling it twice)
    with watched_run(env=env):
        assert env[LAUNCHING_PID] == str(os.getpid())
    assert env == {"LOCAL_RANK": "0", LAUNCHING_PID: "1"}


def _wait_gone(pid: int) -> bool:
    """Whether ``pid`` is still alive 5 s on (its stderr closes a moment before the process is gone)."""
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pid)


# rank 1 slower in its end-of-run work than rank 0, which ends its run normally first (5 s in a real 2-rank run)
_SLOW_CHILD = textwrap.dedent("""
    import os, time
    from lit_dtrain.utils.launcher_watch import past_the_last_collective, watched_run
    parent = os.getppid()
    with watched_run(interval_s=0.05):
        print('watching', flush=True)
        past_the_last_collective()
        while os.getppid() == parent:
            time.sleep(0.05)
        time.sleep(0.5)  # ten polls of the watch after rank 0 has gone
    print('finished', flush=True)
""")


def test_a_rank_0_that_ends_normally_first_is_not_reported():
    """A rank 1 still in its run's end after the ranks' last collective, when rank 0 had ended normally, printed
    'rank 0 ... is gone; ... Resume with resume=auto' after a finished run and exited 1 before its run returned
    (a real 2-rank run whose rank 1 was 5 s slower there). Past its last collective a run is not watched."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    parent_code = _PARENT.replace("time.sleep(60)", "sys.stdin.readline()")  # then it exits normally, status 0
    parent = subprocess.Popen([sys.executable, "-c", parent_code, _SLOW_CHILD], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        parent.stdin.write("end\n")
        parent.stdin.flush()
        assert parent.wait(timeout=30) == 0
        assert parent.stdout.read().strip() == "finished"  # EOF once the child, which shares the pipe, has exited
        assert parent.stderr.read() == ""
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if _alive(parent.pid) else None
        os.kill(child, signal.SIGKILL) if _alive(child) else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie not yet reaped has exited
    except FileNotFoundError:
        return False


def test_only_ranks_that_lightning_launched_are_watched():
    assert not exit_when_the_launching_rank_dies(env={})  # rank 0, a single process
    assert not exit_when_the_launching_rank_dies(env={"LOCAL_RANK": "0"})
    for launcher in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):  # torchrun or srun starts and stops every rank itself
        assert not exit_when_the_launching_rank_dies(env={"LOCAL_RANK": "1", launcher: "1"})
    # (a rank 0 of train() that names itself launched the rank whatever keys it inherited: the kubernetes_pod case)
