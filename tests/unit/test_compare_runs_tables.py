"""scripts/compare_runs.py: a table and JSON values per metric, number formats, metrics where higher is better."""

from __future__ import annotations

import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs


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
