"""compare_runs.py's table of what each finished run took: its steps, the tokens it trained and its wall time."""

from __future__ import annotations

import json

from tests.unit._compare_runs_helpers import compare_runs, write_run


def test_each_finished_run_has_its_tokens_and_wall_time_a_resumed_one_its_last_starts(tmp_path):
    """A sweep's runs of other batch sizes, one resumed at step 4 (its summary.json counts the last start's 2048
    tokens and 75 s), one unfinished: the table gave steps and losses only, and the tokens and wall time had to be
    read from each summary.json (or asked as --metric train/tokens, which a short run never logs)."""
    runs = {"b8": (4096, 0, 39.74), "b16": (2048, 4, 75.2), "b4": None}
    for name, summary in runs.items():
        run = write_run(tmp_path / name, {3: 4.0, 7: 3.5})
        (run / "config_resolved.yaml").write_text("seed: 0\n")  # a train.py run dir
        if summary:
            tokens, start, wall = summary
            (run / "summary.json").write_text(json.dumps(
                {"steps": 8, "tokens": tokens, "start_step": start, "wall_seconds": wall}))
    result = compare_runs.compare([str(tmp_path / n) for n in runs], ["val/loss"], out=None)
    cost = result["cost_markdown"].splitlines()[2:]
    assert cost == ["| b8 | 8 | 4,096 | 39.7 s |", "| b16 | 8 | 4,096 | 1:15 min (since step 4) |",
                    "| b4 | unfinished | - | - |"]
    assert [r["cost"] for r in result["runs"]] == [
        {"steps": 8, "steps_dropped": 0, "tokens_trained": 4096, "wall_seconds": 39.74, "wall_since_step": 0},
        {"steps": 8, "steps_dropped": 0, "tokens_trained": 4096, "wall_seconds": 75.2, "wall_since_step": 4},
        {},
    ]


def test_no_cost_table_where_no_run_finished(tmp_path):
    write_run(tmp_path / "a", {3: 4.0})
    assert compare_runs.compare([str(tmp_path / "a")], ["val/loss"], out=None)["cost_markdown"] is None


def test_the_cost_table_lists_the_failed_and_never_started_jobs_the_other_tables_list(tmp_path):
    """A 6-job sweep (3 schedules x 2 LRs) stopped in job 1, whose job 2 failed at its start: the val/loss table had
    6 rows (finished, unfinished, failed, 3 not started), the cost table 2, and read as a complete sweep of two
    runs. Every job has its row there now, in the same order, its status in the steps column."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    params:\n      scheduler: wsd,cosine,linear\n"
        "  overrides:\n    task:\n    - optimizer.lr=1e-3,3e-3\n    - trainer.max_steps=5\n"
    )
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        write_run(sweep / job, {5: 3.0} if job == "0" else {2: 3.2},
                  overrides=["scheduler=wsd", f"optimizer.lr={lr}", "trainer.max_steps=5"])
        (sweep / job / "config_resolved.yaml").write_text("trainer: {max_steps: 5}\n")
    (sweep / "0" / "summary.json").write_text(
        json.dumps({"steps": 5, "tokens": 640, "start_step": 0, "wall_seconds": 3.5}))
    (sweep / "2" / ".hydra").mkdir(parents=True)
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text(
        "- scheduler=cosine\n- optimizer.lr=0.001\n- trainer.max_steps=5\n")
    (sweep / "2" / "train.log").write_text(
        "[2026-12-03 19:57:47,120][lit_dtrain.train][ERROR] - job 2 failed: ConfigError: bad\n")
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=None)
    labels = [line.split(" | ")[0] for line in result["markdown"].splitlines()[2:]]
    cost = result["cost_markdown"].splitlines()[2:]
    assert [line.split(" | ")[0] for line in cost] == labels and len(labels) == 6
    assert cost == [
        "| scheduler=wsd optimizer.lr=0.001 | 5 | 640 | 3.5 s |",
        "| scheduler=wsd optimizer.lr=0.003 | unfinished | - | - |",
        "| scheduler=cosine optimizer.lr=0.001 | failed | - | - |",
        "| scheduler=cosine optimizer.lr=0.003 | not started | - | - |",
        "| scheduler=linear optimizer.lr=0.001 | not started | - | - |",
        "| scheduler=linear optimizer.lr=0.003 | not started | - | - |",
    ]


def test_steps_a_loss_spike_dropped_are_not_counted_as_tokens_trained(tmp_path):
    """A run of 12 steps whose step 6 LossSpikeMonitor skipped (a real run: spikes.jsonl's record, summary.json's
    tokens 24,576) read '| 12 | 24,576 |': the skipped step's 2,048 tokens counted as trained. Here also a rollback at
    step 10 to the snapshot of step 8 (steps 8, 9 and 10 undone), a logged-only spike and a level shift (applied)."""
    run = write_run(tmp_path / "spiky", {11: 3.3})
    (run / "config_resolved.yaml").write_text("seed: 0\n")
    (run / "summary.json").write_text(json.dumps({"steps": 12, "tokens": 24576, "start_step": 0,
                                                  "wall_seconds": 10.0}))
    records = [{"step": 3, "actions": ["log"], "rolled_back_to": None},
               {"step": 6, "actions": ["log", "skip"], "rolled_back_to": None},
               {"step": 7, "reasons": ["level_shift"], "actions": []},
               {"step": 10, "actions": ["log", "rollback"], "rolled_back_to": 8}]
    (run / "spikes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 1, "acti\n')
    result = compare_runs.compare([str(run)], ["val/loss"], out=None)
    assert result["runs"][0]["cost"] == {"steps": 12, "steps_dropped": 4, "tokens_trained": 16384,
                                         "wall_seconds": 10.0, "wall_since_step": 0}
    assert result["cost_markdown"].splitlines()[2] == "| spiky | 12 (4 dropped) | 16,384 | 10.0 s |"


def test_the_tokens_axis_leaves_out_a_dropped_step_from_the_step_after_it(tmp_path):
    """``--x tokens`` read train/tokens, which counts a skipped step's tokens too: after step 6 was skipped the
    axis stood 2,048 tokens ahead of the cost table. A drop counts from the step after its event: a rollback at
    step 10 to step 8's snapshot leaves the validations measured at 9 and 10 where they were (their weights held
    steps 8 and 9), and takes steps 8 to 10 out after it."""
    run = tmp_path / "spiky"
    run.mkdir()
    (run / "spikes.jsonl").write_text(json.dumps({"step": 6, "actions": ["skip"], "rolled_back_to": None}) + "\n"
                                      + json.dumps({"step": 10, "actions": ["rollback"], "rolled_back_to": 8}) + "\n")
    at = compare_runs.tokens_trained(str(run), {"train/tokens": [(s, 2048.0 * (s + 1)) for s in range(12)]})[0]
    assert [at(t) / 2048 for t in (6, 7, 9, 10, 11, 12)] == [6, 6, 8, 9, 7, 8]
