"""The ``--over`` groups table: the gap to the best group's mean is signed by which group is better, also where the
best mean is negative (a log-likelihood, a reward), and a group holding a non-finite value shows '-' for its mean."""

from __future__ import annotations

import math

from tests.unit._compare_runs_helpers import compare_runs

METRIC = "my/logprob"


def _row(label: str, final: float) -> dict:
    return {"label": label, "finished": True,
            "by_metric": {METRIC: {"final": final, "best": final, "best_step": 9}}}


def _table(finals: dict[str, list[float]], maximize: bool) -> list[str]:
    rows = [_row(f"{g} seed={i}", v) for g, values in finals.items() for i, v in enumerate(values)]
    groups = {r["label"]: r["label"].split(" ")[0] for r in rows}
    summary = compare_runs.summarize_groups(rows, groups, [METRIC])
    return compare_runs.groups_table(summary, METRIC, ["seed"], maximize).splitlines()[2:]


def test_the_gap_to_a_negative_best_mean_is_negative_for_a_worse_group():
    """Better higher, means -2.1 (best) and -3.1: the worse group is 47.62 % below the best, '-47.62%'; dividing by
    the signed best mean, not its size, printed '+47.62%' (and '-0.00%' for the best group itself)."""
    assert _table({"lr=1": [-2.0, -2.2], "lr=2": [-3.0, -3.2]}, maximize=True) == [
        "| lr=1 | 2 | -2.1000 ± 0.1414 | -2.1000 ± 0.1414 | +0.00% |",
        "| lr=2 | 2 | -3.1000 ± 0.1414 | -3.1000 ± 0.1414 | -47.62% |",
    ]
    # better lower, best mean -3.1: the other group is worse by 32.26 %, a positive gap as for positive losses
    assert [line.split(" | ")[-1] for line in _table({"lr=1": [-2.0, -2.2], "lr=2": [-3.0, -3.2]}, False)] == [
        "+32.26% |", "+0.00% |"]


def test_a_group_holding_an_inf_shows_no_mean():
    """One seed diverged to inf: the group's mean and std are unknown ('-'), not 'inf' (a group of that run alone)
    nor the mean of the finite seeds; its gap is '-' and the finite group stays the best."""
    table = _table({"lr=1": [3.0, 3.2], "lr=2": [math.inf], "lr=3": [3.1, math.inf]}, maximize=False)
    assert table == [
        "| lr=1 | 2 | 3.1000 ± 0.1414 | 3.1000 ± 0.1414 | +0.00% |",
        "| lr=2 | 1 | - | - | - |",
        "| lr=3 | 2 | - | - | - |",
    ]
