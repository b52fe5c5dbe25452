"""``python train.py -m ...``: what a sweep reports about its jobs."""

import json
import logging
import subprocess
from pathlib import Path

import pytest

from lit_dtrain.train import train
from tests.conftest import PYTHON, ROOT, TINY, subprocess_env
from tests.unit._compare_runs_helpers import compare_runs


def test_every_failed_sweep_job_says_why_in_its_own_dir(tmp_path, corpus):
    """`python train.py -m optimizer.lr=-5,1e-3,-6`: Hydra runs every job and, at the end, prints the error of the
    first failed one only. Job 2's 'optimizer.lr must be > 0, got -6' was written nowhere: its dir held .hydra/
    and an empty train.log. Each failed job now logs its error to its train.log (and the console) as it fails."""
    args = ["-m", *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "optimizer.lr=-5,-6"]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multiruns").iterdir()
    for job, lr in (("0", "-5"), ("1", "-6")):
        log = (sweep / job / "train.log").read_text()
        assert f"job {job} failed: ConfigError: optimizer.lr must be > 0, got {lr}" in log, log
    assert "job 1 failed: ConfigError: optimizer.lr must be > 0, got -6" in proc.stdout + proc.stderr
    # a bad value: Hydra's report after the sweep is the first failed job's error in one line, with no traceback
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\nerror: optimizer.lr must be > 0, got -5\n" in proc.stderr, proc.stderr[-3000:]


def test_a_diverged_run_without_the_finite_check_still_reports_its_nan(tiny_cfg, caplog):
    """An LR sweep with module.check_finite=false lets a too-high LR diverge, which is a result to compare: job
    'optimizer.lr=1e4' trained to the end with NaN weights, then died in the end-of-run text sample with
    'RuntimeError: probability tensor contains either `inf`, `nan` or element < 0' (torch.multinomial), after its
    last checkpoint and before summary.json, so the sweep listed it as failed. The sample is skipped now, with a
    warning, and summary.json reports val_loss null (NaN)."""
    # train() in this process, on the config train.py composes (a train.py process cost ~5 s of imports): an error
    # in the end-of-run sample would raise here
    cfg = tiny_cfg("optimizer.lr=1e4", "module.check_finite=false", "trainer.gradient_clip_val=null", run="diverged")
    with caplog.at_level(logging.WARNING):
        _, objects = train(cfg)
    summary = json.loads((Path(objects["trainer"].default_root_dir) / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["val_loss"] is None
    assert "no text sample: the model's weights are not finite" in caplog.text


def test_an_experiment_sweep_run_without_dash_m_says_it_runs_one_job(tmp_path, corpus):
    """`python train.py experiment=wsd_vs_cosine` (the README's command without -m) silently trained one run,
    scheduler=wsd at the default optimizer.lr, for the 1000 steps meant for each of 6 jobs: Hydra ignores
    hydra.sweeper.params outside a multirun. It now warns which grid it does not sweep, before training."""
    args = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "experiment=wsd_vs_cosine",
            "optimizer.lr=-1"]  # fails in check_config, after the warning: nothing is trained
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "optimizer.lr must be > 0, got -1" in out, out[-3000:]
    assert ("this config sweeps scheduler=wsd,cosine optimizer.lr=1e-3,3e-3,1e-2 (hydra.sweeper.params) only with "
            "-m; without it this is one run") in out, out[-3000:]


def test_resuming_a_sweep_with_its_values_in_another_order_is_refused(tmp_path, corpus):
    """resume=auto with hydra.sweep.dir=<old sweep> resumes job N from <dir>/N. Re-run with the swept values in
    another order ('optimizer.lr=3e-3,1e-3' after '1e-3,3e-3'), job 0 resumed the lr=1e-3 run's checkpoint, trained
    on to step 70 and was relabelled optimizer.lr=0.003 (its .hydra/overrides.yaml), silently. A job whose earlier
    config_resolved.yaml holds another value of a swept key is refused now, naming both values."""
    base = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "sample.max_new_tokens=0"]
    env = subprocess_env(tmp_path)

    def sweep(*args):
        return subprocess.run([PYTHON, str(ROOT / "train.py"), "-m", *base, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    first = sweep("optimizer.lr=1e-3,3e-3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (sweep_dir,) = (tmp_path / "outputs" / "multiruns").iterdir()
    resume = ["resume=auto", f"hydra.sweep.dir={sweep_dir}", "trainer.max_steps=9"]
    swapped = sweep("optimizer.lr=3e-3,1e-3", *resume)
    out = swapped.stdout + swapped.stderr
    assert swapped.returncode == 1, out[-3000:]
    assert (f"job 0 failed: ConfigError: resume=auto: {sweep_dir / '0'} was trained with optimizer.lr=0.001, this "
            "job sets optimizer.lr=0.003") in out, out[-3000:]
    assert json.loads((sweep_dir / "0" / "summary.json").read_text())["steps"] == 6  # not trained on
    # Hydra rewrites a job's .hydra/overrides.yaml before the job runs, refused or not: compare_runs labelled the
    # lr=1e-3 run 'optimizer.lr=3e-3' from it. It reads overrides.yaml, written by the start that trained the run.
    assert "- optimizer.lr=0.003\n" in (sweep_dir / "0" / ".hydra" / "overrides.yaml").read_text()
    runs = compare_runs.compare([str(sweep_dir)], ["val/loss"])["runs"]
    assert {r["dir"]: r["label"] for r in runs} == {
        str(sweep_dir / "0"): "optimizer.lr=0.001", str(sweep_dir / "1"): "optimizer.lr=0.003"}
    same = sweep("optimizer.lr=1e-3,3e-3", *resume)
    assert same.returncode == 0, same.stdout[-2000:] + same.stderr[-2000:]
    assert [json.loads((sweep_dir / j / "summary.json").read_text())["steps"] for j in "01"] == [9, 9]


def test_resume_auto_without_a_sweep_dir_is_refused_before_hydra_writes_one(tmp_path, corpus):
    """`python train.py -m ... resume=auto` without hydra.sweep.dir is refused (nothing to resume in a new sweep
    dir), but each job refused it only after Hydra had created the new sweep dir, its multirun.yaml and a dir per
    job with .hydra/ and train.log: every refused start left a sweep of nothing in outputs/multiruns, which
    compare_runs then listed. The start is refused now before Hydra writes anything, in one line; with
    hydra.sweep.dir it runs (a dir that does not exist yet: each job starts fresh, and a warning says so once)."""
    args = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "sample.max_new_tokens=0",
            "optimizer.lr=1e-3,3e-3", "resume=auto"]
    env = subprocess_env(tmp_path)
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), "-m", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    new = tmp_path / "outputs" / "multiruns"
    assert line.startswith(f"error: resume=auto in a multirun needs hydra.sweep.dir=<the sweep to continue>: "
                           f"without it this start writes a new sweep dir '{new}/"), line
    assert not (tmp_path / "outputs").exists()
    sweep_dir = tmp_path / "outputs" / "multiruns" / "given"
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), "-m", *args, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [json.loads((sweep_dir / j / "summary.json").read_text())["steps"] for j in "01"] == [6, 6]
    # a mistyped hydra.sweep.dir retrained every job from scratch with only an INFO line per job: it is said once
    out = proc.stdout + proc.stderr
    assert out.count(f"resume=auto: the sweep dir {sweep_dir} does not exist, so every job starts fresh") == 1, out


@pytest.mark.parametrize("name, status", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_sigterm_in_a_jobs_end_of_run_sample_stops_the_sweep_after_that_job(tmp_path, corpus, name, status):
    """SIGTERM to a sweep while job 0 drew its end-of-run text sample (after the ranks' last check for a signal) was
    recorded and never read: the sweep ran its other jobs to the end, 6 more minutes for 3 nano jobs, and exited 0.
    The job is finished, so it keeps its summary.json; the process then exits 143 before the next job, naming how to
    resume, which validates job 0 again and trains job 1. SIGHUP (a closed terminal), which PreemptionCheckpoint
    takes as SIGTERM in training, killed the process there (status -1, no line, job 0 without summary.json): 129."""
    args = ["-m", *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "scheduler=wsd,cosine",
            "+callbacks.fault._target_=tests.faults.SignalInSample", f"+callbacks.fault.signal={name}"]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, out[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multiruns").iterdir()
    assert json.loads((sweep / "0" / "summary.json").read_text())["steps"] == 6
    assert not (sweep / "1").exists(), sorted(p.name for p in sweep.iterdir())
    assert (f"stopped by {name} after this job finished (its summary.json is written): the sweep's later jobs do not "
            f"start; resume with the same -m arguments and resume=auto hydra.sweep.dir={sweep}") in out, out[-3000:]


def test_a_sigterm_in_the_last_jobs_end_of_run_sample_ends_the_finished_sweep_with_status_0(tmp_path, corpus):
    """SIGTERM in the end-of-run sample of a sweep's last job exited 143 saying 'the sweep's later jobs do not start;
    resume with ...', though none were left: every job had finished and written its summary.json. The basic
    sweeper's job count (from multirun.yaml) tells the last job: it ends as a single run does, status 0 and a line."""
    args = ["-m", *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]",
            "+callbacks.fault._target_=lightning.pytorch.callbacks.Callback,tests.faults.SignalInSample"]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multiruns").iterdir()
    assert [json.loads((sweep / j / "summary.json").read_text())["steps"] for j in "01"] == [6, 6]
    assert ("SIGTERM came after the sweep's last job finished (summary.json is written): nothing was left to stop"
            in out and "later jobs do not start" not in out), out[-3000:]
