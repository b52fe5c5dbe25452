"""A group's best mean is of all its finished runs or none: a run with no best value (every value NaN: it diverged)
leaves the group's best '-', not the mean of the other runs' bests shown as the group's."""

from __future__ import annotations

import math

from tests.unit._compare_runs_helpers import compare_runs


def _row(label: str, final: float, best: float, best_step: int | None) -> dict:
    return {"label": label, "finished": True,
            "by_metric": {"val/loss": {"final": final, "best": best, "best_step": best_step}}}


def test_a_run_without_a_best_value_leaves_its_groups_best_unknown():
    rows = [_row("s0", 3.0, 2.5, 4), _row("s1", math.nan, math.nan, None), _row("t0", 3.2, 2.9, 4)]
    groups = {"s0": "lr=1", "s1": "lr=1", "t0": "lr=2"}
    by_label = {g["label"]: g["by_metric"]["val/loss"] for g in compare_runs.summarize_groups(rows, groups,
                                                                                             ["val/loss"])}
    assert by_label["lr=1"]["n"] == 2 and math.isnan(by_label["lr=1"]["best_mean"])
    assert math.isnan(by_label["lr=1"]["final_mean"])
    assert by_label["lr=2"]["best_mean"] == 2.9 and by_label["lr=2"]["final_mean"] == 3.2


def test_a_groups_mean_curve_is_at_the_steps_every_run_measured():
    """Two seeds whose validations fell at other steps (another val_check_interval after a resume): the mean curve
    has the shared steps only, each the mean of both runs (a union of the steps failed on the steps one run lacks)."""
    rows = [{"label": "s0", "finished": True}, {"label": "s1", "finished": True}]
    curves = {"s0": {"val/loss": [(2, 4.0), (4, 3.0), (6, 2.0)]}, "s1": {"val/loss": [(3, 4.4), (4, 3.4), (6, 2.4)]}}
    means, spread = compare_runs.mean_curves(curves, rows, {"s0": "lr=1", "s1": "lr=1"}, ["val/loss"])
    assert [s for s, _ in means["lr=1"]["val/loss"]] == [4, 6]
    assert [round(v, 9) for _, v in means["lr=1"]["val/loss"]] == [3.2, 2.2]
    assert [round(v, 9) for v in spread["lr=1"]["val/loss"]] == [round(0.4 / 2**0.5, 9)] * 2
