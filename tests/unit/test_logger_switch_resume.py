"""A run resumed with the other logger (``logger=csv`` killed, resumed with ``logger=tensorboard``, or the reverse):
the killed start's files hold nothing at the steps the resumed run trains again."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import OmegaConf

from lit_dtrain.loggers import ResumableCSVLogger
from lit_dtrain.run_dirs import read_scalars
from lit_dtrain.train import build_logger  # (train.py's, defined in lit_dtrain.loggers)
from tests.conftest import ROOT


def _cfg(run: Path, logger: str):
    return OmegaConf.create({"logger": OmegaConf.load(ROOT / "conf" / "logger" / f"{logger}.yaml"),
                             "paths": {"output_dir": str(run)}})


def _log(logger, steps, offset: float = 0.0) -> None:
    for step in steps:
        logger.log_metrics({"train/loss": offset + step}, step=step)
        logger.save()
    logger.finalize("success")


def _tensorboard_steps(directory: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss")]


@pytest.mark.parametrize("first, then", [("csv", "tensorboard"), ("tensorboard", "csv")])
def test_a_resume_with_the_other_logger_drops_the_killed_starts_points_past_the_checkpoint(tmp_path, first, then):
    """A start killed at step 11 whose checkpoint is at step 8, resumed with the other logger and another LR (real
    runs, model=nano): csv then tensorboard kept the killed start's rows 8-11 in csv/metrics.csv, and
    scripts/compare_runs.py (a CSV row wins a step) showed them, 4.2162 at step 9 where the resumed run logged
    4.1956; tensorboard then csv kept its points 8-10 in tb/, which TensorBoard shows."""
    run = tmp_path / "run"
    killed = (ResumableCSVLogger(run, name="csv", version="") if first == "csv"
              else TensorBoardLogger(run, name="tb", version="", purge_step=0, default_hp_metric=False))
    _log(killed, range(12))
    resumed = build_logger(_cfg(run, then), start_step=8)
    assert type(resumed).__name__ == ("TensorBoardLogger" if then == "tensorboard" else "ResumableCSVLogger")
    _log(resumed, range(8, 14), offset=100.0)
    assert read_scalars(run)["train/loss"] == [(s, float(s)) for s in range(8)] + [(s, 100.0 + s)
                                                                                 for s in range(8, 14)]
    if first == "csv":
        assert (run / "csv" / "metrics.csv").read_text().splitlines()[-1].startswith("7,")
    else:
        assert _tensorboard_steps(run / "tb") == list(range(8))  # what TensorBoard's reader shows


@pytest.mark.parametrize("first", ["csv", "tensorboard"])
def test_a_finished_run_validated_again_with_no_logger_keeps_its_last_validation(tmp_path, first):
    """A run finished at max_steps=10 (its last val/loss logged at step 10, real runs, model=nano), started again
    with resume=auto logger=none: nothing to train, only validated, and nothing logs step 10 again; the other
    loggers' purge cut val/loss at step 10 from metrics.csv, and TensorBoard's reader showed tb/'s val/loss empty.
    A start with no logger that trains on still drops the killed start's points past the checkpoint."""
    run = tmp_path / "run"
    finished = (ResumableCSVLogger(run, name="csv", version="") if first == "csv"
                else TensorBoardLogger(run, name="tb", version="", purge_step=0, default_hp_metric=False))
    _log(finished, range(10))
    finished.log_metrics({"val/loss": 3.25}, step=10)
    finished.finalize("success")
    cfg = OmegaConf.create({"logger": None, "paths": {"output_dir": str(run)}, "trainer": {"max_steps": 10}})
    assert build_logger(cfg, start_step=10) is False
    scalars = read_scalars(run)
    assert scalars["val/loss"] == [(10, 3.25)]
    assert scalars["train/loss"] == [(s, float(s)) for s in range(10)]
    if first == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(10, 3.25)]
    cfg.trainer.max_steps = 14  # a killed start's checkpoint at step 8: its points 8-9 are trained again
    build_logger(cfg, start_step=8)
    assert read_scalars(run)["train/loss"] == [(s, float(s)) for s in range(8)]
