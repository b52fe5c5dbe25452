"""scripts/compare_runs.py: CSV-logger runs; unfinished and failed runs and sweep jobs in the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


def write_csv_run(run: Path, values: dict[int, float]) -> Path:
    """A `logger=csv` run: Lightning's metrics.csv in <run>/csv/, written by the project's CSV logger."""
    from lit_dtrain.loggers import ResumableCSVLogger

    logger = ResumableCSVLogger(save_dir=str(run), name="csv", version="")
    for step, v in sorted(values.items()):
        logger.log_metrics({"train/loss": v + 1.0}, step)
        logger.log_metrics({"val/loss": v, "epoch": 0}, step)
    logger.save()
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- logger=csv\n")
    return run


def test_csv_logger_runs_are_compared(tmp_path, capsys):
    """`python train.py -m logger=csv ...` then compare_runs: every job was 'skipping ... (a Hydra job without
    TensorBoard event files: it failed before logging, or has not started)' and the comparison ended with
    'no run has TensorBoard event files', for two finished runs. Their metrics.csv is read now, also next to a
    TensorBoard run."""
    sweep = tmp_path / "sweep"
    write_csv_run(sweep / "0", {9: 3.9099, 19: 3.4014, 20: 3.4014})
    write_csv_run(sweep / "1", {9: 3.3350, 19: 3.1988, 20: 3.1988})
    result = compare_runs.compare([str(sweep)], ["val/loss", "train/loss"], out=str(tmp_path / "c.png"))
    rows = {r["dir"]: r for r in result["runs"]}
    assert (rows[str(sweep / "0")]["final_step"], rows[str(sweep / "0")]["final"]) == (20, pytest.approx(3.4014))
    assert (rows[str(sweep / "1")]["best_step"], rows[str(sweep / "1")]["best"]) == (20, pytest.approx(3.1988))
    assert result["skipped"] == [] and result["best"] == "1"
    tb = write_run(tmp_path / "tb", {9: 3.5, 20: 3.3})
    mixed = compare_runs.compare([str(sweep / "0"), str(tb)], ["val/loss"], out=str(tmp_path / "m.png"))
    expected = [("0", pytest.approx(3.4014)), ("tb", pytest.approx(3.3))]
    assert [(r["label"], r["final"]) for r in mixed["runs"]] == expected
    assert "skipping" not in capsys.readouterr().err



def test_unfinished_runs_are_marked_in_the_table(tmp_path):
    """A sweep job killed at step 28 of 60 (SIGTERM: last.ckpt, no summary.json) was tabulated like the finished
    jobs: '| optimizer.lr=0.003 | 19 | 3.1411 | 3.1411 (19) | +8.77% |' beside a job's final at step 60, with
    nothing saying that it stopped early. A run dir of train.py without summary.json, or one that logged past the
    steps its summary.json reports (resumed, then killed), is marked now and is not the best run."""
    done = write_run(tmp_path / "done", {9: 3.5, 19: 3.2, 20: 3.2})
    (done / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (done / "summary.json").write_text(json.dumps({"val_loss": 3.2, "steps": 20}))
    killed = write_run(tmp_path / "killed", {9: 3.4, 19: 3.04})
    (killed / "config_resolved.yaml").write_text("trainer: {max_steps: 60}\n")
    resumed = write_run(tmp_path / "resumed", {9: 3.6, 19: 3.3, 20: 3.3, 29: 3.25})
    (resumed / "config_resolved.yaml").write_text("trainer: {max_steps: 60}\n")
    (resumed / "summary.json").write_text(json.dumps({"val_loss": 3.3, "steps": 20}))
    result = compare_runs.compare([str(done), str(killed), str(resumed)], ["val/loss"], out=str(tmp_path / "c.png"))
    rows = {r["label"]: r for r in result["runs"]}
    assert [rows[k]["finished"] for k in ("done", "killed", "resumed")] == [True, False, False]
    assert result["best"] == "done"  # killed has the lowest value, at step 19 of 60
    md = result["markdown"]
    assert "| done | 20 | 3.2000 | 3.2000 (20) | +0.00% |" in md  # the gap is to the best (finished) run
    # no gap beside the finished runs': '-5.00%' read as 5% better than the best run, at step 19 of 60
    assert "| killed | 20 (unfinished) | 3.0400 | 3.0400 (20) | - |" in md
    assert "| resumed | 30 (unfinished) | 3.2500 | 3.2500 (30) | - |" in md
    # with no finished run, the unfinished ones are compared with each other
    alone = compare_runs.compare([str(killed), str(resumed)], ["val/loss"], out=str(tmp_path / "u.png"))["markdown"]
    assert "| killed | 20 (unfinished) | 3.0400 | 3.0400 (20) | +0.00% |" in alone


def test_a_run_killed_after_its_final_validate_has_the_steps_it_trained(tmp_path):
    """A 30-step run killed after its final validate (logged at 30, as a fit's at 29) and before its summary.json
    (in its sample) read '31 (unfinished)' steps trained beside its best '(30)': a fit logs at most at
    trainer.max_steps - 1, so a point at max_steps is the final validate's, at the steps trained."""
    killed = write_run(tmp_path / "killed", {9: 4.4, 19: 3.5, 29: 3.17, 30: 3.17})
    (killed / "config_resolved.yaml").write_text("trainer: {max_steps: 30}\n")
    mid_fit = write_run(tmp_path / "mid_fit", {9: 4.5, 19: 3.6})  # killed in its fit: each point one step on
    (mid_fit / "config_resolved.yaml").write_text("trainer: {max_steps: 30}\n")
    result = compare_runs.compare([str(killed), str(mid_fit)], ["val/loss"], out=str(tmp_path / "c.png"))
    md = result["markdown"]
    assert "| killed | 30 (unfinished) | 3.1700 | 3.1700 (30) | +0.00% |" in md
    assert "| mid_fit | 20 (unfinished) | 3.6000 | 3.6000 (20) | +13.56% |" in md
    assert [(r["final_step"], r["best_step"]) for r in result["runs"]] == [(30, 30), (20, 20)]


def test_a_failed_run_has_no_gap_to_the_finished_runs(tmp_path):
    """A sweep job that logged val/loss, then failed (NaN, an OOM) was tabulated '| lr=1e-2 | 10 (failed) | 2.5700 |
    2.5700 (10) | -19.86% |': a final at step 10 set beside finished runs' finals at step 40, as if 20% better. Its
    gap is '-' now; it is not the best run either."""
    done = write_run(tmp_path / "done", {10: 3.6, 40: 3.2})
    (done / "config_resolved.yaml").write_text("trainer: {max_steps: 40}\n")
    (done / "summary.json").write_text(json.dumps({"val_loss": 3.2, "steps": 40}))
    failed = write_run(tmp_path / "failed", {10: 2.5648})
    (failed / "config_resolved.yaml").write_text("trainer: {max_steps: 40}\n")
    (failed / "train.log").write_text("[2026-12-05 09:00:00,000][lit_dtrain.train][ERROR] - job 1 failed: "
                                      "NonFiniteError: loss is nan at step 11\n")
    result = compare_runs.compare([str(done), str(failed)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["best"] == "done"
    assert result["markdown"].splitlines()[2:] == [
        "| done | 40 | 3.2000 | 3.2000 (40) | +0.00% |",
        "| failed | 11 (failed) | 2.5648 | 2.5648 (11) | - |",
    ]



def test_a_single_run_that_failed_shows_its_error(tmp_path, capsys):
    """Only sweep jobs logged 'job N failed: ...': a single run (`python train.py optimizer.lr=1e6 ...`) stopped by a
    NonFiniteError at step 1 was listed as '(unfinished)', as if killed or still running. train(cfg) logs
    'run failed: Type: message' to a single run's train.log now, and its row shows the error as a sweep job's does;
    the latest error where a resumed run failed again, none where a resume then finished."""
    done = write_run(tmp_path / "done", {10: 3.6, 20: 3.2})
    (done / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (done / "summary.json").write_text(json.dumps({"val_loss": 3.2, "steps": 20}))
    failed = write_run(tmp_path / "failed", {10: 3.4})
    (failed / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (failed / "train.log").write_text(
        "[x][lit_dtrain.train][ERROR] - run failed: CollectiveError: rank 1: a collective failed\n"
        "[y][lit_dtrain.train][ERROR] - run failed: NonFiniteError: non-finite gradients at step 12\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1\nNonFiniteError: non-finite gradients\n")
    result = compare_runs.compare([str(done), str(failed)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[2:] == [
        "| done | 20 | 3.2000 | 3.2000 (20) | +0.00% |",
        "| failed | 11 (failed) | 3.4000 | 3.4000 (11) | - |",
    ]
    assert [r.get("error") for r in result["runs"]] == [None, "NonFiniteError: non-finite gradients at step 12"]
    assert "run '" + str(failed) + "' failed: NonFiniteError" in capsys.readouterr().err
    (failed / "summary.json").write_text(json.dumps({"val_loss": 3.1, "steps": 20}))  # resumed to its end
    result = compare_runs.compare([str(done), str(failed)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r.get("error") for r in result["runs"]] == [None, None]

def test_failed_sweep_jobs_have_a_row_in_the_table(tmp_path):
    """`python train.py -m optimizer.lr=1e-3,-5,3e-3`: the failed job was only named on stderr and in the JSON's
    'skipped'; the markdown table (what goes into a report) listed 2 runs of a 3-job sweep as if that was all.
    It has a row now, labelled like the others, with the error train.py logged to the job's train.log."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3", "trainer.max_steps=5"])
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-5\n- trainer.max_steps=5\n")
    (sweep / "1" / "train.log").write_text(
        "[2026-12-03 19:57:47,120][lit_dtrain.train][ERROR] - job 1 failed: ConfigError: optimizer.lr must be > 0, "
        "got -5\nTraceback (most recent call last):\n  File \"train.py\", line 19, in main\n"
    )
    (sweep / "2" / ".hydra").mkdir(parents=True)  # not started yet (or killed before logging): no error logged
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=1e-2\n- trainer.max_steps=5\n")
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "s.png"))
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3"]
    assert result["skipped"] == [str(sweep / "1"), str(sweep / "2")]
    md = result["markdown"].splitlines()
    assert md[2] == "| optimizer.lr=1e-3 | 6 | 3.0000 | 3.0000 (6) | +0.00% |"
    assert md[3] == "| optimizer.lr=-5 | failed: ConfigError: optimizer.lr must be > 0, got -5 | - | - | - |"
    assert md[4] == "| optimizer.lr=1e-2 | no metrics logged (not started, or stopped before logging) | - | - | - |"


def test_long_differing_overrides_still_label_the_runs(tmp_path):
    """A 2x2x2 sweep (scheduler, optimizer.lr, optimizer.weight_decay): its labels such as 'scheduler=cosine
    optimizer.lr=0.003 optimizer.weight_decay=0.1' are over 60 characters, so every run was labelled by its job
    dir, '0' ... '7', in the table and the legend: nothing said which run was which. Dotted keys are shortened to
    their last part when that keeps the labels unique, and the overrides are kept even when long."""
    sweep = tmp_path / "sweep"
    i = 0
    for sched in ("wsd", "cosine"):
        for lr in ("0.001", "0.003"):
            for wd in ("0.0", "0.1"):
                ov = [f"scheduler={sched}", f"optimizer.lr={lr}", f"optimizer.weight_decay={wd}", "trainer.max_steps=5"]
                write_run(sweep / str(i), {5: 3.0 - i * 0.01}, overrides=ov)
                i += 1
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "s.png"))
    labels = [r["label"] for r in result["runs"]]
    assert labels[0] == "scheduler=wsd lr=0.001 weight_decay=0.0"
    assert labels[7] == "scheduler=cosine lr=0.003 weight_decay=0.1" and result["best"] == labels[7]
    # a shortened key that would make two labels equal keeps its full name
    a = write_run(tmp_path / "x" / "a", {5: 3.0}, overrides=["optimizer.lr=0.001", "optimizer.weight_decay=0.1",
                                                            "foo.bar.baz.qux=1"])
    b = write_run(tmp_path / "x" / "b", {5: 2.9}, overrides=["optimizer.lr=0.003", "optimizer.weight_decay=0.0",
                                                            "foo.bar.baz.qux=2"])
    assert compare_runs.make_labels([a, b]) == ["lr=0.001 weight_decay=0.1 qux=1", "lr=0.003 weight_decay=0.0 qux=2"]
    c = write_run(tmp_path / "y" / "c", {5: 3.0}, overrides=["model.lr=1", "optimizer.lr=1"])
    d = write_run(tmp_path / "y" / "d", {5: 3.0}, overrides=["model.lr=1", "optimizer.lr=2"])
    assert compare_runs.make_labels([c, d]) == ["optimizer.lr=1", "optimizer.lr=2"]  # short enough: as before


def test_a_job_that_failed_after_it_started_logging_shows_its_error(tmp_path, capsys):
    """`python train.py -m optimizer.lr=3e-3,1e4`: job 1 raised NonFiniteError at step 1 after its logger had
    written an event file, so it was not a skipped job; its row was '| optimizer.lr=10000.0 | - | - | - | - |' and
    the error stayed in its train.log. A run dir whose train.log holds train.py's 'job N failed' line now shows the
    error where it has no value, and '(failed)' beside its last step where it has."""
    ok = write_run(tmp_path / "s" / "0", {5: 3.0}, overrides=["optimizer.lr=3e-3"])
    bad = tmp_path / "s" / "1"
    SummaryWriter(str(bad / "tb")).close()
    (bad / ".hydra").mkdir(parents=True)
    (bad / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=10000.0\n")
    (bad / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: NonFiniteError: non-finite "
                                   "gradients at step 1 (train/loss=5.5)\nTraceback (most recent call last):\n")
    mid = write_run(tmp_path / "s" / "2", {5: 3.5, 10: 3.4}, overrides=["optimizer.lr=1e-1"])
    (mid / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (mid / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 2 failed: LossSpikeError: spike at 11\n")
    result = compare_runs.compare([str(tmp_path / "s")], ["val/loss"], out=str(tmp_path / "c.png"))
    md = result["markdown"].splitlines()
    assert md[2] == "| optimizer.lr=3e-3 | 6 | 3.0000 | 3.0000 (6) | +0.00% |"
    assert md[3] == ("| optimizer.lr=10000.0 | failed: NonFiniteError: non-finite gradients at step 1 (train/loss=5.5)"
                     " | - | - | - |")
    assert md[4] == "| optimizer.lr=1e-1 | 11 (failed) | 3.4000 | 3.4000 (11) | - |"  # no gap to a finished run
    # stderr said "did not finish ...: its row is marked '(unfinished)'" of this run, whose row says '(failed)'
    err = capsys.readouterr().err
    assert f"run {str(mid)!r} failed: LossSpikeError: spike at 11\n" in err and "unfinished" not in err
    errors = [r.get("error") for r in result["runs"]]
    assert errors == [None, "NonFiniteError: non-finite gradients at step 1 (train/loss=5.5)",
                      "LossSpikeError: spike at 11"]
    assert ok.name == "0"
    long = compare_runs.table_cell("NonFiniteError: " + "x" * 200 + " | y")  # the table cell, not the JSON, is cut
    assert len(long) == 100 and long.endswith("...") and "|" not in long


def test_a_run_whose_values_are_all_nan_keeps_its_steps(tmp_path):
    """A diverged run (module.check_finite=false, optimizer.lr=1e4) logs val/loss NaN at every check, 4 ... 20: its
    row read '| b | None | nan | nan (None) | +nan% |', as if it had logged nothing. Its last step is 20 and its
    final value NaN; it has no best value and no gap."""
    a = write_run(tmp_path / "a", {4: 3.4, 20: 3.19})
    b = write_run(tmp_path / "b", {4: float("nan"), 20: float("nan")})
    c = write_run(tmp_path / "c", {4: 3.5, 20: float("nan")})  # diverged after a finite check
    result = compare_runs.compare([str(a), str(b), str(c)], ["val/loss"], out=str(tmp_path / "c.png"))
    rows = {r["label"]: r for r in result["runs"]}
    assert (rows["b"]["final_step"], rows["b"]["best_step"]) == (21, None)
    md = result["markdown"].splitlines()
    assert md[3] == "| b | 21 | nan | - | - |"
    assert md[4] == "| c | 21 | nan | 3.5000 (5) | - |"
    assert result["best"] == "a"


def test_a_summary_json_cut_short_is_named_not_called_missing(tmp_path, capsys):
    """A run dir whose summary.json is cut short (a copy cut off) was reported 'did not finish (no summary.json,
    ...)', though the file is there; the line says it cannot be read."""
    run = write_run(tmp_path / "a", {9: 3.5, 19: 3.2, 20: 3.2})
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (run / "summary.json").write_text(json.dumps({"val_loss": 3.2, "steps": 20})[:15])
    assert compare_runs.main([str(run), "--out", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert f"run {str(run)!r}: its summary.json cannot be read (cut short or edited" in err
    assert "no summary.json" not in err


def test_a_run_that_failed_mid_step_counts_the_steps_it_completed(tmp_path, monkeypatch):
    """`python train.py -m ... trainer.log_every_n_steps=1 +callbacks.fault._target_=tests.faults.PoisonLossAtStep
    +callbacks.fault.step=1` (a NonFiniteError in the 2nd optimizer step): its lr-AdamW/decay table said
    '| ... | 2 (failed) | 0.0010 | ...' and its train/loss table '1 (failed)'; it had trained 1 step. The LR monitor
    logs at the start of a step (logged step 1: the 2nd step's LR), and that step never completed. A run that did
    not finish has no point of a start-of-step tag past its last completed step now, on either x axis; one whose
    step-end tags reached that step keeps it (the LR of a step it trained), as a finished run keeps all of them."""
    seen: list = []
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [[float(x) for x in line.get_data()[0]] for ax in fig.axes for line in ax.lines]))

    def job(name: str, lr_steps: list[int], end_steps: list[int]) -> Path:
        run = tmp_path / name
        w = SummaryWriter(str(run / "tb"))
        for s in lr_steps:
            w.add_scalar("lr-AdamW/decay", 1e-3, s)
        for s in end_steps:
            w.add_scalar("train/loss", 5.0 - s, s)
            w.add_scalar("train/tokens", 64.0 * (s + 1), s)
        w.close()
        (run / "config_resolved.yaml").write_text("trainer: {max_steps: 3}\n")
        (run / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 0 failed: NonFiniteError: non-finite "
                                       "gradients at step 1\n")
        return run

    failed = job("failed", [0, 1], [0])
    cadence = job("cadence", [9, 19], [9])  # logging every 10 steps: killed in the 20th, after 19 steps trained
    trained = job("trained", [0, 1], [0, 1])  # failed after step 2's logs (in the sample): its LR is of a step trained
    metrics = ["lr-AdamW/decay", "train/loss"]
    result = compare_runs.compare([str(failed), str(cadence), str(trained)], metrics, out=str(tmp_path / "c.png"))
    lr_table = result["markdown"].split("\n\n")[0].splitlines()[2:]
    assert lr_table == ["| failed | 1 (failed) | 0.001 | - | - |", "| cadence | 10 (failed) | 0.001 | - | - |",
                        "| trained | 2 (failed) | 0.001 | - | - |"]
    assert [r["by_metric"]["train/loss"]["final_step"] for r in result["runs"]] == [1, 10, 2]
    compare_runs.compare([str(failed)], metrics, out=str(tmp_path / "s.png"))
    assert seen[-1] == [[1.0], [1.0]]  # its LR and loss, at its 1 step trained
    compare_runs.compare([str(failed)], metrics, out=str(tmp_path / "t.png"), x="tokens")
    assert seen[-1] == [[64.0], [64.0]]  # not the LR at 128 tokens, which it never trained on
