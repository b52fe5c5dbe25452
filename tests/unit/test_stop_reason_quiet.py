"""A fit stopped before ``trainer.max_steps`` at the LR its schedule ends at (a ``constant`` schedule, or a decay
already at its floor, to rounding) is annealed as far as its schedule goes: no 'not annealed' warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from lit_dtrain.stop_reason import warn_if_the_schedule_did_not_end


@pytest.mark.parametrize(("factor", "warned"), [
    (lambda step: 1.0, False),  # constant
    (lambda step: max(0.1, 1.0 - 0.1 * step) + (1e-12 if step < 50 else 0.0), False),  # at its floor, to rounding
    (lambda step: max(0.1, 1.0 - 0.01 * step), True),  # still decaying at step 4
])
def test_a_stop_at_the_schedules_last_lr_is_not_warned_about(factor, warned, caplog):
    trainer = SimpleNamespace(max_steps=100, global_step=40, callbacks=[],
                              lr_scheduler_configs=[SimpleNamespace(scheduler=SimpleNamespace(lr_lambdas=[factor]))])
    if warned:
        trainer.global_step = 4
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        warn_if_the_schedule_did_not_end(trainer, "early_stopping", 0, "run/last.ckpt")
    assert bool([m for m in caplog.messages if "not annealed" in m]) is warned, caplog.messages
