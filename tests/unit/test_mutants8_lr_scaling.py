"""Exact results of the per-step LR scaling (``callbacks/_lr_scaling.py``) where single-point mutants passed
test_tensor_lr.py, test_loss_spike_actions.py and test_callback_logging.py (eighth hand mutation audit)."""

from __future__ import annotations

import torch

from lit_dtrain.callbacks._lr_scaling import pop_applied_lrs, scale_lrs_for_step, track_applied_lrs


def test_an_update_with_a_parameter_left_without_gradient_records_its_lr():
    """A step where one parameter got no gradient (unused this step, frozen in the optimizer) still updates the
    others: its LR (the scaled one) is recorded for ``<lr tag>-effective``, and the schedule's comes back. Only a
    step with no gradient at all applied no LR (before, any parameter without one dropped the step's record)."""
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([used, unused], lr=0.1)
    track_applied_lrs(opt)
    used.grad = torch.ones(2)
    scale_lrs_for_step(opt, 0.5)
    opt.step()
    assert pop_applied_lrs(opt) == [0.05] and opt.param_groups[0]["lr"] == 0.1
    assert torch.allclose(used, torch.full((2,), 0.95)) and unused.tolist() == [1.0, 1.0]  # 1 - 0.05 * 1
    used.grad = None
    scale_lrs_for_step(opt, 0.5)
    opt.step()
    assert pop_applied_lrs(opt) is None and opt.param_groups[0]["lr"] == 0.1


def test_two_scalings_of_one_step_multiply_and_the_schedules_lr_comes_back():
    """Two callbacks scale one update (a spike cool-down of 0.5 and a stage multiplier of 0.1): the update runs at
    0.1 x 0.5 x 0.1 and the LR from before the first scaling comes back after it. Keeping the LR from before the
    second scaling put back 0.05, and each later step compounded it."""
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    track_applied_lrs(opt)
    for _ in range(2):
        p.grad = torch.ones(1)
        scale_lrs_for_step(opt, 0.5)
        scale_lrs_for_step(opt, 0.1)
        opt.step()
        [applied] = pop_applied_lrs(opt)
        assert abs(applied - 0.005) < 1e-12 and opt.param_groups[0]["lr"] == 0.1
