"""The state a local-update rule keeps from before a sync that a fit going on never makes
(``_comm_state.kept_for_a_resume``) stands only while the fit is at its step and no other sync ran: a checkpoint
written later takes the state of then. The 2-rank fits that reach these keeps are in
tests/dist/test_local_update_kept_state.py; here one process, a loopback communicator and a stand-in strategy."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lit_dtrain.strategies._comm_state import _kept_state, kept_for_a_resume
from lit_dtrain.strategies.comm import CommSession, LoopbackCommunicator
from lit_dtrain.strategies.local_updates import LocalSGD


def _strategy_between_syncs(step: int = 6) -> SimpleNamespace:
    """A stand-in strategy at ``step``, 2 steps after a local SGD sync (period 4)."""
    module = nn.Linear(3, 2)
    module._trainer = SimpleNamespace(global_step=step)
    rule = LocalSGD(sync_period=4)
    rule.step, rule.steps_since_sync, rule.num_syncs = step, 2, 1
    return SimpleNamespace(local_update=rule, lightning_module=module, _state_before_early_sync=None)


def _sync(strategy, moved: bool = True) -> None:
    """A sync (on one rank it averages nothing; the parameters are moved as a sync on several would)."""
    strategy.local_update.sync_now(CommSession.named_params(strategy.lightning_module), LoopbackCommunicator())
    if moved:
        with torch.no_grad():
            strategy.lightning_module.weight.add_(1.0)


def test_the_kept_state_is_the_one_from_before_the_sync():
    strategy = _strategy_between_syncs()
    before = strategy.lightning_module.weight.detach().clone()
    with kept_for_a_resume(strategy, 6):
        _sync(strategy)
    kept = _kept_state(strategy)
    assert torch.equal(kept["params"]["weight"], before)
    assert (kept["local_update"]["steps_since_sync"], kept["local_update"]["num_syncs"]) == (2, 1)


def test_the_kept_state_goes_stale_at_a_later_step_or_after_another_sync():
    """A checkpoint written at a later step, or at the same step after a sync made outside a keep (one the fit going
    on makes too), must hold the state of then, not the kept one (a resume would go back before that sync)."""
    strategy = _strategy_between_syncs()
    with kept_for_a_resume(strategy, 6):
        _sync(strategy)
    strategy.lightning_module._trainer.global_step = 7
    assert _kept_state(strategy) is None
    strategy.lightning_module._trainer.global_step = 6
    assert _kept_state(strategy) is not None
    strategy.local_update.steps_since_sync = 1
    _sync(strategy)
    assert _kept_state(strategy) is None


def test_a_keep_around_no_sync_holds_nothing_and_frees_an_earlier_copy():
    """A keep whose sync does not run (nothing stepped since the last one) keeps nothing: the copy it took is
    dropped, and so is an earlier keep's (no longer the state before the latest sync)."""
    strategy = _strategy_between_syncs()
    with kept_for_a_resume(strategy, 6):
        _sync(strategy)
    assert strategy._state_before_early_sync is not None  # the earlier copy
    with kept_for_a_resume(strategy, 6):
        _sync(strategy, moved=False)  # steps_since_sync is 0: sync_now does nothing
    assert strategy._state_before_early_sync is None
