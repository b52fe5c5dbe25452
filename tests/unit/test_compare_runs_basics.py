"""scripts/compare_runs.py: the table, PNG and JSON of a few runs, its errors, diverged and stopped runs, the final
validate."""

from __future__ import annotations

import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


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
    # --out '' draws nothing: the line was 'wrote ' (and 'wrote  and cmp.md' with --table), naming no file
    assert compare_runs.main([str(a), str(b), "--out", ""]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert compare_runs.main([str(a), str(b), "--out", "", "--table", str(table)]) == 0
    assert f"\nwrote {table}\n" in capsys.readouterr().out


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
    train.py run's final validate is the point at its summary.json's steps (in an unfinished run: at max_steps)."""
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
    # a fit logs below max_steps (6): the point at 6 is a final validate's, of a run killed before its summary.json
    # (it read 7, a step more than the run trained)
    assert rows["killed"]["val/loss"]["final_step"] == 6


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
