"""scripts/compare_runs.py: reads TensorBoard scalars of several runs, writes a PNG and a markdown table."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "scripts" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def write_run(run: Path, values: dict[int, float], overrides: list[str] | None = None, files: int = 1) -> Path:
    items = sorted(values.items())
    chunk = -(-len(items) // files)
    for i in range(files):  # a resumed run has several event files in one dir
        w = SummaryWriter(str(run / "tb"), filename_suffix=f".{i}")
        for step, v in items[i * chunk : (i + 1) * chunk]:
            w.add_scalar("val/loss", v, step)
            w.add_scalar("lr-AdamW/decay", 1e-3, step)
        w.close()
    if overrides:
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run


def test_runs_table_png_and_json(tmp_path, capsys):
    a = write_run(tmp_path / "a", {10: 3.0, 20: 2.5, 30: 2.6}, files=2)
    b = write_run(tmp_path / "b", {10: 3.1, 20: 2.4, 30: 2.3})
    out, table = tmp_path / "cmp.png", tmp_path / "cmp.md"
    assert compare_runs.main([str(a), str(b), "--out", str(out), "--table", str(table),
                              "--metric", "val/loss", "--metric", "lr-AdamW/decay"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["label"]: r for r in result["runs"]}
    assert rows["a"]["final"] == pytest.approx(2.6) and rows["a"]["best"] == pytest.approx(2.5)
    assert rows["a"]["best_step"] == 21 and rows["a"]["final_step"] == 31
    assert rows["b"]["final"] == pytest.approx(2.3) and result["best"] == "b"
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    md = table.read_text()
    assert "| a | 31 | 2.6000 | 2.5000 (21) | +13.04% |" in md and "| b | 31 | 2.3000 | 2.3000 (31) | +0.00% |" in md
    # the README's `--out lr_sweep` form: no suffix, so the PNG is lr_sweep.png, and that is what is reported
    assert compare_runs.main([str(a), str(b), "--out", str(tmp_path / "sweep")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["png"] == str(tmp_path / "sweep.png") and (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_dir_expands_to_jobs_labelled_by_differing_overrides(tmp_path):
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["1e-3", "3e-3", "1e-2"]):
        write_run(sweep / str(i), {5: 3.0 - i * 0.1}, overrides=["experiment=x", f"optimizer.lr={lr}"])
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "s.png"))
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3", "optimizer.lr=1e-2"]
    assert result["best"] == "optimizer.lr=1e-2"
    # the README's `outputs/multiruns/<time>/*` glob also matches Hydra's multirun.yaml: skipped, not an error
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    globbed = sorted(str(p) for p in sweep.glob("*"))
    assert len(globbed) == 4
    assert compare_runs.compare(globbed, ["val/loss"], out=str(tmp_path / "g.png"))["best"] == "optimizer.lr=1e-2"


def test_errors_name_the_run_and_metric(tmp_path, capsys):
    a = write_run(tmp_path / "a", {1: 1.0})
    with pytest.raises(compare_runs.CompareError, match="does not exist"):
        compare_runs.compare([str(tmp_path / "nope")], ["val/loss"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(compare_runs.CompareError, match="no TensorBoard event files"):
        compare_runs.compare([str(tmp_path / "empty")], ["val/loss"])
    with pytest.raises(compare_runs.CompareError, match="no scalar 'val/ppl'.*val/loss"):
        compare_runs.compare([str(a)], ["val/ppl"])
    with pytest.raises(compare_runs.CompareError, match="--labels has 2 entries"):
        compare_runs.compare([str(a)], ["val/loss"], labels=["x", "y"])
    assert compare_runs.main([str(tmp_path / "nope")]) == 2
    assert "error" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_failed_sweep_job_is_skipped_and_reported(tmp_path, capsys):
    """A sweep job that failed before logging (e.g. a bad value) has .hydra/ but no event files: it is
    named on stderr and in the JSON, and neither silently dropped nor fatal for the README's glob form."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    (sweep / "1" / ".hydra").mkdir(parents=True)  # the failed job: Hydra wrote its config, nothing else
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    write_run(sweep / "2", {5: 2.9}, overrides=["optimizer.lr=3e-3"])
    for args in ([str(sweep)], sorted(str(p) for p in sweep.glob("*"))):
        result = compare_runs.compare(args, ["val/loss"], out=str(tmp_path / "s.png"))
        assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
        assert result["skipped"] == [str(sweep / "1")]
        assert f"skipping {sweep / '1'}" in capsys.readouterr().err


def test_run_without_the_metric_does_not_abort_the_comparison(tmp_path, capsys):
    """A run killed (or still running) before its first validation has train scalars but no val/loss: the
    other runs are still tabulated, that one gets an empty row and a warning."""
    a = write_run(tmp_path / "a", {10: 3.0, 20: 2.5})
    b = tmp_path / "b"
    w = SummaryWriter(str(b / "tb"))
    w.add_scalar("train/loss", 4.0, 3)
    w.close()
    result = compare_runs.compare([str(a), str(b)], ["val/loss"], out=str(tmp_path / "c.png"))
    rows = {r["label"]: r for r in result["runs"]}
    assert rows["a"]["final"] == pytest.approx(2.5) and result["best"] == "a"
    assert rows["b"]["missing"] and rows["b"]["final_step"] is None
    assert "| b | - | - | - | - |" in result["markdown"]
    assert "run '" + str(b) + "' has no scalar 'val/loss'" in capsys.readouterr().err


def test_json_line_is_strict_json_with_a_diverged_run(tmp_path, capsys):
    """A diverged run logs NaN val/loss: the last line must still be valid JSON (null, not the NaN literal)."""
    a = write_run(tmp_path / "a", {10: 3.0, 20: 2.5})
    b = write_run(tmp_path / "b", {10: float("nan"), 20: float("nan")})
    assert compare_runs.main([str(a), str(b), "--out", str(tmp_path / "c.png")]) == 0

    def reject(constant):
        raise ValueError(f"not JSON: {constant}")

    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1], parse_constant=reject)
    rows = {r["label"]: r for r in result["runs"]}
    assert rows["b"]["final"] is None and rows["a"]["final"] == pytest.approx(2.5) and result["best"] == "a"


def test_a_diverged_run_says_so_beside_its_nan(tmp_path):
    """`module.check_finite=false optimizer.lr=1e30`: the run trains on to max_steps with NaN weights and its
    summary.json says `"diverged": true, "first_nonfinite_step": 2`; its row was '| ... | 6 | nan | - | - |', like a
    finished run whose metric just happened to be NaN. It says '6 (diverged from step 2)' now."""
    done = write_run(tmp_path / "done", {3: 3.6, 6: 3.2})
    (done / "config_resolved.yaml").write_text("trainer: {max_steps: 6}\n")
    (done / "summary.json").write_text(json.dumps({"val_loss": 3.2, "steps": 6, "diverged": False}))
    div = write_run(tmp_path / "div", {3: float("nan"), 6: float("nan")})
    (div / "config_resolved.yaml").write_text("trainer: {max_steps: 6}\n")
    (div / "summary.json").write_text(json.dumps({"val_loss": None, "steps": 6, "diverged": True,
                                                  "first_nonfinite_step": 2}))
    result = compare_runs.compare([str(done), str(div)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[2:] == [
        "| done | 6 | 3.2000 | 3.2000 (6) | +0.00% |",
        "| div | 6 (diverged from step 2) | nan | - | - |",
    ]
    assert [(r.get("diverged"), r.get("first_nonfinite_step")) for r in result["runs"]] == [(None, None), (True, 2)]
    (div / "summary.json").write_text(json.dumps({"steps": 6, "diverged": True}))  # NaN weights, no step known
    assert "| div | 6 (diverged) | nan | - | - |" in compare_runs.compare(
        [str(div)], ["val/loss"], out=str(tmp_path / "d.png"))["markdown"]


def test_a_run_that_stopped_before_max_steps_says_why(tmp_path):
    """A run EarlyStopping stopped at step 4 of 20 (summary.json: "stopped": "early_stopping") had the row of a
    finished one, '| stop | 4 | ...'. Its steps cell says why now; it stays ranked (it is finished)."""
    runs = []
    for name, values, stopped, extra in [("done", {3: 3.6, 6: 3.2}, "max_steps", {}),
                                         ("stop", {2: 3.5, 4: 3.4}, "early_stopping", {}),
                                         ("nan", {2: 3.5, 4: float("nan")}, "early_stopping",
                                          {"diverged": True, "first_nonfinite_step": 3})]:
        run = write_run(tmp_path / name, values)
        (run / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
        steps = max(values)
        (run / "summary.json").write_text(json.dumps({"steps": steps, "stopped": stopped, **extra}))
        runs.append(str(run))
    result = compare_runs.compare(runs, ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[2:] == [
        "| done | 6 | 3.2000 | 3.2000 (6) | +0.00% |",
        "| stop | 4 (early_stopping) | 3.4000 | 3.4000 (4) | +6.25% |",
        "| nan | 4 (diverged from step 3, early_stopping) | nan | 3.5000 (3) | - |",
    ]
    assert [r.get("stopped") for r in result["runs"]] == [None, "early_stopping", "early_stopping"]


def test_the_final_validate_repeating_the_last_check_is_one_point_at_the_steps_trained(tmp_path):
    """train(cfg) with trainer.max_steps=6, val_check_interval=3 logs val/loss at 2 and 5 (Lightning: the last step's
    0-based index) and its final validate, of the same weights, at 6. The report gave best step 5 and final step 6
    for one value; both are 6 now. A last point one step later with another value is a new measurement."""
    a = write_run(tmp_path / "a", {2: 5.1259684562683105, 5: 4.864140510559082, 6: 4.864140510559082})
    b = write_run(tmp_path / "b", {2: 5.0, 5: 4.7, 6: 4.8})  # not a repeat: the best stays at 5
    result = compare_runs.compare([str(a), str(b)], ["val/loss"], out=str(tmp_path / "c.png"))
    rows = {r["label"]: r for r in result["runs"]}
    assert (rows["a"]["best_step"], rows["a"]["final_step"]) == (6, 6)
    assert rows["a"]["best"] == rows["a"]["final"] == pytest.approx(4.864140510559082)
    assert (rows["b"]["best_step"], rows["b"]["best"], rows["b"]["final_step"]) == (6, pytest.approx(4.7), 7)
    assert "| a | 6 | 4.8641 | 4.8641 (6) | +1.34% |" in result["markdown"]


def test_a_constant_tag_logged_every_step_is_no_final_validate(tmp_path):
    """train.py scheduler=constant trainer.log_every_n_steps=1 max_steps=6 logs lr-AdamW/* 0.003 at 0..5: its
    last two points, equal and one step apart, were taken for the final validate's pair, so the table gave the LR's
    final at 'steps trained 5' beside 6 for the run's other tags, and the PNG left out the 5th step's point. A
    train.py run's final validate is the point at its summary.json's steps (none in an unfinished run)."""
    def run(name, summary):
        r = write_run(tmp_path / name, {2: 4.29, 5: 3.81, 6: 3.81})  # val/loss: the final validate repeats step 5's
        w = SummaryWriter(str(r / "tb"), filename_suffix=".lr")
        for step in range(6):
            w.add_scalar("lr-AdamW/no_decay", 3e-3, step)
        w.close()
        (r / "config_resolved.yaml").write_text("trainer: {max_steps: 6}\n")
        if summary:
            (r / "summary.json").write_text(json.dumps({"val_loss": 3.81, "steps": 6}))
        return str(r)

    result = compare_runs.compare([run("done", True), run("killed", False)], ["val/loss", "lr-AdamW/no_decay"],
                                  out=str(tmp_path / "c.png"))
    rows = {r["label"]: r["by_metric"] for r in result["runs"]}
    assert rows["done"]["lr-AdamW/no_decay"]["final_step"] == 6 and rows["done"]["val/loss"]["final_step"] == 6
    assert rows["done"]["val/loss"]["best_step"] == 6  # the final pair is still one point
    assert rows["killed"]["lr-AdamW/no_decay"]["final_step"] == 6  # steps 0..5 logged: 6 trained
    assert rows["killed"]["val/loss"]["final_step"] == 7  # logged at 6 during fit: no final validate ran


def test_bench_wsd_plots_its_branches_at_the_steps_trained(tmp_path, monkeypatch):
    """bench_wsd.py draws docs/img/wsd_branches.png and wsd_cpt.png with compare_runs.plot from the runs' scalars,
    which compare() now puts at the steps trained (plot() no longer merges the final validate's pair): those two
    PNGs drew the logged 0-based steps under the axis label 'steps trained', and each run's final val/loss twice,
    one step apart, while wsd_vs_cosine.png beside them was at the steps trained."""
    from types import SimpleNamespace

    import _bench_wsd_report as report  # scripts/ is on sys.path: compare_runs loaded beside it

    run = write_run(tmp_path / "run", {2: 4.29, 5: 3.81, 6: 3.81})  # train(cfg): max_steps=6, val every 3
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 6}\n")
    (run / "summary.json").write_text(json.dumps({"val_loss": 3.81, "steps": 6}))
    drawn = []
    monkeypatch.setattr(report.compare_runs, "compare", lambda *a, **k: None)
    monkeypatch.setattr(report.compare_runs, "plot", lambda curves, *a, **k: drawn.append(curves))
    bench = SimpleNamespace(args=SimpleNamespace(img_dir=str(tmp_path), out_dir=str(tmp_path)))
    e1 = {"dirs": {"wsd": str(run), "cosine": str(run)}, "best_lr": {"wsd": 1e-3, "cosine": 1e-3}}
    e2 = {"dirs": {"stable": str(run), "branches_f0.2": [str(run)], "cosine": [str(run)]}, "lengths": [6]}
    report.plots(bench, e1, e2, {"dirs": {"cpt": str(run)}})
    branches, cpt = drawn
    assert [s for s, _ in branches["stable (no decay)"]["val/loss"]] == [3, 6]
    assert [s for s, _ in branches["stable (no decay)"]["lr-AdamW/decay"]] == [3, 6]
    assert [s for s, _ in cpt["cpt"]["val loss on B (licenses)"]] == [3, 6]


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


def test_a_dir_of_several_sweeps_is_not_one_run(tmp_path):
    """`compare_runs.py outputs/multiruns` (the dir that holds every sweep) or `outputs`: the event files of all
    jobs below it were merged into one run named 'multiruns', whose 'final' was whichever job wrote step 30 last
    (6 wsd/cosine jobs tabulated as '| multiruns | 30 | 3.2407 | ...'). Such a dir is expanded into its sweeps'
    jobs and its single runs now."""
    root = tmp_path / "outputs"
    write_run(root / "multiruns" / "t1" / "0", {10: 3.0, 30: 2.5}, overrides=["optimizer.lr=1e-3"])
    write_run(root / "multiruns" / "t1" / "1", {10: 3.1, 30: 2.4}, overrides=["optimizer.lr=3e-3"])
    write_run(root / "multiruns" / "t2" / "0", {10: 3.2, 30: 2.7}, overrides=["optimizer.lr=1e-2"])
    write_run(root / "runs" / "exp1", {10: 3.3, 30: 2.6}, overrides=["optimizer.lr=3e-2"])
    for arg, n in ((root / "multiruns", 3), (root, 4)):
        result = compare_runs.compare([str(arg)], ["val/loss"], out=str(tmp_path / "c.png"))
        finals = {r["label"]: (r["final_step"], r["final"]) for r in result["runs"]}
        assert len(finals) == n, finals
        assert finals["optimizer.lr=1e-3"] == (31, pytest.approx(2.5))
        assert finals["optimizer.lr=3e-3"] == (31, pytest.approx(2.4)) and result["best"] == "optimizer.lr=3e-3"
        assert finals["optimizer.lr=1e-2"] == (31, pytest.approx(2.7))
    # a run with its event files in a subdir of its own (tb/) is still one run
    assert [r["final"] for r in compare_runs.compare([str(root / "runs" / "exp1")], ["val/loss"])["runs"]] == [
        pytest.approx(2.6)]


def test_sweep_jobs_beside_a_single_run_are_labelled_by_real_differences(tmp_path):
    """Sweep jobs and a baseline run made with the same settings: Hydra's sweeper writes the jobs' overrides
    normalized ('trainer.enable_progress_bar=False', 'optimizer.lr=0.001') while a single run keeps them as typed
    ('...=false', '1e-3'), so the labels listed settings that do not differ: 'lr=0.001 enable_progress_bar=False
    enable_model_summary=False progress=False' against 'enable_progress_bar=false ...'. Values are compared as
    values now, and a run that differs only by what it leaves at the default is labelled by its dir name."""
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["0.001", "0.003"]):
        write_run(sweep / str(i), {20: 3.4 - i * 0.2},
                  overrides=[f"optimizer.lr={lr}", "trainer.max_steps=20", "trainer.enable_progress_bar=False"])
    base = write_run(tmp_path / "runs" / "base", {20: 3.2},
                     overrides=["run_name=base", "trainer.max_steps=20", "trainer.enable_progress_bar=false"])
    other = write_run(tmp_path / "runs" / "other", {20: 3.3},
                      overrides=["optimizer.lr=1e-3", "trainer.max_steps=20", "trainer.enable_progress_bar=false",
                                 "seed=7"])
    result = compare_runs.compare([str(sweep), str(base), str(other)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=0.001", "optimizer.lr=0.003", "base",
                                                    "optimizer.lr=0.001 seed=7"]  # 1e-3 as the jobs write it
    plain = write_run(tmp_path / "runs" / "plain", {20: 3.2})  # `python train.py`: Hydra writes '[]'
    (plain / ".hydra").mkdir()
    (plain / ".hydra" / "overrides.yaml").write_text("[]\n")
    result = compare_runs.compare([str(sweep), str(plain)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == [
        "lr=0.001 max_steps=20 enable_progress_bar=false", "lr=0.003 max_steps=20 enable_progress_bar=false", "plain"]


def test_every_run_of_a_large_sweep_has_its_own_line_style(tmp_path, monkeypatch):
    """A 2 x 6 sweep (scheduler x optimizer.lr) has 12 runs; matplotlib's colour cycle has 10, so runs 0 and 10,
    1 and 11 were drawn in the same colour, marker and line style: two legend entries for one look."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.extend(
        (line.get_label(), line.get_color(), line.get_linestyle()) for line in fig.axes[0].lines))
    curves = {f"run{i}": {"val/loss": [(1, 3.0 + i), (2, 2.0 + i)]} for i in range(25)}
    compare_runs.plot(curves, ["val/loss"], tmp_path / "c.png")
    assert [label for label, _, _ in seen] == list(curves)
    assert len({(color, style) for _, color, style in seen}) == 25


def test_a_run_missing_from_one_panel_keeps_its_colour_in_the_others(tmp_path, monkeypatch):
    """The legend is drawn in the first panel only, but each panel took colours in turn from the runs that had its
    metric: with run 'a' lacking comm/bytes_per_step (it died before logging it), run 'b' was drawn in a's colour
    there, so the second panel named the wrong runs."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        {line.get_label(): line.get_color() for line in fig.axes[1].lines} | {
            "first": {line.get_label(): line.get_color() for line in fig.axes[0].lines}}))
    curves = {"a": {"val/loss": [(1, 3.0)], "comm/b": []},
              "b": {"val/loss": [(1, 2.0)], "comm/b": [(1, 5.0)]}}
    compare_runs.plot(curves, ["val/loss", "comm/b"], tmp_path / "c.png")
    assert seen[0]["b"] == seen[0]["first"]["b"] != seen[0]["first"]["a"]


def test_the_legend_names_runs_drawn_only_in_a_later_panel(tmp_path, monkeypatch):
    """A run without the first metric (killed before its first validation) but with the second was drawn in the
    second panel and missing from the legend, which is built from the first panel's lines only."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [t.get_text() for t in fig.axes[0].get_legend().get_texts()]))
    curves = {"a": {"val/loss": [(1, 3.0)], "train/loss": [(1, 4.0)]}, "b": {"val/loss": [], "train/loss": [(1, 5.0)]}}
    compare_runs.plot(curves, ["val/loss", "train/loss"], tmp_path / "c.png")
    assert seen == [["a", "b"]]


def test_a_metric_no_run_has_lists_the_tags_of_all_runs(tmp_path):
    """A typo in --metric named the first run's tags only: with a failed job first (an event file without scalars,
    NonFiniteError at step 1) it said "run '.../1' has no scalar 'val/los'; it has []", hiding the right name."""
    empty = tmp_path / "1"
    SummaryWriter(str(empty / "tb")).close()
    ok = write_run(tmp_path / "0", {5: 3.0})
    with pytest.raises(compare_runs.CompareError,
                       match=r"no scalar 'val/los' in any of the 2 runs; they have \['lr-AdamW/decay', 'val/loss'\]"):
        compare_runs.compare([str(empty), str(ok)], ["val/los"])


def test_runs_with_the_same_label_are_all_plotted(tmp_path, monkeypatch):
    """Two sweeps copied from two machines, /m1/sweep/0 and /m2/sweep/0 with the same overrides, both got the label
    'sweep/0'; the plot keeps its curves in a dict by label, so one run's curve replaced the other's (2 table rows,
    1 line). Labels are made unique now: by as many parent dirs as tell them apart ('m1/sweep/0', 'm2/sweep/0'),
    and numbered where nothing does (--labels x,x: 'x', 'x (2)')."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [(line.get_label(), line.get_ydata()[-1]) for line in fig.axes[0].lines]))
    a = write_run(tmp_path / "m1" / "sweep" / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    b = write_run(tmp_path / "m2" / "sweep" / "0", {5: 2.0}, overrides=["optimizer.lr=1e-3"])
    result = compare_runs.compare([str(a), str(b)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == ["m1/sweep/0", "m2/sweep/0"]
    assert seen[-1] == [("m1/sweep/0", pytest.approx(3.0)), ("m2/sweep/0", pytest.approx(2.0))]
    result = compare_runs.compare([str(a), str(b)], ["val/loss"], labels=["x", "x"], out=str(tmp_path / "c.png"))
    assert [r["label"] for r in result["runs"]] == ["x", "x (2)"] and len(seen[-1]) == 2


def test_only_files_given_says_so(tmp_path):
    """`compare_runs.py outputs/runs/a/checkpoints/last.ckpt` skipped the file (a shell glob over a sweep dir also
    matches multirun.yaml) and then failed with "no scalar 'val/loss' in any of the 0 runs; they have []"."""
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    match = r"no run dir among the arguments: .*last.ckpt' is a file; give the run dir that holds it \(e.g. outputs/"
    with pytest.raises(compare_runs.CompareError, match=match):
        compare_runs.compare([str(ckpt)], ["val/loss"])


def test_every_metric_has_a_table_and_json_values(tmp_path, capsys):
    """`--metric val/loss --metric comm/bytes_per_step_avg` (the compression sweep's command) plotted both but
    tabulated val/loss only: the bytes each preset sends, the point of that sweep, were in the PNG alone, and the
    JSON line had no value of the second metric. Each --metric has a table now (final and best per run, gap to the
    best run by that metric) and a value per run in the JSON; its keys for the first metric are as before. Values
    under 0.01 keep 4 significant digits (an LR of 3e-05 read 0.0000). An LR has no better direction: its table
    ranked it lower-is-better (run b 'best', run a '+3233.33%'); it has no best now."""
    runs = {
        "a": ({10: 3.0, 20: 2.5}, {10: 4000.0, 20: 4000.0}, 1e-3),
        "b": ({10: 3.1, 20: 2.6}, {10: 1000.0, 20: 1016.0}, 3e-5),
    }
    for name, (loss, sent, lr) in runs.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step in (10, 20):
            w.add_scalar("val/loss", loss[step], step)
            w.add_scalar("comm/bytes_per_step_avg", sent[step], step)
            w.add_scalar("lr-AdamW/decay", lr, step)
        w.close()
    table = tmp_path / "t.md"
    metrics = ["val/loss", "comm/bytes_per_step_avg", "lr-AdamW/decay"]
    args = [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png"), "--table", str(table)]
    assert compare_runs.main(args + [arg for m in metrics for arg in ("--metric", m)]) == 0
    assert table.read_text() == (
        "| run | steps trained | final val/loss | best val/loss (steps trained) | vs best final |\n"
        "|---|---:|---:|---:|---:|\n"
        "| a | 21 | 2.5000 | 2.5000 (21) | +0.00% |\n"
        "| b | 21 | 2.6000 | 2.6000 (21) | +4.00% |\n"
        "\n"
        "| run | steps trained | final comm/bytes_per_step_avg | best (cumulative: ranked by final) | vs best final |\n"
        "|---|---:|---:|---:|---:|\n"
        "| a | 21 | 4000.0000 | - | +293.70% |\n"
        "| b | 21 | 1016.0000 | - | +0.00% |\n"
        "\n"
        "| run | steps trained | final lr-AdamW/decay | best (not ranked) | vs best final |\n"
        "|---|---:|---:|---:|---:|\n"
        "| a | 21 | 0.001 | - | - |\n"
        "| b | 21 | 3e-05 | - | - |\n"
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["metric"], result["best"]) == ("val/loss", "a")  # the first metric's keys, as before
    rows = {r["label"]: r for r in result["runs"]}
    assert (rows["a"]["final"], rows["a"]["best_step"]) == (pytest.approx(2.5), 21)
    assert result["metrics"] == metrics
    assert result["best_by_metric"] == {"val/loss": "a", "comm/bytes_per_step_avg": "b", "lr-AdamW/decay": None}
    lr_a = rows["a"]["by_metric"]["lr-AdamW/decay"]
    assert (lr_a["final"], lr_a["best"], lr_a["best_step"]) == (pytest.approx(1e-3), None, None)
    bytes_b = rows["b"]["by_metric"]["comm/bytes_per_step_avg"]
    assert bytes_b == {"final_step": 21, "final": pytest.approx(1016.0), "best": None, "best_step": None}  # cumulative


def test_large_values_are_shown_in_exponent_form(tmp_path, capsys):
    """A real diverged run's val/ppl (4.9e29 at val_loss 68.37) was a 30-digit number in the table, a run's
    validate/device/flops_per_sec '886020928.0000', and the gap a 28-digit percentage: from 1e6 a value (and a gap
    in percent) shows 4 significant digits in exponent form, below it 4 decimals as before (a gap 2); the JSON line
    keeps the values whole."""
    for name, ppl in (("diverged", 4.937e29), ("ok", 24.9432)):
        w = SummaryWriter(str(tmp_path / name / "tb"))
        w.add_scalar("val/ppl", ppl, 20)
        w.add_scalar("validate/device/flops_per_sec", 886020928.0 if name == "ok" else 999999.0, 20)
        w.close()
    args = [str(tmp_path / "diverged"), str(tmp_path / "ok"), "--out", str(tmp_path / "c.png")]
    assert compare_runs.main([*args, "--metric", "val/ppl", "--metric", "validate/device/flops_per_sec"]) == 0
    out = capsys.readouterr().out
    assert "| diverged | 21 | 4.937e+29 | 4.937e+29 (21) | +1.979e+30% |" in out
    assert "| ok | 21 | 24.9432 | 24.9432 (21) | +0.00% |" in out
    assert "| diverged | 21 | 999999.0000 | 999999.0000 (21) | -99.89% |" in out
    assert "| ok | 21 | 8.860e+08 | 8.860e+08 (21) | +0.00% |" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["runs"][0]["final"] == pytest.approx(4.937e29)


def test_a_metric_where_higher_is_better_is_ranked_by_its_highest_value(tmp_path, capsys):
    """A sweep of activation-checkpointing policies compared by `--metric train/device/items_per_sec` (tokens/s):
    every table ranks by the lowest value, so the slowest run was 'best' and the fastest '+25.00%'. `--maximize
    METRIC` ranks that metric by its highest value (best column, gap, best_by_metric); a --maximize that is not one
    of the --metric values is an error that names both."""
    for name, rate in (("full", {10: 800.0, 20: 810.0}), ("none", {10: 1000.0, 20: 1012.5})):
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step, value in rate.items():
            w.add_scalar("train/device/items_per_sec", value, step)
        w.close()
    metric = "train/device/items_per_sec"
    args = [str(tmp_path / "full"), str(tmp_path / "none"), "--out", str(tmp_path / "c.png"), "--metric", metric]
    assert compare_runs.main([*args, "--maximize", metric]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["best"] == "none" and result["best_by_metric"] == {metric: "none"}
    assert result["maximize"] == [metric]
    best = [(r["label"], r["best"], r["best_step"]) for r in result["runs"]]
    assert best == [("full", 810.0, 21), ("none", 1012.5, 21)]
    assert f"| run | steps trained | final {metric} | best (highest) {metric} (steps trained) | vs best final |" in out
    assert "| full | 21 | 810.0000 | 810.0000 (21) | -20.00% |" in out
    assert "| none | 21 | 1012.5000 | 1012.5000 (21) | +0.00% |" in out
    tags = ("lr-AdamW/decay", "lr-AdamW/no_decay", "epoch", "val/loss", "train/samples", "train/device/mfu")
    # --maximize wins; a throughput is better higher without it (the slowest run was 'best')
    assert [compare_runs.direction(m, ["lr-AdamW/decay"]) for m in tags] == [True, None, None, False, None, True]
    assert compare_runs.main(args) == 0  # no --maximize: items_per_sec is ranked by its highest all the same
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["best"] == "none"
    wrong = r"--maximize 'val/loss' is not one of the --metric values \['train/device/items_per_sec'\]"
    with pytest.raises(compare_runs.CompareError, match=wrong):
        compare_runs.compare(args[:2], [metric], maximize=["val/loss"])


def test_a_sweep_whose_every_job_failed_names_the_jobs_and_their_errors(tmp_path):
    """`python train.py -m experiment=wsd_vs_cosine trainer.max_steps=20`: all 6 jobs failed their config check
    (the experiment's 50 warmup steps exceed 20) before logging. `compare_runs.py <sweep dir>` then said "run dir
    '<sweep dir>' has no TensorBoard event files ... below it", as if the sweep dir were one run, and nothing of the
    failures; the README's glob form said 'skipped [<dirs>]' without the errors. Both name each job and its error
    from its train.log now."""
    sweep = tmp_path / "sweep"
    error = "ConfigError: scheduler: warmup_steps + decay_steps must be <= total_steps, got warmup_steps=50"
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n")
        (sweep / job / "train.log").write_text(f"[x][lit_dtrain.train][ERROR] - job {job} failed: {error}\n")
    (sweep / "2" / ".hydra").mkdir(parents=True)  # not started (the sweep was killed)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    expected = (
        f"no run has TensorBoard event files or metrics.csv: {sweep / '0'} failed: {error}; {sweep / '1'} failed: "
        f"{error}; {sweep / '2'} logged no error (not started, or stopped before logging)"
    )
    for args in ([str(sweep)], sorted(str(p) for p in sweep.glob("*"))):
        with pytest.raises(compare_runs.CompareError) as refused:
            compare_runs.compare(args, ["val/loss"])
        assert str(refused.value) == expected


def test_the_table_lists_a_sweeps_jobs_in_job_order(tmp_path):
    """`python train.py -m optimizer.lr=1e-3,-1,1e4,3e-3`: job 1 failed before logging, so its row came after all
    the runs that logged, below job 3 ('0.001, 10000.0, 0.003, -1'): the grid no longer read in its order. The rows
    of a sweep's jobs follow the job numbers now; runs given one by one keep the order they were given in."""
    sweep = tmp_path / "sweep"
    for job, lr in (("0", "0.001"), ("2", "10000.0"), ("3", "0.003")):
        write_run(sweep / job, {5: 3.0 - int(job) * 0.1}, overrides=[f"optimizer.lr={lr}"])
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    (sweep / "1" / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: ConfigError: lr < 0\n")
    other = write_run(tmp_path / "runs" / "baseline", {5: 3.5}, overrides=["optimizer.lr=0.01"])
    result = compare_runs.compare([str(other), str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    labels = [line.split(" | ")[0][2:] for line in result["markdown"].splitlines()[2:]]
    assert labels == [f"optimizer.lr={lr}" for lr in ("0.01", "0.001", "-1", "10000.0", "0.003")]


def test_the_jobs_a_stopped_sweep_never_started_have_rows(tmp_path):
    """A 2 x 2 sweep ('-m scheduler=wsd,cosine optimizer.lr=1e-3,3e-3') stopped by SIGTERM in job 1: Hydra creates a
    job's dir when the job starts, so the table listed job 0 and job 1 (unfinished) only, and read like a complete
    comparison of the wsd runs with no cosine in it. The jobs of the sweep's multirun.yaml (Hydra's basic sweeper:
    the product of the swept values, hydra.sweeper.params first) that have no dir get a 'not started' row, labelled
    like the others, and are listed in the JSON's 'not_started'."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    params:\n      scheduler: wsd,cosine\n"
        "  overrides:\n    task:\n    - optimizer.lr=1e-3,3e-3\n    - trainer.max_steps=5\n"
    )
    write_run(sweep / "0", {5: 3.0}, overrides=["scheduler=wsd", "optimizer.lr=0.001", "trainer.max_steps=5"])
    (sweep / "0" / "config_resolved.yaml").write_text("trainer: {max_steps: 5}\n")
    (sweep / "0" / "summary.json").write_text(json.dumps({"steps": 5}))
    write_run(sweep / "1", {2: 3.2}, overrides=["scheduler=wsd", "optimizer.lr=0.003", "trainer.max_steps=5"])
    (sweep / "1" / "config_resolved.yaml").write_text("trainer: {max_steps: 5}\n")
    for args in ([str(sweep)], sorted(str(p) for p in sweep.glob("*"))):
        result = compare_runs.compare(args, ["val/loss"], out=str(tmp_path / "c.png"))
        assert result["markdown"].splitlines()[2:] == [
            "| scheduler=wsd optimizer.lr=0.001 | 5 | 3.0000 | 3.0000 (5) | +0.00% |",
            "| scheduler=wsd optimizer.lr=0.003 | 3 (unfinished) | 3.2000 | 3.2000 (3) | - |",
            "| scheduler=cosine optimizer.lr=0.001 | not started | - | - | - |",
            "| scheduler=cosine optimizer.lr=0.003 | not started | - | - | - |",
        ]
        assert result["not_started"] == [
            {"label": "scheduler=cosine optimizer.lr=0.001", "dir": str(sweep / "2")},
            {"label": "scheduler=cosine optimizer.lr=0.003", "dir": str(sweep / "3")},
        ]
    complete = write_run(tmp_path / "other" / "0", {5: 3.1}, overrides=["optimizer.lr=0.01"])
    (complete.parent / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task:\n    - optimizer.lr=0.01\n"
    )
    assert compare_runs.compare([str(complete.parent)], ["val/loss"], out=str(tmp_path / "d.png"))["not_started"] == []


def test_a_failed_job_of_a_hydra_app_of_ones_own_shows_its_error(tmp_path):
    """Hydra's job logging writes to ``<job dir>/<hydra.job.name>.log``, the app's script name: train.log for the
    root train.py, my_train.log for a Hydra app of one's own calling train(cfg). compare_runs read train.log only,
    so such an app's failed job got 'no metrics logged (not started, ...)' although its log held the error. The
    log is the one .hydra/hydra.yaml names (rank 1's train_ddp_process_1.log is another job name's, not read)."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    failed = sweep / "1"
    (failed / ".hydra").mkdir(parents=True)
    (failed / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    (failed / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    name: my_train\n    num: 1\n")
    (failed / "my_train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: ConfigError: lr < 0\n")
    (failed / "my_train_ddp_process_1.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: rank 1's\n")
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[3] == "| optimizer.lr=-1 | failed: ConfigError: lr < 0 | - | - | - |"
    assert result["skipped_jobs"][0]["error"] == "ConfigError: lr < 0"


def test_a_failed_jobs_error_is_shown_in_the_first_table_only(tmp_path):
    """'--metric val/loss --metric lr-AdamW/decay' over a sweep with a failed job printed the job's error (up to
    100 characters) in every metric's table, the same text once per table. The first table shows it; the others
    say where it is. The JSON keeps it in each run and skipped job as before."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    bad = sweep / "1"
    SummaryWriter(str(bad / "tb")).close()  # failed after its logger started: a run without the metrics
    (bad / ".hydra").mkdir(parents=True)
    (bad / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=1e4\n")
    (bad / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: NonFiniteError: at step 1\n")
    (sweep / "2" / ".hydra").mkdir(parents=True)
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    (sweep / "2" / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 2 failed: ConfigError: lr < 0\n")
    result = compare_runs.compare([str(sweep)], ["val/loss", "lr-AdamW/decay"], out=str(tmp_path / "c.png"))
    first, second = result["markdown"].split("\n\n")
    assert first.splitlines()[3:] == [
        "| optimizer.lr=1e4 | failed: NonFiniteError: at step 1 | - | - | - |",
        "| optimizer.lr=-1 | failed: ConfigError: lr < 0 | - | - | - |",
    ]
    assert second.splitlines()[3:] == [
        "| optimizer.lr=1e4 | failed (error in the val/loss table) | - | - | - |",
        "| optimizer.lr=-1 | failed (error in the val/loss table) | - | - | - |",
    ]
    assert result["runs"][1]["error"] == "NonFiniteError: at step 1"
    assert result["skipped_jobs"][0]["error"] == "ConfigError: lr < 0"


def test_a_resumed_runs_purged_points_are_dropped_without_tensorboards_warning(tmp_path, caplog):
    """A resumed run's event files: the killed run logged steps 0-5, the resume (``purge_step=3``, as train() passes
    it) logged 3-7. TensorBoard drops the killed run's 3-5 and printed 'Detected out of order event.step likely
    caused by a TensorFlow restart. Purging expired events ...' on stderr for every such run, which no user can act
    on; the values are the resumed run's and stderr is quiet."""
    from lit_dtrain.run_dirs import read_scalars

    tb = tmp_path / "run" / "tb"
    with SummaryWriter(str(tb)) as w:
        for step in range(6):
            w.add_scalar("val/loss", 10.0 + step, step)
    with SummaryWriter(str(tb), purge_step=3) as w:
        for step in range(3, 8):
            w.add_scalar("val/loss", float(step), step)
    with caplog.at_level(logging.INFO):
        values = read_scalars(tmp_path / "run")["val/loss"]
    assert values == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.0), (7, 7.0)]
    assert not [r for r in caplog.records if "out of order" in r.getMessage()]
    assert logging.getLogger("tensorboard").level == logging.NOTSET  # put back after reading


def test_a_sweep_whose_job_dirs_are_not_numbered_has_no_not_started_rows(tmp_path):
    """'-m seed=1,2 hydra.sweep.subdir=${hydra.job.override_dirname}' names the job dirs seed=1 and seed=2, not 0 and
    1: both jobs ran, yet each got a second row, 'not started', because <sweep>/0 and <sweep>/1 do not exist. Jobs
    that never started can be named only where the job dirs are the job numbers (conf/hydra's subdir)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()

    def multirun(subdir: str) -> None:  # as Hydra saves it: the subdir unresolved
        (sweep / "multirun.yaml").write_text(
            f"hydra:\n  sweep:\n    dir: {sweep}\n    subdir: {subdir}\n"
            "  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
            "  overrides:\n    task:\n    - seed=1,2\n"
        )

    multirun("${hydra.job.override_dirname}")
    for seed, loss in ((1, 3.0), (2, 3.2)):
        write_run(sweep / f"seed={seed}", {5: loss}, overrides=[f"seed={seed}"])
    for args in ([str(sweep)], sorted(str(p) for p in sweep.glob("seed=*"))):
        result = compare_runs.compare(args, ["val/loss"], out=str(tmp_path / "c.png"))
        assert result["not_started"] == []
        assert result["markdown"].splitlines()[2:] == [
            "| seed=1 | 6 | 3.0000 | 3.0000 (6) | +0.00% |",
            "| seed=2 | 6 | 3.2000 | 3.2000 (6) | +6.67% |",
        ]
    for subdir in ("${hydra:job.num}", "${hydra.job.num}"):  # numbered job dirs (conf/hydra's, Hydra's own default)
        multirun(subdir)
        result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "d.png"))
        assert [job["dir"] for job in result["not_started"]] == [str(sweep / "0"), str(sweep / "1")]


def test_a_job_that_failed_again_shows_its_latest_error(tmp_path):
    """Hydra's job log is opened for appending: a job re-run into its dir (resume=auto hydra.sweep.dir=...) adds to
    the same train.log. A job that failed at a collective, was re-run with resume=auto and failed again at a loss
    spike was reported with the first, stale error."""
    from lit_dtrain.run_dirs import job_error

    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    failed = write_run(sweep / "1", {2: 3.4}, overrides=["optimizer.lr=3e-3"])
    (failed / "train.log").write_text(
        "[x][lit_dtrain.train][ERROR] - job 1 failed: CollectiveError: rank 1: a collective failed\n"
        "Traceback (most recent call last):\n"
        "[y][lightning.pytorch.utilities.rank_zero][INFO] - Restoring states from the checkpoint path\n"
        "[z][lit_dtrain.train][ERROR] - job 1 failed: LossSpikeError: spike at 11\nTraceback (most recent call last):\n"
    )
    assert job_error(failed) == "LossSpikeError: spike at 11"
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r.get("error") for r in result["runs"]] == [None, "LossSpikeError: spike at 11"]


def test_a_failed_run_whose_later_start_was_killed_is_unfinished_not_failed(tmp_path, capsys):
    """`python train.py optimizer.lr=1e30 run_name=a` failed at step 1 (NonFiniteError); `run_name=a resume=auto` with a
    sane LR then trained to step 1235 and was killed: its row said '1235 (failed)' with the first start's error, as
    the killed start logged nothing. Every start that passes its checks now logs TRAINING_STARTS to train.log, and
    only an error logged after the latest one counts."""
    from lit_dtrain.run_dirs import TRAINING_STARTS, job_error

    run = write_run(tmp_path / "a", {1229: 1.5072, 1235: 1.5232})
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 2000}\n")
    failed = (f"[x][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n"
              "[y][lit_dtrain.train][ERROR] - run failed: NonFiniteError: non-finite gradients at step 1\n")
    (run / "train.log").write_text(failed + f"[z][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n")
    assert job_error(run) is None
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[2] == "| a | 1236 (unfinished) | 1.5232 | 1.5072 (1230) | +0.00% |"
    assert "did not finish" in capsys.readouterr().err
    # that start failed too: its own error; a log of before the marker line: its last error, as before
    (run / "train.log").write_text(failed * 2)
    assert job_error(run) == "NonFiniteError: non-finite gradients at step 1"
    (run / "train.log").write_text(failed.split("\n", 1)[1])
    assert job_error(run) == "NonFiniteError: non-finite gradients at step 1"


def test_an_extension_of_a_finished_run_that_failed_before_its_first_logged_step_is_failed(tmp_path, capsys):
    """A real 2-step run extended with `resume=auto trainer.max_steps=4 data.batch_size=20000` failed at its first step
    (DefaultCPUAllocator: can't allocate memory): summary.json still said steps=2 and the extension had logged no
    step, so the run was 'finished'; and TensorBoard's purge at the extension's first step (2) dropped the run's
    final val/loss, so its row read '| ... | no sync logged | - | - | - |'. The latest start counts: failed."""
    from lit_dtrain.run_dirs import SUMMARY_LINE, TRAINING_STARTS

    run = write_run(tmp_path / "ext", {2: 4.5692})  # its final validation, at step 2 as logged
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 4}\n")
    (run / "summary.json").write_text(json.dumps({"val_loss": 4.5692, "steps": 2}))
    w = SummaryWriter(str(run / "tb"), purge_step=2, filename_suffix=".2")  # the extension's writer
    w.add_scalar("lr-AdamW/decay", 1e-3, 2)
    w.close()
    first = f"[a][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n[b][lit_dtrain.train][INFO] - {SUMMARY_LINE}4.5692\n"
    failed = "[d][lit_dtrain.train][ERROR] - run failed: RuntimeError: can't allocate memory\n"
    (run / "train.log").write_text(first + f"[c][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n" + failed)
    row = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["runs"][0]
    assert (row["finished"], row["error"]) == (False, "RuntimeError: can't allocate memory")
    md = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["markdown"]
    assert md.splitlines()[2] == "| ext | failed: RuntimeError: can't allocate memory | - | - | - |"
    (run / "train.log").write_text(first + f"[c][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n")  # killed
    assert compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["runs"][0]["finished"] is False
    for log in (first, first + failed):  # its last start wrote the summary; a refused start never started
        (run / "train.log").write_text(log)
        assert compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["runs"][0]["finished"]


def test_a_start_that_trains_logs_its_marker_to_the_job_log_only(tmp_path):
    """The marker goes to the root logger's file handlers (Hydra's job log), not to the console."""
    import io

    from lit_dtrain.run_dirs import TRAINING_STARTS
    from lit_dtrain.sweeps import log_training_start

    root, console = logging.getLogger(), io.StringIO()
    handlers = [logging.FileHandler(tmp_path / "train.log"), logging.StreamHandler(console)]
    for h in handlers:
        h.setLevel(logging.INFO)
        root.addHandler(h)
    try:
        log_training_start(logging.getLogger("lit_dtrain.train"))
    finally:
        for h in handlers:
            root.removeHandler(h)
            h.close()
    assert (tmp_path / "train.log").read_text() == f"{TRAINING_STARTS}\n" and console.getvalue() == ""


def test_a_run_stopped_before_logging_the_metric_says_it_did_not_finish(tmp_path, capsys):
    """A sweep job killed at step 7 of 20 with val_check_interval=10 has train/loss but no val/loss and no
    summary.json. stderr said "its row is marked '(unfinished)'", yet its val/loss row was '| ... | - | - | - | - |',
    like a finished run that never logs that metric: the table did not say that the job stopped early."""
    done = write_run(tmp_path / "s" / "0", {9: 3.5, 19: 3.2, 20: 3.2}, overrides=["optimizer.lr=1e-3"])
    (done / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (done / "summary.json").write_text(json.dumps({"steps": 20}))
    killed = tmp_path / "s" / "1"
    with SummaryWriter(str(killed / "tb")) as w:
        w.add_scalar("train/loss", 4.0, 4)
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=3e-3\n")
    (killed / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    result = compare_runs.compare([str(tmp_path / "s")], ["val/loss", "train/loss"], out=str(tmp_path / "c.png"))
    first, second = result["markdown"].split("\n\n")
    assert first.splitlines()[2:] == [
        "| optimizer.lr=1e-3 | 20 | 3.2000 | 3.2000 (20) | +0.00% |",
        "| optimizer.lr=3e-3 | unfinished (no val/loss logged) | - | - | - |",
    ]
    assert second.splitlines()[3] == "| optimizer.lr=3e-3 | 5 (unfinished) | 4.0000 | 4.0000 (5) | +0.00% |"
    assert "its row is marked '(unfinished)'" in capsys.readouterr().err


def test_the_legend_of_many_long_labels_hides_no_curve_and_is_in_the_png(tmp_path, monkeypatch):
    """`compare_runs.py outputs` over a few sweeps: 20 runs labelled like 'strategy=ddp_compressed/local_sgd_adaptive
    experiment=compression_sweep max_steps=20 ...'. The legend, inside the first panel, was wider than the panel: it
    covered the curves and the y label, and its left part (the start of every label) was cut off the PNG. It is
    below the panels now, clear of every panel and its labels, and the PNG holds all of it."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    seen = {}
    savefig = Figure.savefig

    def record(fig, *args, **kwargs):
        savefig(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        legend = fig.axes[0].get_legend()
        seen["legend"] = legend.get_window_extent(renderer)
        seen["texts"] = [t.get_text() for t in legend.get_texts()]
        seen["axes"] = [(ax.get_window_extent(renderer), ax.xaxis.label.get_window_extent(renderer),
                         ax.yaxis.label.get_window_extent(renderer)) for ax in fig.axes]

    monkeypatch.setattr(Figure, "savefig", record)
    curves = {f"strategy=ddp_compressed/preset{i} experiment=compression_sweep trainer.max_steps=20 "
              f"trainer.log_every_n_steps=5 window_size=5": {"val/loss": [(9, 3.0 + i / 10), (19, 2.0 + i / 10)],
                                                               "train/loss": [(9, 3.1), (19, 2.1)]}
              for i in range(20)}
    out = tmp_path / "c.png"
    compare_runs.plot(curves, ["val/loss", "train/loss"], out)
    assert seen["texts"] == list(curves)
    legend = seen["legend"]
    for panel, xlabel, ylabel in seen["axes"]:
        assert not legend.overlaps(panel) and not legend.overlaps(xlabel) and not legend.overlaps(ylabel)
    height, width = imread(out).shape[:2]  # the PNG is at least as large as the legend and the panels above it
    panel = seen["axes"][0][0]
    assert width >= legend.width and height >= legend.height + panel.height


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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--out", "{tmp}/plot.foo"], "--out '{tmp}/plot.foo': matplotlib cannot write '.foo' files"),
        (["--out", "{tmp}/file/plot.png"], "--out '{tmp}/file/plot.png': cannot create its directory"),
        (["--table", "{tmp}/file/t.md"], "--table '{tmp}/file/t.md': cannot create its directory"),
        (["--table", "{tmp}"], "--table '{tmp}' is a directory; give a file path"),
    ],
)
def test_an_unwritable_out_or_table_is_named_before_the_runs_are_read(tmp_path, capsys, flags, message):
    """An --out suffix matplotlib does not write, an output below a file or a --table that is a dir was a
    traceback (ValueError, FileExistsError, IsADirectoryError) after every run was read."""
    run = write_run(tmp_path / "a", {10: 3.0})
    (tmp_path / "file").write_text("a file, not a dir")
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert compare_runs.main([str(run), *flags]) == 2
    captured = capsys.readouterr()
    assert message.format(tmp=tmp_path) in captured.err
    assert "error" in json.loads(captured.out.strip().splitlines()[-1])


def test_outputs_replace_an_existing_file_whole(tmp_path, capsys, monkeypatch):
    """The PNG and table are written beside the target and renamed over it: a failure while writing leaves the
    earlier file as it was, and no temporary file."""
    from matplotlib.figure import Figure

    run = write_run(tmp_path / "a", {10: 3.0})
    out, table = tmp_path / "c.png", tmp_path / "c.md"
    out.write_bytes(b"earlier plot")

    def fail(self, path, **kwargs):
        Path(path).write_bytes(b"half a PNG")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", fail)
    assert compare_runs.main([str(run), "--out", str(out), "--table", str(table)]) == 2
    assert "disk full; the previous file at that path is intact" in capsys.readouterr().out
    assert out.read_bytes() == b"earlier plot" and sorted(p.name for p in tmp_path.iterdir()) == ["a", "c.md", "c.png"]
    monkeypatch.undo()
    assert compare_runs.main([str(run), "--out", str(out), "--table", str(table)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and "| a | 11 | 3.0000 |" in table.read_text()


@pytest.mark.parametrize("content", [b"garbage, not a TensorBoard event file\n", b""])
def test_an_unreadable_event_file_is_named(tmp_path, capsys, content):
    """A garbage or empty event file read as a run without scalars: "no scalar 'val/loss' in any of the 1 runs;
    they have []". The file is named now: an error when it is all the run has, a warning beside readable ones."""
    bad = tmp_path / "bad" / "tb" / "events.out.tfevents.123.host"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content)
    assert compare_runs.main([str(tmp_path / "bad"), "--out", str(tmp_path / "x.png")]) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error == (f"run {str(tmp_path / 'bad')!r}: its event file(s) {str(bad)!r} hold no TensorBoard events "
                     "(unreadable, not an event file, or empty)")
    assert not (tmp_path / "x.png").exists()
    good = write_run(tmp_path / "good", {10: 3.0})
    extra = good / "tb" / "events.out.tfevents.999.host"
    extra.write_bytes(content)
    result = compare_runs.compare([str(good)], ["val/loss"], out=str(tmp_path / "y.png"))
    assert result["runs"][0]["final"] == pytest.approx(3.0)
    assert f"skipping event file(s) {str(extra)!r}" in capsys.readouterr().err


def test_runs_without_any_scalar_say_so(tmp_path):
    SummaryWriter(str(tmp_path / "r" / "tb")).close()  # a run that stopped before logging: file_version only
    with pytest.raises(compare_runs.CompareError, match=r"in any of the 1 runs; they have no scalars at all"):
        compare_runs.compare([str(tmp_path / "r")], ["val/loss"], out=str(tmp_path / "z.png"))


@pytest.mark.parametrize("damage", ["cut", "crc"])
def test_an_event_file_that_cannot_be_read_to_its_end_is_named_with_what_was_read(tmp_path, capsys, damage):
    """TensorBoard's reader stops silently at a record cut off (a killed writer, a full disk) or failing its crc
    check: the run read as one that had logged less, with no word of it. The file is named now, with the events
    and bytes read from it and the last step among them; what could be read is still compared."""
    run = write_run(tmp_path / "run", {10: 3.0, 20: 2.5, 30: 2.6})
    (event_file,) = (run / "tb").iterdir()
    data = event_file.read_bytes()
    last_record_at = 0  # TFRecord framing: an 8-byte length, its crc, the event, the event's crc
    while last_record_at + 16 + int.from_bytes(data[last_record_at : last_record_at + 8], "little") < len(data):
        last_record_at += 16 + int.from_bytes(data[last_record_at : last_record_at + 8], "little")
    if damage == "cut":  # the last record (lr-AdamW/decay at step 30) loses its last 5 bytes
        event_file.write_bytes(data[:-5])
        reason = "it ends in a partial record: its writer was killed mid-record, or the disk was full"
    else:  # a byte of the last record's event flipped
        event_file.write_bytes(data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:])
        reason = "a record fails its crc check: the file is damaged there"
    result = compare_runs.compare([str(run)], ["val/loss", "lr-AdamW/decay"], out=str(tmp_path / "x.png"))
    err = capsys.readouterr().err
    size = event_file.stat().st_size
    assert (f"compare_runs: run {str(run)!r}: event file {str(event_file)!r} cannot be read to its end ({reason}); "
            f"using its first 6 events, up to step 30 ({last_record_at} of its {size} bytes)\n") in err
    assert result["runs"][0]["by_metric"]["val/loss"]["final_step"] == 31  # read before the damaged record
    assert result["runs"][0]["by_metric"]["lr-AdamW/decay"]["final_step"] == 21  # its step-30 point is lost


def test_a_failed_write_of_the_table_is_one_error_line(tmp_path, capsys, monkeypatch):
    """``--table /proc/t.md`` as root (the directory passes the writable check), or a full disk: the write's
    AtomicWriteError was a traceback with exit status 1. It is one JSON error line naming the file now, status 2."""
    from lit_dtrain.utils.atomic import AtomicWriteError

    a = write_run(tmp_path / "a", {5: 3.0})

    def full_disk(path, write):
        raise AtomicWriteError(Path(path), OSError(28, "No space left on device"))

    monkeypatch.setattr(compare_runs, "write_atomically", full_disk)
    assert compare_runs.main([str(a), "--out", str(tmp_path / "c.png"), "--table", str(tmp_path / "t.md")]) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert "t.md" in error and "No space left on device" in error


def test_a_run_given_twice_is_compared_once(tmp_path, capsys):
    """``compare_runs.py SWEEP SWEEP/1`` (or a run dir twice) compared job 1 with itself: two rows and two curves of
    the same values, labelled '//tmp/.../1' and '//tmp/.../1 (2)', as if a rerun had reproduced it."""
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["1e-3", "3e-3"]):
        write_run(sweep / str(i), {5: 3.0 - i * 0.1}, overrides=[f"optimizer.lr={lr}"])
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that logged nothing, reached twice too
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=1e-2\n")
    result = compare_runs.compare([str(sweep), str(sweep / "1"), str(sweep / "0" / "."), str(sweep / "2")],
                                  ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["dir"] for r in result["runs"]] == [str(sweep / "0"), str(sweep / "1")]
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    assert result["skipped"] == [str(sweep / "2")] and len(result["markdown"].splitlines()) == 5
    assert "given more than once" in capsys.readouterr().err


def test_runs_of_other_batch_sizes_are_drawn_against_tokens(tmp_path, monkeypatch, capsys):
    """A sweep over the batch size compared loss at equal steps, the larger batch having seen twice the data.
    ``--x tokens`` draws each run against the steps trained x its tokens per step: train/lengths' rate (its count
    restarting at a resume from an older checkpoint does not change it) times the ranks, the ratio of the global to
    the device train/items_per_sec. A point logged during fit at step s (0-based) is drawn after s + 1 steps."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        (fig.axes[0].get_xlabel(), {line.get_label(): list(line.get_data()[0]) for line in fig.axes[0].lines})))
    # per-rank tokens, ranks, resumed at; 'short' ran on 3 ranks too briefly to log the rates (its config says so)
    runs = {"b2": (64, 1, None), "b4": (128, 1, 5), "b2x2": (64, 2, None), "short": (64, 3, None)}
    for name, (per_rank, ranks, resumed) in runs.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step in range(8):
            w.add_scalar("val/loss", 3.0 - step * 0.1, step)
            done = step + 1 - (resumed if resumed and step >= resumed else 0)
            w.add_scalar("train/lengths", per_rank * done, step)
            if name != "short":
                w.add_scalar("train/device/items_per_sec", 100.0, step)
            if ranks > 1 and name != "short":
                w.add_scalar("train/items_per_sec", 100.0 * ranks, step)
        w.close()
    (tmp_path / "short" / "config_resolved.yaml").write_text("trainer:\n  devices: 3\n  num_nodes: 1\n")
    args = [str(tmp_path / n) for n in runs] + ["--out", str(tmp_path / "c.png"), "--x", "tokens"]
    assert compare_runs.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["tokens_per_step"] for r in result["runs"]] == [64, 128, 128, 192]
    assert seen[0][0].startswith("tokens") and [xs[-1] for xs in seen[0][1].values()] == [512, 1024, 1024, 1536]
    w = SummaryWriter(str(tmp_path / "quiet" / "tb"))  # throughput callback off: no train/lengths
    w.add_scalar("val/loss", 3.0, 1)
    w.close()
    # (or a run shorter than trainer.log_every_n_steps=10: its error named the callback alone, which was on)
    with pytest.raises(compare_runs.CompareError, match=r"--x tokens: run '.*quiet' has no 'train/lengths' .*it was "
                       r"off, or the run stopped before its first logged step\)"):
        compare_runs.compare([str(tmp_path / "b2"), str(tmp_path / "quiet")], ["val/loss"], x="tokens")


def test_validations_are_drawn_at_the_tokens_trained_when_they_measured(tmp_path, monkeypatch):
    """Real runs (model=nano, block_size=64): batch 2 for 8 steps, validating every 4, and batch 4 for 4 steps, every
    2, logged val/loss at 3, 7, 8 and 1, 3, 4 (Lightning's 0-based step during fit, train(cfg)'s final validate at
    the steps trained). ``--x tokens`` drew their validations after 512 tokens at 384 and 256: one batch early, the
    larger batch further back, at equal data. Both are at 512 now, and the final validations at 1024 (8 x 128 and
    4 x 256, not one step later); train/lengths, the tokens trained, lies on x = y."""
    from matplotlib.figure import Figure

    seen = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.append(
        [{line.get_label(): list(zip(*line.get_data())) for line in ax.lines} for ax in fig.axes]))
    logged = {"b2": (128, 8, [3, 7, 8], [4.0544, 3.6254, 3.6254]), "b4": (256, 4, [1, 3, 4], [4.5342, 4.2693, 4.2693]),
              "b4_6": (256, 6, [3, 6], [4.2693, 4.0]),  # 6 steps, validating every 4: the final validate is new
              "killed": (128, 8, [3, 7], [4.0544, 3.6254])}  # before its final validate: no summary.json
    for name, (per_step, steps, val_steps, values) in logged.items():
        w = SummaryWriter(str(tmp_path / name / "tb"))
        for step, value in zip(val_steps, values):
            w.add_scalar("val/loss", value, step)
        for step in range(steps):
            w.add_scalar("train/lengths", per_step * (step + 1), step)
        w.close()
        (tmp_path / name / "config_resolved.yaml").write_text("trainer:\n  devices: 1\n")
        if name != "killed":
            (tmp_path / name / "summary.json").write_text(json.dumps({"steps": steps}))
    runs = [str(tmp_path / name) for name in logged]
    compare_runs.compare(runs, ["val/loss", "train/lengths"], out=str(tmp_path / "c.png"), x="tokens")
    val, lengths = ({label: [float(x) for x, _ in points] for label, points in panel.items()} for panel in seen[0])
    assert val == {"b2": [512, 1024], "b4": [512, 1024], "b4_6": [1024, 1536], "killed": [512, 1024]}
    assert all(x == y for points in seen[0][1].values() for x, y in points) and lengths["b2"][-1] == 1024


def test_a_run_that_logged_no_train_lengths_is_drawn_by_its_config(tmp_path):
    """A real sweep job (max_steps=6, val_check_interval=3, the default log_every_n_steps=10) that failed at step 5
    (NonFiniteError) logged val/loss at step 2 but no train/lengths: '--x tokens' over its sweep stopped with 'run
    ... has no train/lengths'. Its tokens per step come from its config_resolved.yaml now (batch 4 x block 32)."""
    run = write_run(tmp_path / "nan", {2: 5.126})
    (run / "config_resolved.yaml").write_text(
        "data: {batch_size: 4, block_size: 32}\ntrainer: {accumulate_grad_batches: 2, devices: 2, num_nodes: 1}\n")
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")
    assert result["runs"][0]["tokens_per_step"] == 4 * 32 * 2 * 2
    (run / "config_resolved.yaml").write_text("trainer: {devices: 1}\n")  # not train.py's: no batch size
    with pytest.raises(compare_runs.CompareError, match="has no 'train/lengths'"):
        compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"), x="tokens")


def test_labels_name_what_the_runs_trained_with_not_only_what_was_typed(tmp_path):
    """A baseline run with the default LR beside one with ``optimizer.lr=1e-2`` was labelled by its dir name, and a
    run that typed ``scheduler=wsd`` (the default) beside one that did not was labelled 'scheduler=wsd', as if its
    schedule differed. Labels are checked against each run's config_resolved.yaml and config-group choices now."""
    runs = {
        "a": (["scheduler=wsd", "trainer.max_steps=12"], "wsd", 0.003),
        "b": (["optimizer.lr=1e-2", "trainer.max_steps=12"], "wsd", 0.01),
        "c": (["scheduler=cosine", "trainer.max_steps=12"], "cosine", 0.003),
    }
    for name, (overrides, scheduler, lr) in runs.items():
        run = write_run(tmp_path / name, {12: 3.0}, overrides=overrides)
        (run / "config_resolved.yaml").write_text(f"optimizer:\n  lr: {lr}\ntrainer:\n  max_steps: 12\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      scheduler: {scheduler}\n")
    labels = [r["label"] for r in compare_runs.compare([str(tmp_path / n) for n in runs], ["val/loss"])["runs"]]
    assert labels == ["scheduler=wsd optimizer.lr=0.003", "optimizer.lr=1e-2 scheduler=wsd",
                      "scheduler=cosine optimizer.lr=0.003"]
    two = [r["label"] for r in compare_runs.compare([str(tmp_path / "a"), str(tmp_path / "b")], ["val/loss"])["runs"]]
    assert two == ["optimizer.lr=0.003", "optimizer.lr=1e-2"]
    (tmp_path / "b" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=3e-3\n- trainer.max_steps=12\n")
    (tmp_path / "b" / "config_resolved.yaml").write_text("optimizer:\n  lr: 0.003\ntrainer:\n  max_steps: 12\n")
    three = [r["label"] for r in compare_runs.compare([str(tmp_path / n) for n in "bac"], ["val/loss"])["runs"]]
    assert three == ["scheduler=wsd (b)", "scheduler=wsd (a)", "scheduler=cosine"]  # 3e-3 typed is the default 0.003


def test_the_jsons_runs_are_in_the_tables_order(tmp_path):
    """``compare_runs.py SWEEP/1 SWEEP/0``: the table lists job 0 then job 1 (a sweep's jobs in job order), but the
    JSON's runs kept the order they were found in, 1 then 0, so a script reading runs[0] read another run than the
    table's first row."""
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["1e-3", "3e-3"]):
        write_run(sweep / str(i), {5: 3.0 - i * 0.1}, overrides=[f"optimizer.lr={lr}"])
    result = compare_runs.compare([str(sweep / "1"), str(sweep / "0")], ["val/loss"])
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    assert [line.split(" | ")[0] for line in result["markdown"].splitlines()[2:]] == [
        "| optimizer.lr=1e-3", "| optimizer.lr=3e-3"]


def test_a_multi_select_groups_choice_labels_a_run_as_typed(tmp_path):
    """A run whose callbacks list came from its config beside one that typed 'callbacks=[default]': its choice (a
    list in .hydra/hydra.yaml) is written as it would be typed, not as Python's list repr."""
    runs = {"d": ([], "[default, loss_spike]"), "e": (["callbacks=[default]"], "[default]")}
    for name, (typed, choice) in runs.items():
        run = write_run(tmp_path / name, {12: 3.0}, overrides=["trainer.max_steps=12", *typed])
        (run / "config_resolved.yaml").write_text("trainer:\n  max_steps: 12\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      callbacks: {choice}\n")
    two = [r["label"] for r in compare_runs.compare([str(tmp_path / "d"), str(tmp_path / "e")], ["val/loss"])["runs"]]
    assert two == ["callbacks=[default,loss_spike]", "callbacks=[default]"]


def test_a_run_without_the_experiment_another_used_is_labelled_experiment_null(tmp_path):
    """A baseline run beside a job of '-m experiment=wsd_vs_cosine': the baseline's choice of the group, none
    (null in .hydra/hydra.yaml), was labelled 'experiment=None', which typed is no option of the group (Hydra looks
    for experiment/None.yaml); it is written as it would be typed, 'experiment=null'."""
    runs = {"base": ([], "null"), "exp": (["experiment=wsd_vs_cosine"], "wsd_vs_cosine")}
    for name, (typed, choice) in runs.items():
        run = write_run(tmp_path / name, {12: 3.0}, overrides=["trainer.max_steps=12", *typed])
        (run / "config_resolved.yaml").write_text("trainer:\n  max_steps: 12\n")
        (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      experiment: {choice}\n")
    two = [r["label"] for r in compare_runs.compare([str(tmp_path / n) for n in runs], ["val/loss"])["runs"]]
    assert two == ["experiment=null", "experiment=wsd_vs_cosine"]
