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
stands."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import lightning as L

from lit_dtrain.callbacks.preemption import STOP_SIGNALS
from lit_dtrain.run_dirs import CSV_NAME, EVENT_GLOB, event_dirs
from lit_dtrain.utils.atomic import write_atomically

RECORD = ("config_resolved.yaml", "overrides.yaml")
# a log dir's files that the loggers write (CSVLogger: both; TensorBoardLogger: hparams.yaml), the others left alone:
# a logger writing into the run dir itself (logger.name='') put back its train.log, which the job's log handler had
# open (the refusal's lines went to the removed file)
LOGGER_FILES = (CSV_NAME, "hparams.yaml")


class LogsKeptUntilTraining(L.Callback):
    """A callback and context manager (rank 0's, on a resume): built before the logger cuts the logs of
    ``run_dir``, it keeps the log dirs' :data:`LOGGER_FILES` (``metrics.csv``, ``hparams.yaml``) and :data:`RECORD`
    whole and the names of their event files and dirs; a run that raises inside it before training started gets them
    back: the event files written since (the purge marker, the new writer's) are removed (an event file is never
    rewritten, only added), and so are the logger files and dirs made since (a refused logger switch left the other
    logger's empty ``tb/`` or ``csv/``)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.training_started = False
        self._files: dict[Path, bytes] = {}
        self._events: set[Path] = set()
        self._dirs = set(_dirs(self.run_dir))
        for name in RECORD:  # train.py's record of the run, rewritten before the fit
            if (self.run_dir / name).is_file():
                self._files[self.run_dir / name] = (self.run_dir / name).read_bytes()
        for directory in event_dirs(self.run_dir) if self.run_dir.is_dir() else []:
            self._events.update(directory.glob(EVENT_GLOB))
        for path in (d / name for d in (self.run_dir, *self._dirs) for name in LOGGER_FILES):  # (also of no log dir)
            if path.is_file():
                self._files[path] = path.read_bytes()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.training_started = True

    def cut_stands(self) -> None:
        """The fit returned (a finished run's restart never starts training): nothing is put back from now on."""
        self.training_started = True

    def __enter__(self) -> LogsKeptUntilTraining:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.training_started:
            self.put_back()

    def put_back(self) -> None:
        """Each file is written back whole or not at all (:func:`write_atomically`), and SIGINT, SIGTERM and SIGHUP
        wait until the put-back is done: a SIGTERM while ``config_resolved.yaml`` was put back ended the process with
        143, its ``metrics.csv`` still without step 4's rows."""
        with stop_signals_wait():
            self._put_back()

    def _put_back(self) -> None:
        for path, data in self._files.items():
            if not path.is_file() or path.read_bytes() != data:
                write_atomically(path, lambda tmp, data=data: tmp.write_bytes(data))
        if not self.run_dir.is_dir():
            return
        for path in [*(p for d in event_dirs(self.run_dir) for p in d.glob(EVENT_GLOB)),
                     *(self.run_dir / name for name in RECORD),
                     *(d / name for d in (self.run_dir, *_dirs(self.run_dir)) for name in LOGGER_FILES)]:
            if path not in self._events and path not in self._files and path.is_file():  # written since: the new
                path.unlink(missing_ok=True)  # writer's events, the purge marker, a branch's record, hparams.yaml
        for directory in sorted(_dirs(self.run_dir), key=lambda p: len(p.parts), reverse=True):
            if directory not in self._dirs:
                with contextlib.suppress(OSError):  # not empty: something else than the logger made it
                    directory.rmdir()


def _dirs(run_dir: Path) -> list[Path]:
    """The dirs below ``run_dir`` (links not followed)."""
    return [p for p in run_dir.rglob("*") if p.is_dir() and not p.is_symlink()] if run_dir.is_dir() else []


@contextlib.contextmanager
def stop_signals_wait():
    """SIGINT, SIGTERM and SIGHUP that come in the block are delivered when it ends, to the handlers from before
    (the default one ends the process then); an ignored one stays ignored. Outside the main thread, where no handler
    can be set, a no-op."""
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
