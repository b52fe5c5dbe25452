"""scripts/compare_runs.py's label of a sweep's job that never started, beside runs it is compared with: it takes the
defaults its started siblings show, where they cannot depend on what the sweep varies."""

from __future__ import annotations

import json

from tests.unit._compare_runs_helpers import compare_runs, write_run

MULTIRUN = ("hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
            "  overrides:\n    task:\n    - {task}\n")


def job(run, values, overrides, scheduler, lr, warmup="${lit.default_warmup:${trainer.max_steps}}"):
    """A started run dir as train.py leaves it: typed overrides, the resolved config, the unresolved one (Hydra's
    .hydra/config.yaml) and the config groups' choices."""
    write_run(run, values, overrides=overrides)
    (run / "config_resolved.yaml").write_text(f"optimizer: {{lr: {lr}}}\nscheduler: {{warmup_steps: 1}}\n")
    (run / ".hydra" / "config.yaml").write_text(f"optimizer: {{lr: {lr}}}\nscheduler: {{warmup_steps: '{warmup}'}}\n")
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      scheduler: {scheduler}\n")
    (run / "summary.json").write_text(json.dumps({"steps": 2}))


def labels(tmp_path, *runs):
    result = compare_runs.compare([str(r) for r in runs], ["val/loss"], out=str(tmp_path / "c.png"))
    return [line.split(" | ")[0][2:] for line in result["markdown"].splitlines()[2:]]


def test_a_job_that_never_started_shows_the_defaults_of_its_started_siblings(tmp_path):
    """'-m scheduler=wsd,cosine,constant' stopped by SIGTERM in job 1, compared with a run of optimizer.lr=0.01: the
    started jobs read 'scheduler=wsd optimizer.lr=0.003', the job that never started 'scheduler=constant' alone, as
    if its LR were another. It takes the 0.003 every started job of its sweep trained with now."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    task = "scheduler=wsd,cosine,constant\n    - trainer.max_steps=2"
    (sweep / "multirun.yaml").write_text(MULTIRUN.format(task=task))
    job(sweep / "0", {2: 4.5}, ["scheduler=wsd", "trainer.max_steps=2"], "wsd", 0.003)
    job(sweep / "1", {2: 4.6}, ["scheduler=cosine", "trainer.max_steps=2"], "cosine", 0.003)
    other = tmp_path / "runs" / "lr01"
    job(other, {2: 4.1}, ["optimizer.lr=0.01", "trainer.max_steps=2"], "wsd", 0.01)
    assert labels(tmp_path, sweep, other) == [
        "scheduler=wsd optimizer.lr=0.003", "scheduler=cosine optimizer.lr=0.003",
        "scheduler=constant optimizer.lr=0.003", "optimizer.lr=0.01 scheduler=wsd",
    ]


def test_a_default_the_sweep_may_change_is_not_taken_from_siblings(tmp_path):
    """A default derived from a swept key (an interpolation: the warmup from trainer.max_steps, 1 at 2 steps, 4 at
    40) is not guessed from the started jobs: the never-started job keeps its typed overrides alone."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(MULTIRUN.format(task="trainer.max_steps=2,40"))
    job(sweep / "0", {2: 4.5}, ["trainer.max_steps=2"], "wsd", 0.003)
    other = tmp_path / "runs" / "w"
    job(other, {2: 4.1}, ["scheduler.warmup_steps=2", "trainer.max_steps=2"], "wsd", 0.003, warmup="2")
    assert labels(tmp_path, sweep, other) == [
        "trainer.max_steps=2 scheduler.warmup_steps=1", "trainer.max_steps=40",
        "scheduler.warmup_steps=2 trainer.max_steps=2",
    ]
