"""Tests that pin ``lit_dtrain.stop_reason`` where hand mutants passed its tests: every EarlyStopping reason is an
early stop (not only patience), a rank keeps its own reason where the ranks' differ, ``max_steps=0`` is a max_steps
stop, a warmup that ends at the last step, the schedule's end at step ``max_steps - 1``, and a fit from step 0 is no
resume for ``KeepEarlyStop``, a floor of 0 reached to rounding, and a decay branch's line on EarlyStopping."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from lit_dtrain.stop_reason import KeepEarlyStop, agree_on_early_stop, stop_reason, warn_if_the_schedule_did_not_end

STOPPED = [r for r in EarlyStoppingReason if r != EarlyStoppingReason.NOT_STOPPED]


def _trainer(**kw) -> SimpleNamespace:
    base = {"max_steps": 20, "global_step": 4, "early_stopping_callbacks": [], "callbacks": [], "max_epochs": -1,
            "current_epoch": 0, "should_stop": False}
    return SimpleNamespace(**{**base, **kw})


def _stopper(reason: EarlyStoppingReason | int) -> EarlyStopping:
    stopper = EarlyStopping(monitor="val/loss")
    stopper.stopping_reason = reason
    return stopper


@pytest.mark.parametrize("reason", STOPPED + [r.value for r in STOPPED], ids=str)
def test_every_reason_early_stopping_gives_is_an_early_stop(reason) -> None:
    """``stopping_threshold`` (1), ``divergence_threshold`` (2), patience (3), a non-finite metric (4), as the enum
    or as the int a checkpoint's state holds: the run was early-stopped, and its resume trains no step."""
    trainer = _trainer(early_stopping_callbacks=[_stopper(reason)])
    assert stop_reason(trainer) == "early_stopping"
    KeepEarlyStop().on_train_start(trainer, None)
    assert trainer.should_stop is True


def test_a_fit_from_step_0_is_no_resume_for_keep_early_stop() -> None:
    """KeepEarlyStop stops a resume of an early-stopped checkpoint; a fit at step 0 restored none."""
    trainer = _trainer(global_step=0, early_stopping_callbacks=[_stopper(EarlyStoppingReason.PATIENCE_EXHAUSTED)])
    KeepEarlyStop().on_train_start(trainer, None)
    assert trainer.should_stop is False


@pytest.mark.parametrize(("mine", "theirs", "kept"), [
    (EarlyStoppingReason.PATIENCE_EXHAUSTED, EarlyStoppingReason.NON_FINITE_METRIC,
     EarlyStoppingReason.PATIENCE_EXHAUSTED),  # this rank decided: its own reason stays
    (EarlyStoppingReason.NOT_STOPPED, EarlyStoppingReason.STOPPING_THRESHOLD, EarlyStoppingReason.STOPPING_THRESHOLD),
])
def test_a_rank_that_decided_keeps_its_reason_and_one_that_did_not_takes_the_other_s(mine, theirs, kept) -> None:
    stopper = _stopper(mine)
    strategy = SimpleNamespace(root_device=torch.device("cpu"),
                               all_gather=lambda t: torch.stack([t, torch.full_like(t, theirs.value)]))
    trainer = _trainer(early_stopping_callbacks=[stopper], world_size=2, strategy=strategy)
    agree_on_early_stop(trainer)
    assert stopper.stopping_reason == kept and stop_reason(trainer) == "early_stopping"


def test_max_steps_0_is_a_max_steps_stop() -> None:
    """``trainer.max_steps=0`` trains no step: the fit ended at its max_steps (0 is a limit; -1 is none)."""
    assert stop_reason(_trainer(max_steps=0, global_step=0)) == "max_steps"
    assert stop_reason(_trainer(max_steps=-1, global_step=0)) == "should_stop"


def _warning(caplog, factor, step: int, max_steps: int) -> str:
    configs = [SimpleNamespace(scheduler=SimpleNamespace(lr_lambdas=[factor]))]
    trainer = _trainer(global_step=step, max_steps=max_steps, lr_scheduler_configs=configs)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        warn_if_the_schedule_did_not_end(trainer, "early_stopping", 0, "run/last.ckpt")
    assert len(caplog.messages) == 1, caplog.messages
    return caplog.messages[0]


def test_a_stop_inside_a_warmup_that_ends_at_the_last_step(caplog) -> None:
    """The LR rises over steps 0..8 of 10 and falls at step 9: a stop at step 5 is inside a warmup of 9 steps."""
    def factor(s: int) -> float:
        return (s + 1) / 9 if s < 9 else 0.1

    message = _warning(caplog, factor, 5, 10)
    assert "after 5 of trainer.max_steps=10 optimizer steps, inside its warmup of 9 steps (its last at 0.5556 of "\
        "the peak LR)" in message and "train on to step 9 or later first" in message


def test_the_schedule_s_end_is_its_lr_at_step_max_steps_minus_1(caplog) -> None:
    """A linear decay 1 - s/20 over 20 steps ends at 0.05, at step 19 (its last step; 0 would be step 20's)."""
    message = _warning(caplog, lambda s: 1 - s / 20, 5, 20)
    assert "its last at 0.8 of the peak LR, before its schedule's end (0.05 at step 19)" in message


def test_a_stop_at_a_floor_of_0_to_rounding_is_not_warned_about(caplog) -> None:
    """A decay to 0 that a stop at step 40 of 100 reached, but for a rounding of 1e-12: annealed as far as its schedule
    goes (the tolerance is absolute near 0, 1e-9); 1e-6 above 0 is not."""
    configs = [SimpleNamespace(scheduler=SimpleNamespace(lr_lambdas=[
        lambda s, above=above: max(0.0, 1.0 - 0.1 * s) + (above if s < 50 else 0.0)])) for above in (1e-12, 1e-6)]
    for config, warned in zip(configs, (False, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
            warn_if_the_schedule_did_not_end(_trainer(global_step=40, max_steps=100, lr_scheduler_configs=[config]),
                                             "early_stopping", 0, "run/last.ckpt")
        assert bool(caplog.messages) is warned, caplog.messages


def test_a_decay_branch_says_it_left_early_stopping_out_only_where_there_was_one(caplog) -> None:
    from lightning.pytorch.callbacks import Timer

    from lit_dtrain.stop_reason import early_stop_kept

    timer, stopper = Timer(duration="00:00:01:00"), _stopper(EarlyStoppingReason.NOT_STOPPED)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        assert early_stop_kept([timer], branch=True) == [timer]
    assert caplog.messages == []
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        assert early_stop_kept([timer, stopper], branch=True) == [timer]
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("decay_branch: EarlyStopping left out")
    kept = early_stop_kept([timer, stopper], branch=False)
    assert kept[:2] == [timer, stopper] and len(kept) == 3 and isinstance(kept[2], KeepEarlyStop)
