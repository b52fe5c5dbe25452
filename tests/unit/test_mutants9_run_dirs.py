"""Exact results of ``lit_dtrain.run_dirs``'s readers (ninth hand mutation audit): single-point mutants passed
test_run_dirs_overrides.py and the test_compare_runs*.py files. A step logged twice at the same wall time keeps its
later write; a run resumed with ``logger=csv`` after a TensorBoard start keeps the resumed values, not the killed
start's; ``epoch`` in metrics.csv is no scalar; a summary.json whose ``steps`` is no integer gives no steps; a sweep's
jobs come in job-number order; ``outputs/`` is expanded into its runs; the overrides are those of the start that
trained; a fit that ended at ``max_epochs`` is not marked stopped; a dir of runs without Hydra is expanded; a job log
with a start and no summary line leaves a run finished; a dir above a sweep gives it whole; a job-number subdir written
with spaces still names the jobs."""

from __future__ import annotations

import json

from torch.utils.tensorboard import SummaryWriter

from lit_dtrain.run_dirs import (
    TRAINING_STARTS,
    expand_runs,
    finished,
    hydra_overrides,
    jobs_not_started,
    read_csv_metrics,
    read_scalars,
    summary_marks,
    summary_steps,
    sweep_jobs,
)


def test_a_step_logged_twice_at_the_same_wall_time_keeps_the_later_write(tmp_path):
    """The docstring's 'for a step logged twice, the later write wins' held only for a later wall time: with an
    equal one (a coarse clock) the first write was kept."""
    with SummaryWriter(str(tmp_path / "run" / "tb")) as w:
        w.add_scalar("val/loss", 5.0, 3, walltime=100.0)
        w.add_scalar("val/loss", 4.0, 3, walltime=100.0)
        w.add_scalar("val/loss", 3.5, 4, walltime=101.0)
    assert read_scalars(tmp_path / "run")["val/loss"] == [(3, 4.0), (4, 3.5)]


def test_a_resume_with_logger_csv_keeps_the_resumed_values_over_the_killed_starts_events(tmp_path):
    """A TensorBoard start logged steps 0-10 and was killed after its step-6 checkpoint; ``resume=auto logger=csv``
    logged steps 6-12 to csv/metrics.csv. A metrics.csv row has no wall time and counts as the later write: steps 6-10
    are the resume's (csv/ is read before tb/, so the killed start's events at 6-10 won)."""
    run = tmp_path / "run"
    with SummaryWriter(str(run / "tb")) as w:
        for step in range(11):
            w.add_scalar("val/loss", 10.0 + step, step)
    (run / "csv").mkdir()
    (run / "csv" / "metrics.csv").write_text("epoch,step,val/loss\n" + "".join(f"0,{s},{s}.5\n" for s in range(6, 13)))
    values = read_scalars(run)
    assert values["val/loss"] == [(s, 10.0 + s) for s in range(6)] + [(s, s + 0.5) for s in range(6, 13)]
    assert sorted(values) == ["val/loss"]


def test_the_epoch_column_of_metrics_csv_is_no_scalar(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss,val/loss\n0,4,3.25,\n1,9,,2.5\n")
    assert read_csv_metrics(path) == [("train/loss", 4, 3.25), ("val/loss", 9, 2.5)]


def test_a_summary_whose_steps_is_no_integer_gives_no_steps(tmp_path):
    """``train(cfg)`` writes an integer; 20.5 (a hand-edited or foreign summary.json) is no count of optimizer steps,
    and a run whose last logged step is 20 was shown finished by it."""
    for steps, expected in ((20, 20), (20.5, None), (True, None), ("20", None)):
        (tmp_path / "summary.json").write_text(json.dumps({"steps": steps}))
        assert summary_steps(tmp_path) == expected, steps


def _job(d, hydra=True):
    (d / "tb").mkdir(parents=True)
    (d / "tb" / "events.out.tfevents.1").write_bytes(b"")  # expand_runs looks for the files, reads none
    if hydra:
        (d / ".hydra").mkdir()
    return d


def test_a_sweeps_jobs_come_in_job_number_order(tmp_path):
    """Job 10 after job 2, not between 1 and 2 (text order); dirs not named by a number after the numbered ones."""
    for name in ("10", "2", "extra", "1", "0"):
        _job(tmp_path / "sweep" / name)
    assert [p.name for p in expand_runs([str(tmp_path / "sweep")])] == ["0", "1", "2", "10", "extra"]


def test_outputs_is_expanded_into_its_runs_not_read_as_one(tmp_path):
    """``outputs/runs/<run>/.hydra`` lies two levels below ``outputs``: each run is a row; read as one run, their
    event files were merged into a single series."""
    for name in ("b", "a"):
        _job(tmp_path / "outputs" / "runs" / name)
    _job(tmp_path / "outputs" / "multiruns" / "t1" / "0")
    got = expand_runs([str(tmp_path / "outputs")])
    assert [p.relative_to(tmp_path).as_posix() for p in got] == [
        "outputs/multiruns/t1/0", "outputs/runs/a", "outputs/runs/b"]


def test_the_overrides_are_those_of_the_start_that_trained(tmp_path):
    """Hydra rewrites .hydra/overrides.yaml at every start, a failed one's too; the run's own overrides.yaml is written
    by the last start that trained, and is the one read while it exists."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- resume=auto\n- data.batch_size=20000\n")
    assert hydra_overrides(run) == ["resume=auto", "data.batch_size=20000"]
    (run / "overrides.yaml").write_text("- optimizer.lr=3e-3\n")
    assert hydra_overrides(run) == ["optimizer.lr=3e-3"]


def test_a_fit_that_ended_at_max_epochs_or_max_steps_is_not_marked_stopped(tmp_path):
    for stopped, marks in (("max_epochs", {}), ("max_steps", {}), ("early_stopping", {"stopped": "early_stopping"})):
        (tmp_path / "summary.json").write_text(json.dumps({"steps": 8, "stopped": stopped}))
        assert summary_marks(tmp_path) == marks, stopped


def test_a_dir_of_runs_without_hydra_is_expanded_into_them(tmp_path):
    """Runs of an app calling ``train(cfg)`` without Hydra have a summary.json, no .hydra: the dir holding them gives
    one row each; read as one run, their event files were merged into a single series."""
    for name in ("b", "a"):
        (_job(tmp_path / "runs" / name, hydra=False) / "summary.json").write_text('{"steps": 4}')
    assert [p.name for p in expand_runs([str(tmp_path / "runs")])] == ["a", "b"]


def test_a_log_with_a_start_and_no_summary_line_does_not_unfinish_a_finished_run(tmp_path):
    """A job log written before train(cfg) logged its summary line holds the start, no summary line: nothing in it
    says a start came after the summary, so the run with its summary.json and steps is finished."""
    run = _job(tmp_path / "run")
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 4}\n")
    (run / "summary.json").write_text('{"steps": 4}')
    (run / "train.log").write_text(f"[x][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n")
    assert finished(run, {"val/loss": [(2, 3.1), (4, 2.9)]}) is True
    (run / "train.log").write_text(f"[x][INFO] - summary: val_loss=2.9\n[y][INFO] - {TRAINING_STARTS}\n")
    assert finished(run, {"val/loss": [(2, 3.1), (4, 2.9)]}) is False


def test_a_dir_above_a_sweep_given_lists_its_jobs_that_never_started(tmp_path):
    """``compare_runs.py outputs/multiruns`` gives the sweep whole, as ``outputs/multiruns/<time>`` does."""
    sweep = tmp_path / "multiruns" / "t1"
    _job(sweep / "0")
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task:\n    - seed=1,2,3\n")
    expected = {sweep / "1": ["seed=2"], sweep / "2": ["seed=3"]}
    for given in (sweep, tmp_path / "multiruns", tmp_path):
        assert jobs_not_started([sweep / "0"], given=[str(given)]) == expected, given
    assert jobs_not_started([sweep / "0"], given=[str(sweep / "0")]) == {}


def test_a_job_num_subdir_written_with_spaces_still_names_the_jobs(tmp_path):
    """``hydra.sweep.subdir='${hydra: job.num}'`` resolves as ``${hydra:job.num}`` does: job N's dir is <sweep>/N."""
    for subdir, jobs in (("${hydra: job.num}", [["seed=1"], ["seed=2"]]), ("${hydra.job.override_dirname}", None)):
        (tmp_path / "multirun.yaml").write_text(
            f"hydra:\n  sweep:\n    subdir: '{subdir}'\n"
            "  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
            "  overrides:\n    task:\n    - seed=1,2\n")
        assert sweep_jobs(tmp_path) == jobs, subdir
