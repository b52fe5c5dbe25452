"""The line a SIGTERM'd run prints names how to resume it with this run's own names: a real sweep job killed by
SIGTERM said 'Resume with resume=auto (same run_name; a multirun job: the same -m arguments with
hydra.sweep.dir=<its sweep dir>)', leaving its sweep dir (a start time by default) to be worked out from the path."""

from __future__ import annotations

import pytest
from hydra.types import RunMode

from lit_dtrain.train import train
from tests.unit._sweep_helpers import multirun_job
from tests.unit.test_preemption_signals import kill_at


@pytest.mark.parametrize("mode", [RunMode.MULTIRUN, RunMode.RUN])
def test_a_stopped_run_names_its_sweep_dir_or_run_name_to_resume(tmp_path, corpus, caplog, mode):
    job_dir = tmp_path / "multiruns" / "2026-12-06_01-56-15.211234" / "1"
    job = ["seed=1", "trainer.max_steps=6", "trainer.val_check_interval=6", "run_name=exp 1", *kill_at(2, "SIGTERM")]
    with multirun_job(job_dir, ["seed=0,1"], job, corpus, mode=mode) as cfg, pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 143
    resume = (f"the same -m arguments and resume=auto hydra.sweep.dir={job_dir.parent}."
              if mode == RunMode.MULTIRUN else "resume=auto 'run_name=exp 1' or ckpt_path=<that file>.")
    assert f"at step 3; exiting cleanly. Resume with {resume}" in caplog.text
