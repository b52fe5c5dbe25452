"""Exact results of the ``budget`` probe (``callbacks/_checkpoint_budget.py``) where single-point mutants passed
test_checkpoint_budget.py and test_selective_checkpointing*.py (eleventh hand mutation audit). The probe's
measurements are replaced by stand-ins with known bytes (and its stopwatch by a clock with known ticks), so the plan
it verifies and re-plans, and its report, are checked to the byte."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import lit_dtrain.callbacks._checkpoint_budget as budget
from lit_dtrain.callbacks._checkpoint_budget import budget_bytes, budget_plan_from_probe, time_block_ops
from lit_dtrain.callbacks._checkpoint_policies import SaveOpsPolicy, resolve_ops
from tests.unit._selective_ckpt_helpers import fake_probe

F, S, N = "full", "selective", "none"


def test_a_plan_that_misses_is_replanned_by_the_miss_and_measured_again(monkeypatch):
    """Budget 0.8 of 40 bytes: ``selective, selective, none, none`` is estimated at 30 and measured at 34, a miss of
    4, so the planner asks for 32 - 4 = 28: three ``selective`` blocks, estimated 25 and measured 29, which fits. The
    report gives the last try's figures, and all-``full``'s estimate (13 of 40)."""
    plan, report, wrappers = fake_probe(monkeypatch, lambda plan: 4.0, 0.8)
    assert plan == [S, S, S, N] and [w.mode for w in wrappers] == plan
    assert report == {
        "memory_budget": 0.8, "none_act_bytes": 40, "plan": [S, S, S, N], "measured_ratio": 29 / 40,
        "estimated_ratio": 25 / 40, "fits": True, "full_ratio": 13 / 40, "measured_bytes": 29, "budget_bytes": 32,
        "tries": [{"plan": [S, S, N, N], "estimated_ratio": 30 / 40, "measured_ratio": 34 / 40},
                  {"plan": [S, S, S, N], "estimated_ratio": 25 / 40, "measured_ratio": 29 / 40}],
    }
    # one re-plan allowed: two measured tries, the same plan
    assert fake_probe(monkeypatch, lambda plan: 4.0, 0.8, max_replans=1)[1]["tries"] == report["tries"]


def test_a_plan_measured_exactly_at_the_budget_fits(monkeypatch):
    """``selective, selective, none, none`` measured at 30 of 40 bytes under a 0.75 budget: it fits (at most the
    budget), in one try."""
    plan, report, _ = fake_probe(monkeypatch, lambda plan: 0.0, 0.75)
    assert plan == [S, S, N, N] and report["fits"] is True and report["measured_ratio"] == 0.75
    assert len(report["tries"]) == 1


def test_the_probe_refuses_a_budget_of_zero():
    """``memory_budget`` is a fraction in (0, 1]: 0 would ask for no activation memory at all."""
    with pytest.raises(ValueError, match=r"memory_budget must be in \(0, 1\], got 0.0"):
        budget_plan_from_probe(lambda: None, torch.nn.Linear(2, 2), [], [], 0.0)


class ThreeOps(torch.nn.Module):
    """Three aten ops a call, known ones: ``mm`` (saved by ``selective``), ``relu`` and ``mul`` (recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return torch.relu(torch.mm(x, self.weight)) * 2


def test_the_stopwatch_adds_each_op_to_its_block_and_keeps_the_fastest_repeat(monkeypatch):
    """A clock that ticks 1 s per op in the first repeat and 2 s in the second: block 0 (called twice) recomputes 6
    ops in full, 4 of them not saved by ``selective``; block 1, 3 and 2; the head's 2 ops after the last block and the
    input's before the first are no block's. The fastest repeat is kept."""
    blocks = [ThreeOps(), ThreeOps()]
    runs, clock = [0], [0.0]

    def tick():
        clock[0] += runs[0]  # read before and after each op: an op of run r lasts r seconds
        return clock[0]

    def forward():
        runs[0] += 1
        x = torch.ones(2, 2) + 1  # 1 op before the blocks
        x = blocks[1](blocks[0](blocks[0](x)))
        return (x @ torch.ones(2, 2)).sum()  # 2 ops after them

    monkeypatch.setattr(budget, "time", SimpleNamespace(perf_counter=tick))
    full, sel = time_block_ops(forward, blocks, SaveOpsPolicy(resolve_ops(["aten.mm"])))
    assert runs[0] == 2 and (full, sel) == ([6.0, 3.0], [4.0, 2.0])




def test_a_plan_measured_at_the_budget_to_the_byte_is_kept_where_the_product_rounds_below_it(monkeypatch):
    """Budget 0.35 of 180 bytes: 0.35 * 180 is 62.99999999999999 in floats, 63 / 180 is 0.35. ``full, selective,
    selective, none`` (estimated 59) measured 63 bytes: the re-plan loop took it for a miss (63 > 0.35 * 180) and
    re-planned to ``full, full, selective, none`` (3 s more recompute), while the report's rule (measured_ratio <=
    memory_budget) read that first try's 0.35 as fitting. Both now read 63 as at the budget: kept, in one try."""
    retained = {"none": 45.0, "selective": 6.5, "full": 1.0}
    plan, report, _ = fake_probe(monkeypatch, lambda plan: 4.0 if plan == [F, S, S, N] else 0.0, 0.35, retained)
    assert plan == [F, S, S, N] and report["fits"] is True and report["measured_ratio"] == 0.35
    assert report["tries"] == [{"plan": [F, S, S, N], "estimated_ratio": 59 / 180, "measured_ratio": 63 / 180}]


def test_the_planner_takes_a_plan_estimated_at_the_budget_to_the_byte(monkeypatch):
    """The planner compared estimates with the same rounded product: ``selective, selective, selective, none``,
    estimated (and measured) 63 of 180 bytes under 0.35, was passed over for ``full, selective, selective, none`` (6 s
    of recompute for 3 s). The cheapest plan at the budget is taken."""
    retained = {"none": 45.0, "selective": 6.0, "full": 1.0}
    plan, report, _ = fake_probe(monkeypatch, lambda plan: 0.0, 0.35, retained)
    assert plan == [S, S, S, N] and report["fits"] is True and report["measured_ratio"] == 0.35
    assert len(report["tries"]) == 1


def test_the_budget_in_bytes_is_the_ratio_rule_either_way_the_product_rounds():
    """``memory_budget * none_act`` rounds below (0.35 * 180 = 62.99999999999999) or above (0.1 * 3 =
    0.30000000000000004, whose ratio to 3 exceeds 0.1): the bytes are moved to the last float whose ratio is at most
    the budget, so ``bytes <= budget_bytes`` and ``bytes / none_act <= memory_budget`` agree on every float."""
    import math

    assert budget_bytes(180, 0.35) == 63.0 and budget_bytes(3, 0.1) == 0.3
    for memory_budget in (0.1, 0.35, 0.45, 0.7, 1.0):
        for none_act in (3, 180, 1000, 14093328, 2**31 + 7):
            target = budget_bytes(none_act, memory_budget)
            assert target / none_act <= memory_budget < math.nextafter(target, math.inf) / none_act
