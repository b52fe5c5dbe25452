"""Loggers that survive an interrupted run: nothing logged before the last checkpoint is lost, and nothing
logged after it is shown twice.

:class:`ResumableCSVLogger`: Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts, so
a resumed run lost its whole history. This one keeps it, drops only the rows at ``step >= purge_step`` (what
the interrupted run logged past its last checkpoint, which the resumed run logs again), and carries the
file's columns over. A new metric (a wider header) rewrites the file atomically, so a full disk then keeps it whole.
``TensorBoardLogger`` already has ``purge_step``; ``train()`` passes
``purge_step=<resumed step>`` to either, and cuts the other one's files in the run dir at that step (a resume with
the other logger: :func:`purge_other_loggers`). (The Trainer calls ``logger.save()`` after every ``log_metrics``,
which writes CSV rows and flushes TensorBoard's writer, so a SIGKILL loses nothing already logged.)

:class:`ConfigHparams`: the run's resolved config in TensorBoard's HParams view, written once per run dir (a
resumed run does not add a second entry).
"""

from __future__ import annotations

import csv
import io
import logging
import mmap
import os
from pathlib import Path

import lightning as L
from hydra.utils import get_class, instantiate
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from lit_dtrain.run_dirs import CSV_NAME, EVENT_GLOB, event_dirs, without_cut_line
from lit_dtrain.utils.atomic import write_atomically

log = logging.getLogger(__name__)


def purge_csv_metrics(path: Path, purge_step: int) -> list[str]:
    """Drop the rows of a Lightning ``metrics.csv`` logged at ``step >= purge_step``, atomically (a temp file
    and a rename). Returns the file's columns ([] when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        raw = f.read()
    text, cut = without_cut_line(raw)
    if cut:  # a kill while Lightning appended rows (they are flushed in batches, so its step can be below purge_step)
        # was kept: the resume appended its first row to it (a damaged line that stopped compare_runs.py), or, where
        # rows were dropped, rewrote it as a whole row (',0.003,0.003,1' cut from step 13's: step 13's LR at step 1)
        log.warning("%s: its last line %r has no line end (the run was killed while writing it); dropped", path,
                    cut[:80])
    if not text:  # cut in its header: no row to keep
        path.unlink()
        return []
    reader = csv.DictReader(io.StringIO(text, newline=""))
    fields, rows = list(reader.fieldnames or []), list(reader)
    if "step" not in fields:
        raise ValueError(f"{path} has no 'step' column, so it is not a Lightning metrics file: {fields[:8]}")
    keep = [r for r in rows if not r["step"] or float(r["step"]) < purge_step]
    if len(keep) < len(rows) or text != raw:  # (also a last row whose \n was cut: written whole)
        write_csv_atomically(path, fields, keep)
        log.info("resume at step %d: dropped %d row(s) of %s logged after the checkpoint", purge_step,
                 len(rows) - len(keep), path)
    return fields


def write_csv_atomically(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Write ``rows`` under the header ``fields`` to ``path`` with :func:`lit_dtrain.utils.atomic.write_atomically`:
    a full disk or a kill midway leaves the previous file whole (and no temp file, unless killed); an OS error is an
    ``AtomicWriteError`` (an ``OSError``) naming ``path``."""

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)


class _ResumableExperimentWriter(ExperimentWriter):
    def __init__(self, log_dir: str, purge_step: int | None) -> None:
        self._purge_step = purge_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if self._purge_step is None or not os.path.isfile(self.metrics_file_path):
            super()._check_log_dir_exists()  # a fresh run: Lightning's behaviour (an old file is replaced)
            return
        self.metrics_keys = sorted(purge_csv_metrics(Path(self.metrics_file_path), self._purge_step))

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """A new metric widens the header: Lightning truncated the file and wrote it again, so a full disk or a kill
        in between lost the whole history. Atomic here; on failure the columns are the file's again, so the next
        ``save()`` (which still holds the unsaved rows) retries the rewrite instead of appending wider rows."""
        path = Path(self.metrics_file_path)
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            old_fields, rows = list(reader.fieldnames or []), list(reader)
        try:
            write_csv_atomically(path, fieldnames, rows)
        except BaseException:
            self.metrics_keys = sorted(old_fields)
            raise


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` plus ``purge_step``: with it set (a resumed run), the existing
    ``metrics.csv`` is kept up to ``purge_step`` and appended to, instead of deleted. Local files only."""

    def __init__(self, *args, purge_step: int | None = None, **kwargs) -> None:
        import inspect

        from lit_dtrain.utils.args import is_number

        # Lightning's CSVLogger takes 0 and fails at its first save, 'integer modulo by zero' (a traceback after the
        # run trained: logger=csv +logger.flush_logs_every_n_steps=0)
        every = inspect.signature(CSVLogger).bind(*args, **kwargs).arguments.get("flush_logs_every_n_steps", 100)
        if not (is_number(every) and every >= 1 and every % 1 == 0):
            raise ValueError(f"ResumableCSVLogger: flush_logs_every_n_steps must be an integer >= 1, got {every!r}")
        super().__init__(*args, **kwargs)
        self.purge_step = purge_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _ResumableExperimentWriter(self.log_dir, self.purge_step)
        return self._experiment


def build_logger(cfg, start_step: int):
    """The configured logger, or False. On a resume at ``start_step`` > 0 it gets ``purge_step=start_step``
    (TensorBoard, and lit_dtrain's ``ResumableCSVLogger`` behind ``logger=csv``): what the interrupted run
    logged past its last checkpoint is dropped, so a resumed curve continues the old one instead of
    doubling back over it, and the history before it is kept. TensorBoard gets it at a start from step 0 too:
    a start killed before its first checkpoint left points that the next start, from step 0 again, logs anew
    (they were shown twice, the curve doubling back to 0), and every start's ``SessionLog.START`` makes a later
    one's purge count in TensorBoard's Python reader, which takes a run's first START for no restart.
    (``CSVLogger`` replaces ``metrics.csv`` at a fresh start itself.) The other logger's files in the run dir are
    purged at that step too (:func:`purge_other_loggers`), on rank 0; past it where no logger logs the checkpoint's
    step again (``logger=none`` at ``trainer.max_steps``, a finished run that is only validated)."""
    node = cfg.get("logger")
    logger = _instantiate_logger(node, start_step) if node else False
    if rank_zero_only.rank == 0:
        # (a finished run resumed with logger=none lost its last validation: val/loss at step 10 was cut from
        # metrics.csv and hidden in tb/, which TensorBoard then showed empty, and nothing logged it again)
        max_steps = OmegaConf.select(cfg, "trainer.max_steps")
        validated_only = not logger and isinstance(max_steps, int) and 0 < max_steps <= start_step
        purge_other_loggers(Path(cfg.paths.output_dir), start_step + validated_only, getattr(logger, "log_dir", None))
        if start_step == 0:
            warn_about_another_runs_logs(getattr(logger, "log_dir", None), Path(cfg.paths.output_dir))
    return logger


def warn_about_another_runs_logs(log_dir: str | None, run_dir: Path) -> None:
    """A fresh start whose logger dir lies outside its run dir (``logger.save_dir=/abs/path``; the configs' loggers
    have no version folder) and already holds event files or a ``metrics.csv``: two runs given one save_dir wrote
    into one ``tb/``, which TensorBoard shows as one run, the second start's ``purge_step=0`` hiding the first's
    59 points of a 4-step run (``csv/metrics.csv``: replaced), without a word."""
    if not log_dir or (here := Path(log_dir).resolve()).is_relative_to(run_dir.resolve()) or not here.is_dir():
        return
    if any(here.glob(EVENT_GLOB)) or (here / CSV_NAME).is_file():
        log.warning("%s already holds another start's logs: this fresh start's logs join them (TensorBoard shows one "
                    "run, hiding the earlier points; a metrics.csv is replaced); give each run its own "
                    "logger.save_dir, or logger.version=<run name>", here)


def _instantiate_logger(node, start_step: int):
    extra = {}
    cls = get_class(node._target_)
    if "purge_step" not in node:
        if issubclass(cls, TensorBoardLogger) or (start_step > 0 and issubclass(cls, ResumableCSVLogger)):
            extra["purge_step"] = start_step
        elif start_step > 0 and issubclass(cls, CSVLogger):
            log.warning("resuming with Lightning's CSVLogger, which deletes the existing metrics.csv; use "
                        "logger=csv (lit_dtrain.loggers.ResumableCSVLogger) to keep it")
    return instantiate(node, **extra)


def purge_other_loggers(run_dir: Path, start_step: int, own_log_dir: str | None) -> None:
    """Drop what the files of another logger than this start's hold at steps ``>= start_step`` in ``run_dir``:
    a start with ``logger=csv`` killed at step 11 and resumed at 8 with ``logger=tensorboard`` kept the killed
    start's rows 8-11 in ``csv/metrics.csv``, which ``scripts/compare_runs.py`` (a CSV row wins a step) showed in
    place of the resumed run's values; the reverse kept the killed start's points in ``tb/``, which TensorBoard shows.
    A ``metrics.csv`` is cut (:func:`purge_csv_metrics`); an event dir gets a file holding TensorBoard's own purge
    marker (a ``SessionLog.START`` at ``start_step``, as ``purge_step`` writes), which its readers apply to the
    earlier files. ``own_log_dir``: this start's logger's dir, which its own ``purge_step`` handles."""
    own = Path(own_log_dir).resolve() if own_log_dir else None
    for directory in event_dirs(run_dir) if run_dir.is_dir() else []:
        if directory.resolve() == own:
            continue
        if (directory / CSV_NAME).is_file():
            purge_csv_metrics(directory / CSV_NAME, start_step)
        if any(directory.glob(EVENT_GLOB)):
            from torch.utils.tensorboard import SummaryWriter

            SummaryWriter(str(directory), purge_step=start_step).close()
            log.info("start at step %d: TensorBoard events of %s at steps >= %d are marked replaced (purge_step)",
                     start_step, directory, start_step)


def flat_hparams(config: dict | list, prefix: str = "") -> dict[str, bool | int | float | str]:
    """The scalar leaves of a plain (resolved) config, keyed by their dotted path (``optimizer.lr``; list items by
    index: ``optimizer.betas.0``). Null leaves are left out: TensorBoard has no null value, and the string 'None'
    would turn a numeric column of a sweep (``gradient_clip_val=null,1.0``) into text; an empty cell says it."""
    items = config.items() if isinstance(config, dict) else enumerate(config)
    flat: dict[str, bool | int | float | str] = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)):
            flat.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif value is not None:
            flat[name] = str(value)
    return flat


_SESSION_START_TAG = b"_hparams_/session_start_info"  # tensorboard.plugins.hparams.metadata.SESSION_START_INFO_TAG


class ConfigHparams(L.Callback):
    """Writes ``hparams`` (e.g. :func:`flat_hparams` of the resolved config) to each ``TensorBoardLogger`` as an
    HParams session (a ``SessionStartInfo``, TensorBoard's ``hparams_pb``), at the start of training on rank 0.

    Lightning's ``log_hyperparams`` writes the module's saved hyperparameters, which ``LitLLM`` has none of, and
    with ``metrics`` logs them as scalars at step 0, a point on the ``val/loss`` curve. Only the session is written
    here, no experiment summary: TensorBoard then builds the table's columns from every run's session (a sweep over
    ``data/sampler=random,fourier`` shows the keys of both; one run's experiment summary would define the columns of
    all) and its metric columns from the runs' scalars: the last ``val/loss`` is the final validation's. A run dir
    whose event files already hold a session (a resumed run) gets none: TensorBoard keeps the first per run and
    ignores the rest, so the table shows the config the run was started with. A start from step 0 writes its
    session whatever the files hold: ``train()`` gives its TensorBoard logger ``purge_step=0``, which hides the
    events of an earlier start killed before its first checkpoint, that start's session included."""

    def __init__(self, hparams: dict) -> None:
        self.hparams = hparams

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and (trainer.global_step == 0
                                                          or not has_hparams_session(logger.log_dir)):
                logger.experiment._get_file_writer().add_summary(hparams_pb(self.hparams))
                logger.experiment.flush()


def has_hparams_session(log_dir: str | os.PathLike) -> bool:
    """Whether a TensorBoard event file in ``log_dir`` holds an HParams session (a byte search: TensorBoard itself
    would parse every event of every file)."""
    for path in Path(log_dir).glob("events.out.tfevents.*"):
        if path.stat().st_size == 0:
            continue
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(_SESSION_START_TAG) >= 0:
                return True
    return False
