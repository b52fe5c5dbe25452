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
                    "| b4 | - | - | - |"]
    assert [r["cost"] for r in result["runs"]] == [
        {"steps": 8, "tokens_trained": 4096, "wall_seconds": 39.74, "wall_since_step": 0},
        {"steps": 8, "tokens_trained": 4096, "wall_seconds": 75.2, "wall_since_step": 4},
        {},
    ]


def test_no_cost_table_where_no_run_finished(tmp_path):
    write_run(tmp_path / "a", {3: 4.0})
    assert compare_runs.compare([str(tmp_path / "a")], ["val/loss"], out=None)["cost_markdown"] is None
