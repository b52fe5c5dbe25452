"""Exact results of ``lit_dtrain.strategies._comm_state`` in one process, where its unit tests left single-point
mutants alive (thirteenth hand mutation audit; its 2-rank fits are in tests/dist): a keep inside a step's count
takes that step in (step and steps since the sync, +1 each), ``gather_comm_state`` after a kept sync writes the state
from before it with the sync counts of now and the parameters from before it, and ``apply_comm_state`` on rank 1 of
2 takes rank 1's entry: its counters, its parameters, and the saved sync counts."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from lit_dtrain.strategies import CompressedDDPStrategy
from lit_dtrain.strategies import _comm_state as comm_state
from lit_dtrain.strategies._comm_state import _kept_state, apply_comm_state, gather_comm_state, kept_for_a_resume
from lit_dtrain.strategies.comm import CommSession, LoopbackCommunicator
from lit_dtrain.strategies.local_updates import LocalSGD


def _strategy_at(step: int = 6) -> CompressedDDPStrategy:
    """A local SGD (period 4) strategy at ``step``, 2 steps after its first sync, with a module and its optimizer."""
    strategy = CompressedDDPStrategy(local_update=LocalSGD(sync_period=4))
    module = nn.Linear(3, 2)
    module._trainer = SimpleNamespace(global_step=step)
    strategy._lightning_module, strategy.optimizers = module, [torch.optim.SGD(module.parameters(), lr=0.1)]
    rule = strategy.local_update
    rule.step, rule.steps_since_sync, rule.num_syncs = step, 2, 1
    return strategy


def _sync(strategy) -> None:
    """A sync (on one rank it averages nothing; the parameters are moved as a sync on several would)."""
    strategy.local_update.sync_now(CommSession.named_params(strategy.lightning_module), LoopbackCommunicator())
    with torch.no_grad():
        strategy.lightning_module.weight.add_(1.0)


def test_a_keep_inside_the_steps_count_takes_the_step_in():
    """``counting=True`` (the last step's sync, inside ``after_optimizer_step`` before the step is counted): the kept
    state is that of after step 7 without its sync, step 7 and 3 steps since the last sync."""
    strategy = _strategy_at(6)
    with kept_for_a_resume(strategy, 7, counting=True):
        _sync(strategy)
    strategy.lightning_module._trainer.global_step = 7
    kept = _kept_state(strategy)["local_update"]
    assert (kept["step"], kept["steps_since_sync"]) == (7, 3)
    with kept_for_a_resume(strategy, 7):  # without counting: as it was (no sync runs here: nothing kept)
        pass
    strategy2 = _strategy_at(6)
    with kept_for_a_resume(strategy2, 6):
        _sync(strategy2)
    kept = _kept_state(strategy2)["local_update"]
    assert (kept["step"], kept["steps_since_sync"]) == (6, 2)


def test_the_gathered_state_after_a_kept_sync_is_from_before_it_with_the_counts_of_now():
    strategy = _strategy_at(6)
    before = strategy.lightning_module.weight.detach().clone()
    with kept_for_a_resume(strategy, 6):
        _sync(strategy)
    state = gather_comm_state(strategy)
    replicated = state["local_update"]
    assert (replicated["step"], replicated["steps_since_sync"]) == (6, 2)  # the schedule from before the sync
    assert (replicated["num_syncs"], replicated["num_early_syncs"]) == (2, 1)  # the syncs made (its count: 1)
    (mine,) = state["per_rank"]
    assert torch.equal(mine["params"]["weight"], before)
    assert not torch.equal(strategy.lightning_module.weight, before)
    strategy.lightning_module._trainer.global_step = 7  # a later step: the state of then
    later = gather_comm_state(strategy)
    assert later["local_update"]["steps_since_sync"] == 0
    assert torch.equal(later["per_rank"][0]["params"]["weight"], strategy.lightning_module.weight)


def test_rank_1_of_2_takes_its_own_entry_and_the_saved_sync_counts(monkeypatch):
    saved = gather_comm_state(_strategy_at(6))
    ranks = [copy.deepcopy(saved["per_rank"][0]) for _ in range(2)]
    for r, entry in enumerate(ranks):
        entry["counters"]["step"] = 6
        entry["counters"]["total_time_ms"] = 10.0 * (r + 1)  # each rank's own comm time
        entry["params"] = {name: torch.full_like(p, float(r)) for name, p in entry["params"].items()}
    state = {**saved, "world_size": 2, "per_rank": ranks,
             "local_update": {**saved["local_update"], "num_syncs": 3, "num_early_syncs": 1}}
    monkeypatch.setattr(comm_state, "dist", SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                                            get_world_size=lambda: 2, get_rank=lambda: 1))
    strategy = _strategy_at(0)
    strategy.local_update.num_syncs = 0
    apply_comm_state(strategy, state)
    counters = strategy.session.counters_state_dict()
    assert (counters["step"], counters["total_time_ms"]) == (6, 20.0)
    assert torch.equal(strategy._rank_restore["params"]["weight"], torch.ones(2, 3))  # rank 1's
    rule = strategy.local_update
    assert (rule.step, rule.steps_since_sync, rule.num_syncs, rule.num_early_syncs) == (6, 2, 3, 1)
