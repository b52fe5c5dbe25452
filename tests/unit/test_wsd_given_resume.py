"""``WSDScheduler(total_steps=N)`` in a user's own Lightning project, resumed with another schedule: a decayed
checkpoint extended (total_steps 8 -> 16) trained its next step at the peak LR after an info log line alone
('resuming with a changed schedule'), which such a project does not show, while train.py warns about the same resume.
It warns now, with both LRs; an extension in the stable phase (the same LR) stays quiet, and a warmup given past the
step of a stable checkpoint (a deliberate re-warm: the LR drops) is an info line."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from lit_dtrain.callbacks import WSDScheduler
from tests.unit._user_project_helpers import fit


@pytest.mark.parametrize(("step", "warmup", "said"), [(8, 2, "jumps up"), (4, 2, None), (4, 12, None)],
                         ids=["decayed_extended", "stable_extended", "rewarm"])
def test_a_given_schedule_that_moves_a_resume_s_lr_warns(tmp_path: Path, step, warmup, said):
    fit(tmp_path / "a", [WSDScheduler(total_steps=8, warmup_steps=2, decay_steps=2)], max_steps=8, save_every=4)
    (ckpt,) = (tmp_path / "a" / "ckpt").glob(f"*step={step}.ckpt")
    resumed = WSDScheduler(total_steps=16, warmup_steps=warmup, decay_steps=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fit(tmp_path / "b", [resumed], max_steps=step + 1, ckpt_path=str(ckpt))
    lines = [str(m.message) for m in w if str(m.message).startswith("WSDScheduler: its next step")]
    if said is None:
        assert lines == []
        return
    assert lines == [
        f"WSDScheduler: its next step {step} runs at 1 of the peak LR, not the 0 the checkpoint's run would have "
        f"used (the LR {said}): this schedule is not the checkpoint's run's (total_steps=8, warmup_steps=2, "
        "decay_steps=2, decay_type=1-sqrt, min_lr_factor=0.0); to go on with that one, pass its arguments"
    ]
