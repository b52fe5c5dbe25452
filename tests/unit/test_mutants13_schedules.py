"""``schedules/lr.py`` where single-point mutants passed test_schedules.py, test_mutants8_schedules.py,
test_tensor_lr.py, test_resume_peak_lr.py, test_wsd_callback.py, test_mutants5_wsd.py, the resume-LR mutant files
and test_mutants8_wsd_horizon.py (thirteenth hand mutation audit): the LR a resumed scheduler reports, a scheduler
node with a key no schedule takes, and nested quiet builds; with the adapters' defaults at every edge of their
schedules (warmup, decay start, last step, past the end; their mutants test_schedules.py kills too). Every expected
value is a hand computation."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from lit_dtrain.schedules.lr import (
    cosine_scheduler,
    no_schedule_warnings,
    schedule_factor,
    wsd_scheduler,
)


def _opt(lr: float = 2.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=lr)


def _lrs(sched, opt, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_the_wsd_scheduler_decays_by_1_minus_sqrt_unless_told():
    """``wsd_scheduler``'s default ``decay_type`` is ``wsd_lr_factor``'s, 1-sqrt: total 6, no warmup, 4 decay steps
    to 0 give 1, 1, then 1 - sqrt(p) at p = 1/4, 2/4, 3/4, 1, and 0 past the end."""
    opt = _opt(1.0)
    got = _lrs(wsd_scheduler(opt, total_steps=6, decay_steps=4), opt, 7)
    want = [1.0, 1.0, 0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0, 0.0]
    assert got == pytest.approx(want, abs=1e-15)


def test_the_cosine_scheduler_ends_at_a_tenth_unless_told():
    """``cosine_scheduler``'s default ``min_lr_factor`` is ``cosine_lr_factor``'s (and conf/scheduler/cosine.yaml's),
    0.1: warmup 2 of 6, then 0.1 + 0.9 * (1 + cos(pi k / 4)) / 2 for k = 1..4, 0.1 past the end."""
    opt = _opt(1.0)
    got = _lrs(cosine_scheduler(opt, total_steps=6, warmup_steps=2), opt, 7)
    want = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)] + [0.1]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[5] == got[6] == 0.1


def test_a_resumed_scheduler_reports_the_lr_it_set():
    """After ``load_state_dict`` with another configured peak (1.0 over the checkpoint's 2.0) at step 3 of a linear
    decay over steps 2-5 (factor 1 - 2/4), ``get_last_lr()`` is the LR each group now has, 0.5, not the checkpoint's
    last LR (2.0 * 0.5 = 1.0), which ``LambdaLR.load_state_dict`` restores."""
    def build(lr):
        opt = _opt(lr)
        return opt, wsd_scheduler(opt, total_steps=6, decay_steps=4, decay_type="linear")

    opt, sched = build(2.0)
    assert _lrs(sched, opt, 3) == [2.0, 2.0, 1.5]
    saved_opt, saved = opt.state_dict(), sched.state_dict()
    opt, sched = build(1.0)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.5
    assert sched.get_last_lr() == [0.5]


def test_a_scheduler_node_with_a_key_no_schedule_takes_gives_no_factor():
    """``schedule_factor`` answers None for arguments that do not validate, a key the factor function does not take
    (``TypeError``) as much as a value out of range (``ValueError``); the TypeError escaped where only ValueError was
    caught."""
    node = {"_target_": "lit_dtrain.schedules.wsd_scheduler", "_partial_": True, "total_steps": 10, "decay_steps": 2}
    assert schedule_factor(node, 9) == 0.0
    assert schedule_factor({**node, "decay_step": 2}, 9) is None
    assert schedule_factor({**node, "decay_steps": 11}, 9) is None


def test_a_quiet_build_inside_another_stays_quiet_to_the_outer_end(caplog):
    """``no_schedule_warnings`` puts back the logger's state as it found it: an inner quiet build leaves the outer
    one quiet (enabling the logger at the inner end let the outer build's warning through)."""
    log = logging.getLogger("lit_dtrain.schedules.lr")
    with caplog.at_level(logging.WARNING, logger=log.name):
        with no_schedule_warnings():
            with no_schedule_warnings():
                pass
            assert log.disabled
            cosine_scheduler(_opt(), total_steps=4, warmup_steps=4)  # all warmup: would warn
        assert not log.disabled
    assert not [r for r in caplog.records if "all warmup" in r.getMessage()]
