"""Exact results of the cut of the other logger's files at a resume (``purge_other_loggers``) where single-point
mutants passed test_logger_switch_resume.py (tenth hand mutation audit): a third start, back with the first logger,
still cuts the second's files (its own dir is passed over, not the end of the list), a logger's files in a
``version_N`` dir below the run dir are found, and only rank 0 rewrites them."""

from __future__ import annotations

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lit_dtrain.loggers import ResumableCSVLogger, build_logger
from lit_dtrain.run_dirs import read_scalars
from tests.unit.test_logger_switch_resume import _cfg, _log, _tensorboard_steps


def test_a_third_start_back_with_the_first_logger_still_cuts_the_seconds_files(tmp_path):
    """csv to step 5 (checkpoint at 4), tensorboard from 4 killed at 9 (checkpoint at 8), csv again from 8: csv/ is
    this start's own (cut by its own purge_step) and sorts before tb/, whose points 8-9 must be cut too."""
    run = tmp_path / "run"
    _log(ResumableCSVLogger(run, name="csv", version=""), range(6))
    _log(build_logger(_cfg(run, "tensorboard"), start_step=4), range(4, 10), offset=100.0)
    _log(build_logger(_cfg(run, "csv"), start_step=8), range(8, 12), offset=200.0)
    expected = [(s, float(s)) for s in range(4)] + [(s, 100.0 + s) for s in range(4, 8)]
    assert read_scalars(run)["train/loss"] == expected + [(s, 200.0 + s) for s in range(8, 12)]
    assert _tensorboard_steps(run / "tb") == [4, 5, 6, 7]


def test_a_loggers_files_in_a_version_dir_are_cut_too(tmp_path):
    """logger=tensorboard with its version unset (TensorBoardLogger's version_0) killed at 11, resumed at 8 with csv."""
    run = tmp_path / "run"
    _log(TensorBoardLogger(run, name="tb", purge_step=0, default_hp_metric=False), range(12))
    assert (run / "tb" / "version_0").is_dir()
    _log(build_logger(_cfg(run, "csv"), start_step=8), range(8, 14), offset=100.0)
    assert read_scalars(run)["train/loss"] == [(s, float(s)) for s in range(8)] + [(s, 100.0 + s) for s in range(8, 14)]
    assert _tensorboard_steps(run / "tb" / "version_0") == list(range(8))


def test_only_rank_0_cuts_the_other_loggers_files(tmp_path, monkeypatch):
    """Each rank builds its logger; two ranks rewriting one metrics.csv (or each adding a purge marker) would race."""
    run = tmp_path / "run"
    _log(ResumableCSVLogger(run, name="csv", version=""), range(12))
    before = (run / "csv" / "metrics.csv").read_text()
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    build_logger(_cfg(run, "tensorboard"), start_step=8)
    assert (run / "csv" / "metrics.csv").read_text() == before
