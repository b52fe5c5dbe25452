"""``SelectiveCheckpointing``'s plan where people look: ``summary.json``'s ``activation_checkpointing`` entry and the
``ckpt/*`` scalars (``callbacks/_checkpoint_report.py``); the e2e test reads them from a ``train(cfg)`` run."""

from __future__ import annotations

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.callbacks._checkpoint_report import plan_figures, plan_scalars, summary_entry
from tests.unit._selective_ckpt_helpers import fake_probe

F, S, N = "full", "selective", "none"


def test_the_probes_figures_of_the_plan_in_use(monkeypatch):
    """Budget 0.8 of 40 bytes, the first plan missing by 4: the figures are the last try's (29 of 40 bytes, 0.725),
    the budget in bytes 32, two tries; the scalars give the same, the bytes in MiB."""
    plan, report, _ = fake_probe(monkeypatch, lambda plan: 4.0, 0.8)
    figures = plan_figures("budget", plan, report)
    assert figures == {"policy": "budget", "plan": [S, S, S, N], "blocks_none": 1, "blocks_selective": 3,
                       "blocks_full": 0, "memory_budget": 0.8, "measured_ratio": 29 / 40, "estimated_ratio": 25 / 40,
                       "fits": True, "none_act_bytes": 40, "measured_bytes": 29, "budget_bytes": 32, "tries": 2}
    assert plan_scalars(figures) == {
        "ckpt/blocks_none": 1.0, "ckpt/blocks_selective": 3.0, "ckpt/blocks_full": 0.0, "ckpt/memory_budget": 0.8,
        "ckpt/measured_ratio": 29 / 40, "ckpt/estimated_ratio": 25 / 40, "ckpt/probe_act_mib": 29 / 2**20,
        "ckpt/probe_budget_mib": 32 / 2**20}


def test_a_resumed_plan_the_probe_did_not_measure_gets_no_probe_figures(monkeypatch):
    """A resumed ``budget`` run trains with its checkpoint's plan: this start's probe figures are of another plan, so
    only the plan and its counts are given; so under a block-level policy."""
    _, report, _ = fake_probe(monkeypatch, lambda plan: 0.0, 0.8)
    resumed = [F, N, N, N]
    assert plan_figures("budget", resumed, report) == {"policy": "budget", "plan": resumed, "blocks_none": 3,
                                                       "blocks_selective": 0, "blocks_full": 1}
    assert plan_scalars(plan_figures("full", [F] * 4, None)) == {
        "ckpt/blocks_none": 0.0, "ckpt/blocks_selective": 0.0, "ckpt/blocks_full": 4.0}


def test_the_summary_entry_is_there_only_where_the_callback_planned():
    cb = SelectiveCheckpointing(policy="full")
    assert summary_entry([object(), cb]) == {}  # never set up: no plan
    cb.plan = [F, F]
    assert summary_entry([object(), cb]) == {"activation_checkpointing": {
        "policy": "full", "plan": [F, F], "blocks_none": 0, "blocks_selective": 0, "blocks_full": 2}}
