"""The logs a resume cuts, put back when its fit fails before training starts.

A resume cuts the run's ``metrics.csv`` rows and marks its TensorBoard events replaced at the checkpoint's step
(:func:`lit_dtrain.loggers.build_logger`) before the fit loads the checkpoint: Lightning creates the logger's
experiment in its setup hook, then restores the module, datamodule, callbacks, optimizers and loops. A checkpoint
that one of those refuses (a FourierSampler table of other data, another optimizer's state, a strategy state of
another kind) stopped the run having trained nothing, with the rows of its last logged step (its final ``val/loss``)
gone for good, and its ``config_resolved.yaml`` and ``overrides.yaml`` (written at "training starts") labelled
the run with the refused start's values. :class:`LogsKeptUntilTraining` keeps what those files held and puts it
back when the run raises between the logger's build and ``on_train_start``, which Lightning calls after every
restore (a check on the way, as ddp_spawn's refusal, included); from then on, or once the fit returned, the cut
stands.

The copy is kept on disk (``<run dir>/.logs_kept``), not in memory: under Lightning's own DDP launcher a rank 1 that
refused alone exits first, and Lightning's observer of it SIGKILLs rank 0 within 5 s, wherever it is (a 2-rank
``resume=auto`` whose rank 0 took 8 s to load the checkpoint ended with status 137 and its ``metrics.csv`` cut from
7 lines to 5). The next start puts such a copy back (:func:`put_back_a_killed_starts_logs`). A stop signal that
comes while the files are put back waits for the put-back to end."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import threading
from pathlib import Path

from lit_dtrain.callbacks.preemption import STOP_SIGNALS
from lit_dtrain.run_dirs import CSV_NAME, EVENT_GLOB, event_dirs
from lit_dtrain.stops_before_training import (  # noqa: F401 - StoppedBeforeTraining, stopped_before_training: here too
    StoppedBeforeTraining,
    StopsBeforeTraining,
    stopped_before_training,
)
from lit_dtrain.utils.atomic import write_atomically

log = logging.getLogger(__name__)

# LossSpikeMonitor's events too: its on_train_start moves those of steps >= the resumed step to the superseded file,
# and a callback after it that refused there (before this one's on_train_start) left spikes.jsonl without them
RECORD = ("config_resolved.yaml", "overrides.yaml", "spikes.jsonl", "spikes.superseded.jsonl")
# a log dir's files that the loggers write (CSVLogger: both; TensorBoardLogger: hparams.yaml), the others left alone:
# a logger writing into the run dir itself (logger.name='') put back its train.log, which the job's log handler had
# open (the refusal's lines went to the removed file)
LOGGER_FILES = (CSV_NAME, "hparams.yaml")
KEPT_DIR = ".logs_kept"  # the copies (named by number: no reader of the run dir takes one for a metrics.csv)
MANIFEST = "kept.json"  # written last: a copy without it is incomplete, and nothing was cut yet


class LogsKeptUntilTraining(StopsBeforeTraining):
    """A callback and context manager (rank 0's, on a resume): built before the logger cuts the logs of
    ``run_dir``, it keeps a copy of the log dirs' :data:`LOGGER_FILES` (``metrics.csv``, ``hparams.yaml``) and
    :data:`RECORD` (train.py's record, ``spikes.jsonl``) in ``<run_dir>/.logs_kept``, with the names of the event
    files and dirs there; a run that raises inside it before training started gets them back: the files as they
    were, the event files written since (the purge marker, the new writer's) removed (an event file is never
    rewritten, only added), and the logger files and dirs made since (the other logger's empty ``tb/`` or ``csv/``
    of a refused logger switch) removed."""

    def __init__(self, run_dir: str | Path, resumed_step: int | None = None) -> None:
        super().__init__(resumed_step)  # the checkpoint's step, for the line of a stop signal
        self.run_dir = Path(run_dir)
        put_back_a_killed_starts_logs(self.run_dir)  # (train() did at its start: a project of one's own)
        kept = self.run_dir / KEPT_DIR
        dirs = _dirs(self.run_dir)
        # train.py's record of the run, rewritten before the fit, and every logger file (also of a dir without events)
        files = [path for path in (*(self.run_dir / name for name in RECORD),
                                   *(d / name for d in (self.run_dir, *dirs) for name in LOGGER_FILES))
                 if path.is_file()]
        events = [path for directory in event_dirs(self.run_dir) for path in directory.glob(EVENT_GLOB)]
        kept.mkdir(parents=True)
        for number, path in enumerate(files):
            shutil.copyfile(path, kept / str(number))
        manifest = {"files": [self._name(p) for p in files], "events": [self._name(p) for p in events],
                    "dirs": [self._name(p) for p in dirs]}
        write_atomically(kept / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest)))

    def _name(self, path: Path) -> str:
        return path.relative_to(self.run_dir).as_posix()

    keeps_logs = True

    def cut_stands(self) -> None:
        """Training started, or the fit returned (a finished run's restart never starts training): nothing is put back
        from now on."""
        super().cut_stands()
        _remove(self.run_dir / KEPT_DIR)

    def __enter__(self) -> LogsKeptUntilTraining:
        """SIGTERM and SIGHUP, where their action is the default, raise :class:`StoppedBeforeTraining` until training
        starts, so that the put-back runs: a SIGTERM while a refused resume set up (before Lightning's handler, which
        comes after the checkpoint's load) ended the process with 143 and left ``metrics.csv`` cut (step 4's rows)
        and ``config_resolved.yaml``/``overrides.yaml`` with the refused values."""
        super().__enter__()
        return self

    def put_back(self) -> None:
        put_back_kept_logs(self.run_dir)


def put_back_kept_logs(run_dir: str | Path) -> list[str] | None:
    """Put the copy in ``<run_dir>/.logs_kept`` back and remove it; returns the files written back or removed (their
    paths in ``run_dir``), None where there is no complete copy (an incomplete one is removed: nothing was cut yet).
    SIGINT, SIGTERM and SIGHUP wait until it is done: one that came midway left the rest cut (a SIGTERM in the
    put-back of ``config_resolved.yaml`` ended the process with 143, its ``metrics.csv`` still without step 4's rows).
    Each file is written back whole or not at all (:func:`write_atomically`)."""
    run_dir = Path(run_dir)
    kept = run_dir / KEPT_DIR
    if not (kept / MANIFEST).is_file():
        _remove(kept)
        return None
    manifest = json.loads((kept / MANIFEST).read_text())
    changed = []
    with stop_signals_wait():
        for number, name in enumerate(manifest["files"]):
            path, copy = run_dir / name, kept / str(number)
            if copy.is_file() and (not path.is_file() or not _same_bytes(path, copy)):
                write_atomically(path, lambda tmp, copy=copy: shutil.copyfile(copy, tmp))
                changed.append(name)
        written_before = set(manifest["files"]) | set(manifest["events"])
        for path in [*(p for d in event_dirs(run_dir) for p in d.glob(EVENT_GLOB)), *(run_dir / n for n in RECORD),
                     *(d / name for d in (run_dir, *_dirs(run_dir)) for name in LOGGER_FILES)]:
            name = path.relative_to(run_dir).as_posix()
            if name not in written_before and path.is_file():  # written since: the new writer's, the purge marker,
                path.unlink(missing_ok=True)  # a branch's record, the other logger's hparams.yaml
                changed.append(name)
        dirs = set(manifest["dirs"])
        for directory in sorted(_dirs(run_dir), key=lambda p: len(p.parts), reverse=True):
            if directory.relative_to(run_dir).as_posix() not in dirs:
                with contextlib.suppress(OSError):  # not empty: something else than the logger made it
                    directory.rmdir()
        _remove(kept)
    return changed


def put_back_a_killed_starts_logs(run_dir: str | Path) -> None:
    """At a start, on rank 0, holding the run dir's lock: a copy that a start killed before training left in
    ``run_dir`` (SIGKILL, the OOM killer, Lightning's observer of a rank 1 that refused alone) is put back."""
    if changed := put_back_kept_logs(run_dir):
        log.warning("%s: a resume killed before training had cut its logs; put back as they were: %s", run_dir,
                    ", ".join(changed))


def _remove(kept: Path) -> None:
    """The copy's manifest first: a kill while the copy is removed leaves no manifest to copies that are gone."""
    (kept / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(kept, ignore_errors=True)


def _dirs(run_dir: Path) -> list[Path]:
    """The dirs below ``run_dir`` (links not followed), but the copy's."""
    return [p for p in run_dir.rglob("*") if p.is_dir() and not p.is_symlink() and p.name != KEPT_DIR]


def _same_bytes(path: Path, copy: Path) -> bool:
    return path.stat().st_size == copy.stat().st_size and path.read_bytes() == copy.read_bytes()


@contextlib.contextmanager
def stop_signals_wait():
    """SIGINT, SIGTERM and SIGHUP that come in the block are delivered when it ends, to the handlers from before
    (the default one ends the process then). Outside the main thread, where no handler can be set, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    waiting = [s for s, handler in previous.items() if handler not in (None, signal.SIG_IGN)]
    for s in waiting:
        signal.signal(s, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for s in waiting:
            signal.signal(s, previous[s])
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)
