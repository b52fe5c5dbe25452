"""Loggers that survive an interrupted run: nothing logged before the last checkpoint is lost, and nothing
logged after it is shown twice.

:class:`ResumableCSVLogger`: Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts, so
a resumed run lost its whole history. This one keeps it, drops only the rows at ``step >= purge_step`` (what
the interrupted run logged past its last checkpoint, which the resumed run logs again), and carries the
file's columns over. A new metric (a wider header) rewrites the file atomically, so a full disk then keeps it whole.
``TensorBoardLogger`` already has ``purge_step``; ``train()`` passes
``purge_step=<resumed step>`` to either. (The Trainer calls ``logger.save()`` after every ``log_metrics``,
which writes CSV rows and flushes TensorBoard's writer, so a SIGKILL loses nothing already logged.)
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

log = logging.getLogger(__name__)


def purge_csv_metrics(path: Path, purge_step: int) -> list[str]:
    """Drop the rows of a Lightning ``metrics.csv`` logged at ``step >= purge_step``, atomically (a temp file
    and a rename). Returns the file's columns ([] when there is no file)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = list(reader.fieldnames or []), list(reader)
    if "step" not in fields:
        raise ValueError(f"{path} has no 'step' column, so it is not a Lightning metrics file: {fields[:8]}")
    keep = [r for r in rows if not r["step"] or float(r["step"]) < purge_step]
    if len(keep) < len(rows):
        write_csv_atomically(path, fields, keep)
        log.info("resume at step %d: dropped %d row(s) of %s logged after the checkpoint", purge_step,
                 len(rows) - len(keep), path)
    return fields


def write_csv_atomically(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Write ``rows`` under the header ``fields`` to a temp file beside ``path`` and rename it over ``path``: a full
    disk or a kill midway leaves the previous file whole (and no temp file, unless killed)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
