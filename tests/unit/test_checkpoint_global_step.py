"""``checkpoint_global_step`` of a file that is no Lightning training checkpoint, or whose ``global_step`` is not a
step count: one :class:`CheckpointError` naming what is missing or wrong (a ``'global_step': 'abc'`` given as
``ckpt_path`` or ``decay_branch.ckpt`` was ``ValueError: invalid literal for int()``, a traceback; 2.5 resumed at
step 2; a file holding a ``state_dict`` alone was said to be without ``'global_step' and 'state_dict'``)."""

from __future__ import annotations

import re

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError, checkpoint_global_step


@pytest.mark.parametrize("step", ["abc", 2.5, -1, True, None, [3]])
def test_a_global_step_that_is_no_step_count_is_named(tmp_path, step):
    torch.save({"global_step": step, "state_dict": {}}, tmp_path / "s.ckpt")
    said = re.escape(f"{step!r} ({type(step).__name__})")
    with pytest.raises(CheckpointError, match=rf"s\.ckpt' has global_step={said}, not a step count \(an integer"):
        checkpoint_global_step(tmp_path / "s.ckpt")


@pytest.mark.parametrize("step", [0, 7, torch.tensor(7)])
def test_integer_steps_are_read_as_ints(tmp_path, step):
    torch.save({"global_step": step, "state_dict": {}}, tmp_path / "s.ckpt")
    got = checkpoint_global_step(tmp_path / "s.ckpt", verify=False)
    assert got == int(step) and type(got) is int


@pytest.mark.parametrize("obj, lacks", [
    ({"state_dict": {}}, "without 'global_step';"),
    ({"global_step": 2}, "without 'state_dict';"),
    ({"a": 1}, "without 'global_step' and 'state_dict';"),
    ({"global_step": 2, "state_dict": [1]}, "without a dict at 'state_dict';"),
])
def test_the_missing_keys_alone_are_named(tmp_path, obj, lacks):
    torch.save(obj, tmp_path / "s.ckpt")
    with pytest.raises(CheckpointError, match=r"is not a Lightning training checkpoint: it holds a dict with keys "
                       rf"\[.*\], {lacks}"):
        checkpoint_global_step(tmp_path / "s.ckpt")
