"""A multirun job refused alike on every DDP rank is reported once, by rank 0: each rank ran its own Hydra sweep
(Lightning's launcher starts rank 1 with the same ``-m`` arguments), so each logged ``job 1 failed: ConfigError:
...`` on the console and, after the sweep, printed Hydra's four lines of it (``Error executing job with overrides:
[...]``, ``error: ...``, a blank line, ``Set the environment variable HYDRA_FULL_ERROR=1 ...``): 2 + 8 lines for one
refusal on 2 gloo ranks. A rank other than 0 whose line is rank 0's for that job now logs it to its job log only and
leaves the job to rank 0's report (its Hydra counts the job as done: the sweep's exit status is rank 0's); a line
that rank alone gives, or one rank 0 has not given within ``wait_s``, is reported as before. Which failures go to a
rank's job log files: :func:`failed_in_its_own_run`."""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_dtrain.utils.distributed import _exit_line_store

_KEY = "lit_dtrain/job_failure/job{}/rank{}"
_REPORTED_BY_RANK_0 = "_lit_dtrain_reported_by_rank_0"  # set on the error of a job rank 0 reports
JOB_ENV = "LIT_DTRAIN_SWEEP_JOB"  # '<pid>:<job>': rank 0's job while it runs (note_job), for the ranks it starts


def _job_of_parent() -> int | None:
    """The job whose fit started this process, where its parent (rank 0; Lightning's launcher starts the other ranks
    as its children) noted one: a value inherited from anywhere else (a shell, a test's process) is not this sweep's."""
    pid, _, job = os.environ.get(JOB_ENV, "").partition(":")
    return int(job) if pid.isdigit() and job.isdigit() and int(pid) == os.getppid() else None


_launched_at_job = _job_of_parent()  # read at import: this process's own jobs set it later


def note_job(job: int) -> None:
    """Put rank 0's ``job`` in the environment that Lightning's launcher copies for the ranks it starts (in the job's
    first fit): see :func:`ran_before_this_rank`."""
    os.environ[JOB_ENV] = f"{os.getpid()}:{job}"


def ran_before_this_rank(error: BaseException, job: int) -> bool:
    """Whether ``job`` came before the one whose fit started this rank (Lightning's launcher, which starts rank 1 with
    the same ``-m`` arguments: it runs the sweep from job 0 again). Rank 0 ran that job alone, refused before any fit,
    and reported it: ``-m trainer=ddp_cpu trainer.max_steps=-5,2`` logged 'job 0 failed' on both ranks and printed
    Hydra's four lines of it twice, rank 1's after its sweep, as no process group existed for
    :func:`rank_0_reports` at job 0. Marked on ``error`` for :func:`reported_by_rank_0`."""
    from lightning.pytorch.utilities import rank_zero_only

    if _launched_at_job is None or not (rank_zero_only.rank or 0) or job >= _launched_at_job:
        return False
    setattr(error, _REPORTED_BY_RANK_0, True)
    return True


def rank_0_reports(error: BaseException, job: int, line: str, wait_s: float = 2.0) -> bool:
    """Whether rank 0 reports ``job``'s failure ``line`` for this rank (a rank other than 0, in a process group of
    several ranks, whose ``line`` rank 0 gave too): marked on ``error`` for :func:`reported_by_rank_0`. Each rank leaves
    its line in the group's store; rank 0 waits up to ``wait_s`` for the others' lines, then for those ranks to have
    read its own (rank 0's process holds the store: a rank 1 still reading it when rank 0 ended its sweep got torch's
    'recvValue failed' and printed the lines again). Before the process group exists (a sweep's first jobs, refused
    before any fit) the store is torchrun's agent's, as for a run's last line (:func:`_exit_line_store`): with the
    group's alone, ``torchrun ... -m trainer.max_steps=-5,2`` still reported job 0 on both ranks. Best effort: no
    store (Lightning's launcher before the group), or none answering, is False."""
    store, rank, world_size = _exit_line_store()
    if store is None or world_size < 2:
        return False
    try:
        store.set(_KEY.format(job, rank), line)
        if rank == 0:
            others = [_KEY.format(job, r) for r in range(1, world_size)]
            _wait(lambda: store.check(others), wait_s)
            seen = [f"{k}/seen" for k in others if store.check([k])]
            _wait(lambda: store.check(seen), wait_s)
            return False
        key = _KEY.format(job, 0)
        _wait(lambda: store.check([key]), wait_s)
        same = store.check([key]) and store.get(key).decode(errors="replace") == line
        store.set(f"{_KEY.format(job, rank)}/seen", "1")
    except Exception:  # noqa: BLE001 - the store's host, rank 0, may be gone: this rank reports it
        return False
    setattr(error, _REPORTED_BY_RANK_0, same)
    return same


def _wait(done, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def reported_by_rank_0(error: BaseException) -> bool:
    """Whether :func:`rank_0_reports` left ``error``'s job to rank 0."""
    return bool(getattr(error, _REPORTED_BY_RANK_0, False))


_trains = [False]  # this process's start of the current run or job passed its checks and trains


def job_starts(cfg: DictConfig) -> tuple[int, int] | None:
    """A run or job starts (:func:`~lit_dtrain.sweeps.logs_a_failed_job`): the identity of its run dir's
    ``config_resolved.yaml`` before it, for :func:`failed_in_its_own_run`."""
    _trains[0] = False
    return _config_file_id(cfg)


def note_training_start() -> None:
    """On every rank, where ``train(cfg)`` passed its checks and trains (rank 0 rewrote ``config_resolved.yaml``)."""
    _trains[0] = True


def failed_in_its_own_run(cfg: DictConfig, earlier: tuple[int, int] | None) -> bool:
    """Whether a failure is this start's own run's, for its job log: not a start refused in the dir of an earlier or
    running run, whose ``config_resolved.yaml`` it did not replace. A rank other than 0 writes none: rank 0 wrote it
    before the launcher started rank 1 (a job's first fit), or while rank 1 entered the job, and rank 1's job log
    (``train_ddp_process_1.log``) never said why its job failed after its checks (a refusal at the fit's start)."""
    return earlier is None or _trains[0] or _config_file_id(cfg) != earlier


def _config_file_id(cfg: DictConfig) -> tuple[int, int] | None:
    """The identity (inode, mtime) of the run dir's ``config_resolved.yaml``, which ``train(cfg)`` writes (by a
    rename: a new inode) when a start passed its checks and trains; None without one."""
    try:
        out_dir = OmegaConf.select(cfg, "paths.output_dir", throw_on_resolution_failure=False)
        stat = (Path(str(out_dir)) / "config_resolved.yaml").stat()
    except (OSError, ValueError, TypeError):
        return None
    return stat.st_ino, stat.st_mtime_ns
