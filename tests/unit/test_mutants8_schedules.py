"""Exact results of the LR schedules (``schedules/lr.py``) where single-point mutants passed test_schedules.py,
test_resume_peak_lr.py, test_tensor_lr.py and test_wsd_callback.py (eighth hand mutation audit): the closed end of
``decay_fraction``'s range, and the rounded-to-no-decay warning that train.py's own warning has already given."""

from __future__ import annotations

import logging
import math

import pytest

from lit_dtrain.schedules import resolve_decay_steps, wsd_lr_factor
from lit_dtrain.schedules.lr import check_wsd_args, rounded_decay_told


def test_a_decay_fraction_of_one_decays_over_the_whole_run():
    """``decay_fraction`` lies in [0, 1]: 1.0 (decay from the first step, no stable phase) is a schedule, not an
    error."""
    assert resolve_decay_steps(8, decay_fraction=1.0) == 8
    factors = [wsd_lr_factor(s, total_steps=4, decay_fraction=1.0, decay_type="linear") for s in range(4)]
    assert factors == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert wsd_lr_factor(0, total_steps=4, decay_fraction=1.0) == pytest.approx(1 - math.sqrt(0.25))


@pytest.fixture
def told_reset():
    rounded_decay_told(None)
    yield
    rounded_decay_told(None)


def _rounding_warnings(caplog, **kwargs) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.schedules.lr"):
        check_wsd_args(**kwargs)
    return [r.getMessage() for r in caplog.records if "rounds to 0 decay steps" in r.getMessage()]


def test_the_rounded_decay_warning_is_not_given_twice_once_train_py_told_it(caplog, told_reset):
    """train.py warns that ``decay_fraction`` of ``total_steps`` rounds to no decay in its own words and says so with
    :func:`rounded_decay_told`; the schedule then stays quiet for those values only, and speaks again once cleared."""
    args = {"total_steps": 10, "decay_fraction": 0.04}  # round(0.4) = 0
    [said] = _rounding_warnings(caplog, **args)
    assert "decay_fraction=0.04 of total_steps=10 rounds to 0 decay steps" in said
    rounded_decay_told(10, 0.04)
    assert _rounding_warnings(caplog, **args) == []
    assert len(_rounding_warnings(caplog, total_steps=12, decay_fraction=0.04)) == 1  # other values: not told
    rounded_decay_told(None)
    assert len(_rounding_warnings(caplog, **args)) == 1


def test_a_resume_with_another_peak_leaves_no_old_peak_in_the_param_groups():
    """``StepLambdaLR.load_state_dict`` keeps the configured peak (0.05) over the checkpoint's (0.1), in
    ``base_lrs`` and in each group's ``initial_lr``, which the optimizer's state restored with the old peak: a torch
    scheduler built on the resumed optimizer (``last_epoch`` >= 0 reads ``initial_lr``) started from 0.1."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from lit_dtrain.schedules import wsd_scheduler

    def build(lr):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=lr)
        return opt, wsd_scheduler(opt, total_steps=10, warmup_steps=0, decay_steps=4)

    opt, sched = build(0.1)
    for _ in range(3):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt, sched = build(0.05)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)
    assert sched.base_lrs == [0.05] and opt.param_groups[0]["lr"] == 0.05
    assert opt.param_groups[0]["initial_lr"] == 0.05
    assert LambdaLR(opt, lambda step: 1.0, last_epoch=3).base_lrs == [0.05]
