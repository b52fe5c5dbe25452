"""A decay branch logs its last step's train loss and LR (``schedules.workflows.log_the_branchs_last_step``)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lit_dtrain.schedules.workflows import log_the_branchs_last_step


def logged(start: int, steps: int, every: int) -> list[int]:
    """The 0-based steps of a branch that Lightning logs: ``(s + 1) % log_every_n_steps == 0``."""
    return [s for s in range(start, start + steps) if (s + 1) % every == 0]


@pytest.mark.parametrize("start, steps, every, expected", [
    (4, 3, 10, 1),  # decay_branch.steps=3 from step 4: no train/loss or LR was logged at all
    (1000, 5, 10, 5),  # only its last step, 1004
    (95, 3, 10, 2),  # 95 and 97
    (4, 6, 10, 10),  # step 9 is logged already: unchanged
    (0, 30, 10, 10),
    (4, 3, None, None),  # not a number: Lightning's own error
])
def test_a_branch_shorter_than_the_logging_interval_logs_its_last_step(start, steps, every, expected):
    cfg = OmegaConf.create({"trainer": {"log_every_n_steps": every}})
    log_the_branchs_last_step(cfg, start, steps)
    assert cfg.trainer.log_every_n_steps == expected
    if expected and expected != every:  # the branch's last step is logged now
        assert logged(start, steps, every) == [] and logged(start, steps, expected)[-1] == start + steps - 1
