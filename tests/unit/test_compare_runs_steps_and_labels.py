"""scripts/compare_runs.py: the labels of runs that share overrides, steps trained, the final validation, row order,
the gap to the best."""

from __future__ import annotations

import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


def test_a_finished_run_without_a_logger_is_not_called_failed_or_not_started(tmp_path):
    """`python train.py -m optimizer.lr=1e-3,3e-3 logger=none`: both jobs trained to the end and wrote summary.json,
    but compare_runs said "skipping ... it failed before logging, or has not started", tabulated them as 'no
    metrics logged (not started, or stopped before logging)' and, alone, ended with '... logged no error (not
    started, or stopped before logging)'. They are reported as finished without metrics now."""
    sweep = tmp_path / "sweep"
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n- logger=none\n")
        (sweep / job / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
        (sweep / job / "summary.json").write_text(json.dumps({"val_loss": 2.75, "steps": 20}))
    (sweep / "2" / ".hydra").mkdir(parents=True)  # killed before logging: as before
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.01\n- logger=none\n")
    no_logger = "finished, but logged no metrics (logger=none: its values are in summary.json only)"
    with pytest.raises(compare_runs.CompareError) as refused:
        compare_runs.compare([str(sweep)], ["val/loss"])
    assert str(refused.value) == (
        f"no run has TensorBoard event files or metrics.csv: {sweep / '0'} {no_logger}; {sweep / '1'} {no_logger}; "
        f"{sweep / '2'} logged no error (not started, or stopped before logging)"
    )
    logged = write_run(tmp_path / "logged", {20: 2.9}, overrides=["optimizer.lr=0.003"])
    warnings = []
    result = compare_runs.compare([str(sweep), str(logged)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[2:] == [  # in the order given: the sweep's jobs, then the run
        f"| optimizer.lr=0.001 logger=none | {no_logger} | - | - | - |",
        f"| optimizer.lr=0.003 logger=none | {no_logger} | - | - | - |",
        "| optimizer.lr=0.01 logger=none | no metrics logged (not started, or stopped before logging) | - | - | - |",
        "| optimizer.lr=0.003 | 21 | 2.9000 | 2.9000 (21) | +0.00% |",
    ]
    from lit_dtrain.run_dirs import expand_runs

    expand_runs([str(sweep / "0"), str(logged)], warn=warnings.append)
    assert warnings == [f"skipping {sweep / '0'} (a Hydra job without TensorBoard event files or metrics.csv: "
                        f"{no_logger})"]


def test_two_runs_with_the_same_overrides_leave_the_other_labels_alone(tmp_path):
    """A sweep re-run into a second dir beside the first ('seed=1 optimizer.lr=0.001' twice, 'optimizer.lr=0.003'
    once): two equal labels made every run fall back to its dir name, '0', '1', '2' in the table and the legend,
    so nothing said which LR a run had. Only the two equal ones get their dir name added now."""
    sweep = tmp_path / "sweep"
    for job, lr in enumerate(["0.001", "0.001", "0.003"]):
        write_run(sweep / str(job), {5: 3.0 - job * 0.1}, overrides=["seed=1", f"optimizer.lr={lr}"])
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == [
        "optimizer.lr=0.001 (job 0)", "optimizer.lr=0.001 (job 1)", "optimizer.lr=0.003"]
    a = write_run(tmp_path / "m1" / "sweep" / "0", {5: 3.0}, overrides=["optimizer.lr=0.001"])
    b = write_run(tmp_path / "m2" / "sweep" / "0", {5: 3.0}, overrides=["optimizer.lr=0.001"])
    c = write_run(tmp_path / "m2" / "sweep" / "1", {5: 3.0}, overrides=["optimizer.lr=0.003"])
    assert compare_runs.make_labels([a, b, c]) == [
        "optimizer.lr=0.001 (m1/sweep/0)", "optimizer.lr=0.001 (m2/sweep/0)", "optimizer.lr=0.003"]


def test_a_resumed_sweep_beside_an_uninterrupted_run_is_not_labelled_resume_auto(tmp_path):
    """A sweep killed in job 1 and continued with '-m ... resume=auto hydra.sweep.dir=<it>' beside the same LR run
    on its own (bitwise the same curve): every job was labelled 'optimizer.lr=0.003 resume=auto' against
    'optimizer.lr=0.003', as if resuming were a setting that changed the training. resume=, like run_name=, labels
    no run now."""
    sweep = tmp_path / "sweep"
    for job, lr in enumerate(["0.001", "0.003"]):
        write_run(sweep / str(job), {5: 3.0 - job * 0.1}, overrides=[f"optimizer.lr={lr}", "resume=auto"])
    alone = write_run(tmp_path / "runs" / "alone", {5: 2.9}, overrides=["optimizer.lr=0.003", "run_name=alone"])
    other = write_run(tmp_path / "runs" / "other", {5: 2.9}, overrides=["optimizer.lr=0.003", "seed=2"])
    result = compare_runs.compare([str(sweep), str(alone), str(other)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == [
        "optimizer.lr=0.001", "optimizer.lr=0.003 (job 1)", "optimizer.lr=0.003 (alone)", "optimizer.lr=0.003 seed=2"]


def test_a_number_written_two_ways_is_labelled_one_way(tmp_path):
    """A baseline run typed as 'optimizer.lr=3e-3' beside a sweep whose jobs Hydra's sweeper wrote as
    'optimizer.lr=0.001' and 'optimizer.lr=0.003': the table and legend showed 'optimizer.lr=3e-3' and
    'optimizer.lr=0.003' as if the LRs differed. Every value of such a key is shown in one form now; a key whose
    values are each written one way, and values that are not numbers, keep what was typed."""
    sweep = tmp_path / "sweep"
    for job, lr in enumerate(["0.001", "0.003"]):
        write_run(sweep / str(job), {5: 3.0 - job * 0.1}, overrides=[f"optimizer.lr={lr}", "scheduler=wsd",
                                                                    "trainer.max_steps=5"])
    base = write_run(tmp_path / "runs" / "base", {5: 2.95},
                     overrides=["optimizer.lr=3e-3", "scheduler=Cosine", "trainer.max_steps=5", "seed=1e1"])
    other = write_run(tmp_path / "runs" / "other", {5: 2.97},
                      overrides=["optimizer.lr=1e-2", "scheduler=wsd", "trainer.max_steps=5.0", "seed=2"])
    result = compare_runs.compare([str(sweep), str(base), str(other)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == [
        "optimizer.lr=0.001 scheduler=wsd",
        "optimizer.lr=0.003 scheduler=wsd",
        "optimizer.lr=0.003 scheduler=Cosine seed=1e1",  # one seed each: as typed
        "optimizer.lr=0.01 scheduler=wsd seed=2",  # max_steps=5.0 is the others' 5: no difference
    ]
    # the pair of equal values is a collision like any other: only those two runs get their dir name
    c = write_run(tmp_path / "x" / "c", {5: 3.0}, overrides=["optimizer.lr=1e-4"])
    d = write_run(tmp_path / "x" / "d", {5: 3.0}, overrides=["optimizer.lr=0.0001"])
    e = write_run(tmp_path / "x" / "e", {5: 3.0}, overrides=["optimizer.lr=2e-4"])
    assert compare_runs.make_labels([c, d, e]) == ["optimizer.lr=0.0001 (c)", "optimizer.lr=0.0001 (d)",
                                                  "optimizer.lr=0.0002"]


def test_a_flag_is_labelled_in_lower_case_whatever_its_case_when_typed(tmp_path):
    """Two real runs typed 'module.check_finite=False' and 'module.check_finite=true' were labelled so, as typed (and
    Hydra's sweeper writes a job's false as False): Hydra reads both cases the same. A quoted one is a string."""
    a = write_run(tmp_path / "a", {5: 3.0}, overrides=["module.check_finite=False", "model.tie_embeddings=TRUE"])
    b = write_run(tmp_path / "b", {5: 3.0}, overrides=["module.check_finite=true", "model.tie_embeddings=false"])
    c = write_run(tmp_path / "c", {5: 3.0}, overrides=["module.check_finite=false", "run_name='False'"])
    assert compare_runs.make_labels([a, b]) == ["module.check_finite=false model.tie_embeddings=true",
                                                "module.check_finite=true model.tie_embeddings=false"]
    assert compare_runs.make_labels([a, c]) == ["model.tie_embeddings=true", "c"]  # the same check_finite


def test_steps_are_the_steps_trained_as_in_checkpoint_names(tmp_path):
    """A real run (max_steps=6, val_check_interval=3, log_every_n_steps=1) logged val/loss at 2 and 5 (Lightning's
    0-based step during fit) and its final validate at 6, and train/loss at 0-5; its checkpoints are named
    step000003 and step000006. The table gave 'best val/loss 4.0 (2)', for the weights of step000003.ckpt, and its
    train/loss table 'final step 5' beside val/loss's 6 for the same run's last step. Both tables count the steps
    trained now: the best val after 3 steps is (3), the last step 6 in both, also where the final validate logged
    nothing (from summary.json's steps)."""
    run = write_run(tmp_path / "run", {2: 4.0, 5: 4.8, 6: 4.8})
    w = SummaryWriter(str(run / "tb"), filename_suffix=".train")
    for step in range(6):
        w.add_scalar("train/loss", 5.0 - step / 10, step)
    w.close()
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 6}\n")
    (run / "summary.json").write_text(json.dumps({"steps": 6}))
    no_final = write_run(tmp_path / "no_final", {2: 4.0, 5: 4.8})  # (trainer.limit_val_batches=0 at the end)
    (no_final / "config_resolved.yaml").write_text("trainer: {max_steps: 6}\n")
    (no_final / "summary.json").write_text(json.dumps({"steps": 6}))
    result = compare_runs.compare([str(run), str(no_final)], ["val/loss", "train/loss"], out=str(tmp_path / "c.png"))
    val, train = result["markdown"].split("\n\n")
    assert "| run | 6 | 4.8000 | 4.0000 (3) | +0.00% |" in val and "| no_final | 6 | 4.8000 | 4.0000 (3) |" in val
    assert "| run | 6 | 4.5000 | 4.5000 (6) | +0.00% |" in train
    assert val.startswith("| run | steps trained | final val/loss | best val/loss (steps trained) |")


def test_the_final_validation_is_drawn_once_at_the_steps_trained(tmp_path, monkeypatch):
    """trainer.max_steps=6, val_check_interval=3: Lightning logs the check after step 6 at 5 (the last step's 0-based
    index) and train(cfg)'s final validate logs the same value at 6. The table counted it once, at 6, but the plot
    drew both: a flat last segment from 5 to 6 that looked like a plateau. One point at 6 now; a different value
    one step later is a new measurement and stays."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append({
        line.get_label(): [(int(s), round(float(v), 4)) for s, v in zip(*line.get_data())] for line in fig.axes[0].lines
    }))
    a = write_run(tmp_path / "a", {2: 5.1259684562683105, 5: 4.864140510559082, 6: 4.864140510559082})
    b = write_run(tmp_path / "b", {2: 5.0, 5: 4.7, 6: 4.8})
    compare_runs.compare([str(a), str(b)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert seen == [{"a": [(3, 5.126), (6, 4.8641)], "b": [(3, 5.0), (6, 4.7), (7, 4.8)]}]


def test_rows_follow_the_arguments_whatever_became_of_the_runs(tmp_path):
    """`compare_runs.py runs/a <sweep> runs/z` where every job of the sweep failed before logging: its rows came
    last, after runs/z, while a sweep with one job that logged sat where it was given; and in a sweep whose job
    dirs are not numbered (seed=1, seed=2, seed=3) the failed seed=2 came after seed=3. Rows follow the arguments
    now, and below one argument the paths (job numbers by number), whatever became of each run."""
    a = write_run(tmp_path / "runs" / "a", {5: 3.0}, overrides=["optimizer.lr=0.1"])
    z = write_run(tmp_path / "runs" / "z", {5: 3.1}, overrides=["optimizer.lr=0.2"])
    failed = tmp_path / "failed"
    for job in ("0", "1"):
        (failed / job / ".hydra").mkdir(parents=True)
        (failed / job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr=-{job}\n")
        (failed / job / "train.log").write_text(f"[x][lit_dtrain.train][ERROR] - job {job} failed: ConfigError: lr\n")
    seeds = tmp_path / "seeds"
    write_run(seeds / "seed=1", {5: 2.9}, overrides=["seed=1"])
    (seeds / "seed=2" / ".hydra").mkdir(parents=True)  # failed before logging
    (seeds / "seed=2" / ".hydra" / "overrides.yaml").write_text("- seed=2\n")
    write_run(seeds / "seed=3", {5: 2.8}, overrides=["seed=3"])
    result = compare_runs.compare([str(a), str(failed), str(seeds), str(z)], ["val/loss"], out=str(tmp_path / "c.png"))
    rows = [line.split(" | ")[:2] for line in result["markdown"].splitlines()[2:]]
    assert rows == [
        ["| optimizer.lr=0.1", "6"],
        ["| optimizer.lr=-0", "failed: ConfigError: lr"],
        ["| optimizer.lr=-1", "failed: ConfigError: lr"],
        ["| seed=1", "6"],
        ["| seed=2", "no metrics logged (not started, or stopped before logging)"],
        ["| seed=3", "6"],
        ["| optimizer.lr=0.2", "6"],
    ]


def test_the_gap_to_a_negative_best_has_the_sign_of_a_positive_one(tmp_path):
    """The gap was final / best - 1: with a best of -2.0 (a metric below zero, e.g. a log-likelihood ranked lower
    is better) a worse run at -1.0 read '-50.00%', the sign of a better run. It is (final - best) / |best| now:
    '+50.00%' there, and the same as before for a positive best."""
    good = write_run(tmp_path / "good", {5: -2.0})
    bad = write_run(tmp_path / "bad", {5: -1.0})
    md = compare_runs.compare([str(good), str(bad)], ["val/loss"], out=str(tmp_path / "c.png"))["markdown"]
    assert md.splitlines()[2:] == ["| good | 6 | -2.0000 | -2.0000 (6) | +0.00% |",
                                   "| bad | 6 | -1.0000 | -1.0000 (6) | +50.00% |"]
    md = compare_runs.compare([str(good), str(bad)], ["val/loss"], maximize=["val/loss"])["markdown"]
    assert md.splitlines()[2:] == ["| good | 6 | -2.0000 | -2.0000 (6) | -100.00% |",
                                   "| bad | 6 | -1.0000 | -1.0000 (6) | +0.00% |"]
