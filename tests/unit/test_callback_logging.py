"""callbacks._logging.log_step_metrics: the step, the rank, callback_metrics, and rows that reach the file."""

from __future__ import annotations

import csv
from types import SimpleNamespace

from lightning.pytorch.loggers import CSVLogger

from lit_dtrain.callbacks._logging import log_step_metrics


class Module:
    def __init__(self):
        self.logged = {}

    def log(self, name, value, **kwargs):
        assert kwargs["logger"] is False  # Lightning must not write it a second time, at its own cadence
        self.logged[name] = value


def test_rows_are_written_at_the_given_step_and_reach_the_csv_file(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    module = Module()
    log_step_metrics(SimpleNamespace(is_global_zero=True, loggers=[logger]), module, {"a/x": 1.5, "a/y": 2}, 7)
    # no logger.save() from Lightning here: a kill right after the write must not lose the row
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"a/x": "1.5", "a/y": "2.0", "step": "7"}]
    assert module.logged == {"a/x": 1.5, "a/y": 2.0}


def test_other_ranks_write_nothing(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    log_step_metrics(SimpleNamespace(is_global_zero=False, loggers=[logger]), Module(), {"a/x": 1.0}, 3)
    assert not (tmp_path / "csv" / "version_0" / "metrics.csv").exists()
