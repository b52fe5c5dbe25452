"""A seventh hand mutation audit: compare_runs.py's table helpers pinned by exact results where a single-point mutant
of ``_compare_runs_table.py`` or ``_compare_runs_groups.py`` passed the test_compare_runs*.py files of their code."""

from __future__ import annotations

import sys

from tests.unit._compare_runs_helpers import compare_runs  # loading it puts scripts/ on sys.path

table = sys.modules["_compare_runs_table"]
groups_mod = sys.modules["_compare_runs_groups"]
assert compare_runs.markdown_table is table.markdown_table


def test_a_value_of_exactly_0_01_has_four_decimals():
    """0.01 is the lower edge of the 4-decimal range (``0.01 <= |v|``): with ``<`` it read 1.000e-02."""
    assert [table._number(v) for v in (0.01, -0.01, 0.00999, 0.0)] == ["0.0100", "-0.0100", "0.00999", "0.0000"]


def test_sweep_jobs_are_ordered_by_number_and_kept_together():
    """Job dirs (numbered) sort by job number (job 10 after job 2, not between 1 and 2), and a sweep's jobs given
    one by one (the README's ``<sweep>/*`` glob) stay together, at the first job's argument."""
    assert table.table_order(["s/10", "s/2", "s/1"]) == [2, 1, 0]
    assert table.table_order(["s/1", "r", "s/2"], given=["s/1", "r", "s/2"]) == [0, 2, 1]


def test_a_cumulative_metrics_group_table_shows_no_best():
    """``spike/count`` is ranked by its final value alone: its groups table says 'best (not ranked)' and shows no
    best mean, as its runs table does."""
    stats = {"n": 2, "left_out": 0, "final_mean": 2.0, "final_std": 1.0, "best_mean": 0.0, "best_std": 0.0}
    group = {"label": "lr=1", "runs": ["a", "b"], "by_metric": {"spike/count": stats}}
    text = groups_mod.groups_table([group], "spike/count", ["seed"], maximize=False)
    assert text.splitlines()[0] == ("| runs (mean ± std over seed) | n | final spike/count | best (not ranked) | "
                                    "vs best mean |")
    assert text.splitlines()[2] == "| lr=1 | 2 | 2.0000 ± 1.0000 | - | +0.00% |"
