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

from pathlib import Path

import lightning as L

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
    whole and the names of their event files; a run that raises inside it before training started gets them back,
    and the event files written since (the purge marker, the new writer's) are removed
    (an event file is never rewritten, only added)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.training_started = False
        self._files: dict[Path, bytes] = {}
        self._events: set[Path] = set()
        for name in RECORD:  # train.py's record of the run, rewritten before the fit
            if (self.run_dir / name).is_file():
                self._files[self.run_dir / name] = (self.run_dir / name).read_bytes()
        for directory in event_dirs(self.run_dir) if self.run_dir.is_dir() else []:
            for path in directory.iterdir():
                if path.match(EVENT_GLOB):
                    self._events.add(path)
                elif path.name in LOGGER_FILES and path.is_file():
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
        for path, data in self._files.items():
            if not path.is_file() or path.read_bytes() != data:
                write_atomically(path, lambda tmp, data=data: tmp.write_bytes(data))
        for directory in event_dirs(self.run_dir) if self.run_dir.is_dir() else []:
            for path in directory.glob(EVENT_GLOB):
                if path not in self._events:
                    path.unlink(missing_ok=True)
