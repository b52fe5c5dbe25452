"""Exact results of schedules/_resume_lr.py where single-point mutants passed test_resume_lr_warning.py,
test_mutants9_resume_lr.py, test_decay_branch_lr.py, test_wsd_*.py and test_checkpoint_shapes.py (twelfth hand
mutation audit): ``below`` judges every param group and allows float rounding; an ``optimizer.lr`` that is no number
(a bool, a string) is not a configured peak; a ``WSDScheduler`` node whose arguments do not validate gives no
factor rather than an error."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from lit_dtrain.schedules._resume_lr import BRANCH_JUMP, _factor, below, warn_if_the_lr_moves
from tests.unit.test_mutants9_resume_lr import saved


def test_below_is_any_group_below_beyond_float_rounding():
    """One of two groups below is enough; an LR one rounding step (1e-9 relative) under the target is not below."""
    assert below(([0.1, 0.05], [0.1, 0.1]), 1.0) and below(([0.05, 0.1], [0.1, 0.1]), 1.0)
    assert not below(([0.1 * 0.3 * (1 - 1e-9)], [0.1]), 0.3)
    assert below(([0.1 * 0.3 * (1 - 1e-5)], [0.1]), 0.3)


@pytest.mark.parametrize("peak_lr", [True, "0.5"])
def test_an_optimizer_lr_that_is_no_number_is_not_taken_as_the_peak(tmp_path, caplog, peak_lr):
    """A checkpoint at its peaks (LRs 0.01, 0.02) branched at a stable step: quiet, as for ``peak_lr=None``. Read as a
    number (True -> 1.0, "0.5" -> 0.5) it was told the LR 'jumps up' to optimizer.lr."""
    path = saved(tmp_path, [{"base_lrs": [0.01, 0.02]}])
    node = OmegaConf.create({"_target_": "lit_dtrain.callbacks.WSDScheduler", "total_steps": 100, "decay_steps": 20})
    with caplog.at_level(logging.INFO, logger="lit_dtrain.schedules.workflows"):
        warn_if_the_lr_moves(path, 50, "scheduler", node, **BRANCH_JUMP, peak_lr=peak_lr)
        assert caplog.records == []
        warn_if_the_lr_moves(path, 50, "scheduler", node, **BRANCH_JUMP, peak_lr=1.0)  # a number: judged by it
    assert len(caplog.records) == 1 and "below optimizer.lr=1" in caplog.records[0].getMessage()


@pytest.mark.parametrize("args", [dict(total_steps=10, warmup_steps=20, decay_steps=2),
                                  dict(total_steps=10, decay_steps=2, decay_fraction=0.2)])
def test_a_wsd_callback_node_whose_arguments_do_not_validate_gives_no_factor(args):
    """(ValueError in wsd_lr_factor: a warmup past total_steps, two decay lengths; the config check reports them.)"""
    assert _factor(OmegaConf.create({"_target_": "lit_dtrain.callbacks.WSDScheduler", **args}), 3) is None
    assert _factor(OmegaConf.create({"_target_": "lit_dtrain.callbacks.WSDScheduler", "total_steps": 10,
                                     "decay_steps": 2}), 9) == pytest.approx(0.0)
