"""One training process per run dir: ``train()`` holds an exclusive ``flock`` on ``<run dir>/.train.lock`` (rank 0)
while it trains, and a second start in that run dir is refused in one line naming the process that holds it.

Two starts of one command (a double submission, a job started again while the first still runs) trained side by side
in one run dir: both wrote ``last.ckpt``, the step files, ``metrics.csv`` and ``summary.json`` in turn, and what was
left mixed the two runs (or one ended with an error of the CSV logger). The kernel drops the lock when its process
ends, however it ends (SIGKILL, OOM): a requeued job or a restart after a crash takes it at once. On a shared
filesystem the lock of a process on another host that died with its node is dropped only when the server notices
(NFSv4: its lease, ~90 s), so a lock held from another host is waited for up to ``OTHER_HOST_WAIT_S`` first. A
filesystem without locks (Lustre mounted without ``flock``) or a platform without ``fcntl``: no lock, no check.

A ``paths.checkpoint_dir`` outside the run dir (given elsewhere, or a symbolic link out of it) is locked too
(:func:`hold_checkpoint_dir`): two runs of different ``run_name``s given one ``checkpoint_dir`` trained into it side by
side, each exited 0 naming ``last.ckpt``, which held only one of them (the other's was ``last-v1.ckpt``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import IO

from lit_dtrain.errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger("lit_dtrain.train")

LOCK_NAME = ".train.lock"
OTHER_HOST_WAIT_S = 120.0


def hold_run_dir(run_dir: str | os.PathLike, wait_s: float = OTHER_HOST_WAIT_S) -> IO | None:
    """Take ``<run_dir>/.train.lock`` for this process (created with ``run_dir`` if missing) and return its open file,
    to :func:`release_run_dir` at the end; None where locks are not available. ``ConfigError`` naming the holder when
    another process holds it (one on another host: after waiting up to ``wait_s`` seconds for it)."""
    return _hold(Path(run_dir) / LOCK_NAME, f"run dir {str(run_dir)!r}", "choose another run_name", wait_s)


def hold_checkpoint_dir(checkpoint_dir: str | os.PathLike, run_dir: str | os.PathLike,
                        wait_s: float = OTHER_HOST_WAIT_S) -> IO | None:
    """Where ``checkpoint_dir`` (resolved) is not inside ``run_dir``, lock it as :func:`hold_run_dir` locks a run dir,
    with ``.<its name>.train.lock`` beside it (inside it, Lightning warned at every fresh start that the checkpoint dir
    is not empty); None where it is inside, where locks are not available, or the lock file cannot be created there."""
    ckpt, run = Path(checkpoint_dir).resolve(), Path(run_dir).resolve()
    if ckpt == run or run in ckpt.parents:
        return None
    try:
        return _hold(ckpt.parent / f".{ckpt.name}{LOCK_NAME}", f"checkpoint dir {str(checkpoint_dir)!r}",
                     "give this run its own paths.checkpoint_dir", wait_s)
    except PermissionError as e:  # a parent this user cannot write: no lock, as on a filesystem without locks
        log.debug("no lock for %s: %s", checkpoint_dir, e)
        return None


def _hold(path: Path, what: str, advice: str, wait_s: float) -> IO | None:
    if fcntl is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115 (held open while training)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            host = re.search(r" on (\S+) \(since ", holder)
            other_host = host is not None and host.group(1) != socket.gethostname()
            if other_host and time.monotonic() < deadline:
                log.warning("%s is locked by %s; waiting up to %.0f s for it (a crashed node's lock)", what, holder,
                            wait_s)
                time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
                continue
            f.close()
            raise ConfigError(
                f"{what} is in use: {holder} is training in it (it holds {str(path)!r}); wait for it to end, or "
                f"{advice}"
            ) from None
        except OSError as e:  # ENOLCK, EINVAL ...: a filesystem without locks
            f.close()
            log.debug("no lock on %s: %s", path, e)
            return None
    f.seek(0)
    f.truncate()
    f.write(f"process {os.getpid()} on {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
    f.flush()
    return f


def release_run_dir(lock: IO | None) -> None:
    """Drop a lock :func:`hold_run_dir` took (the file stays: removing it would let a waiting start lock a removed
    file while a third one creates a new one)."""
    if lock is not None:
        with contextlib.suppress(OSError):
            lock.close()
