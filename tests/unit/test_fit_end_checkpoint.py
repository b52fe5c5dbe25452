"""The warning for a checkpoint written at a stop between local-update syncs (``warn_checkpoint_before_final_sync``).

The 2-rank fit: ``tests/dist/test_compressed_ddp_fits.py``,
``test_a_checkpoint_written_at_a_stop_between_syncs_is_rank_zeros_and_said_so``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_dtrain.strategies import LocalSGD
from lit_dtrain.strategies.fit_end import note_checkpoint, warn_checkpoint_before_final_sync


def _strategy(steps_since_sync: int, global_step: int) -> SimpleNamespace:
    lu = LocalSGD(sync_period=4)
    lu.steps_since_sync = steps_since_sync
    trainer = SimpleNamespace(global_step=global_step)
    return SimpleNamespace(local_update=lu, lightning_module=SimpleNamespace(trainer=trainer, _trainer=trainer))


def test_only_a_checkpoint_of_this_step_written_between_syncs_is_warned_about():
    strategy = _strategy(2, 6)
    assert warn_checkpoint_before_final_sync(strategy) is None  # no checkpoint written
    note_checkpoint(strategy, {"global_step": 6})
    with pytest.warns(UserWarning, match=r"stopped at step 6, 2 steps after the last local_sgd sync"):
        assert warn_checkpoint_before_final_sync(strategy) is not None
    strategy.lightning_module.trainer.global_step = 7  # a checkpoint of an earlier step: not the stop's
    assert warn_checkpoint_before_final_sync(strategy) is None
    synced = _strategy(0, 8)  # written right after a sync (the last step's, a validation's): the synchronized model
    note_checkpoint(synced, {"global_step": 8})
    synced.local_update.steps_since_sync = 0
    assert warn_checkpoint_before_final_sync(synced) is None
    compressed = SimpleNamespace(local_update=None, lightning_module=None)  # a per-step codec: nothing to sync
    note_checkpoint(compressed, {"global_step": 3})
    assert warn_checkpoint_before_final_sync(compressed) is None


@pytest.mark.parametrize(("adaptive", "interval", "sync_first", "warns"), [
    (True, 3, True, True),      # every sync early: the period never adapts
    (True, 4, True, False),     # the period can end before a validation
    (True, 0.5, True, False),   # a fraction of the epoch: not a step count to compare
    (True, 0, True, False),     # no step count (0 was read as validations before every period end)
    (True, 3, False, False),    # validations between syncs do not sync: the period adapts
    (False, 3, True, False),    # a fixed period has nothing to adapt
])
def test_adaptive_local_sgd_says_when_validations_keep_its_period_from_adapting(adaptive, interval, sync_first, warns):
    """Adaptive local SGD with validations more often than its period (sync_before_validation): every sync was early,
    an early sync does not adapt, and the period stayed at sync_period without a word (a 2-rank run, period 4,
    validation every 3 steps: 6 syncs in 18 steps, the period 4 throughout)."""
    import warnings

    from lit_dtrain.strategies.fit_end import warn_if_the_period_cannot_adapt

    strategy = SimpleNamespace(local_update=LocalSGD(sync_period=4, adaptive=adaptive, min_period=2),
                               sync_before_validation=sync_first)
    trainer = SimpleNamespace(val_check_interval=interval, state=SimpleNamespace(fn="fit"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_if_the_period_cannot_adapt(strategy, trainer)
    messages = [str(w.message) for w in seen]
    assert bool(messages) is warns, messages
    if warns:
        assert "a validation every 3 steps comes before its period of 4" in messages[0]
