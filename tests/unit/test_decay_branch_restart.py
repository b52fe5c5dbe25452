"""A decay branch restarted (``resume=auto``) from its own checkpoints with another ``decay_branch.steps``."""

from __future__ import annotations

import logging

import pytest
import torch

from lit_dtrain.schedules.workflows import apply_decay_branch, warn_if_the_resume_moves_the_lr


def _checkpoint(path, step: int, lr: float, peak: float = 0.003):
    """A checkpoint at ``step`` whose optimizer holds ``lr`` for its next step (WSD peak ``peak``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "optimizer_states": [{"param_groups": [{"lr": lr}, {"lr": lr}]}],
                "lr_schedulers": [{"base_lrs": [peak, peak]}], "state_dict": {}}, path)
    return path


@pytest.mark.parametrize("steps, said", [
    (16, "its LR for step 28 is [0, 0] (peak [0.003, 0.003]), this run's is [0.00075, 0.00075]"),
    (12, "its LR for step 28 is [0, 0] (peak [0.003, 0.003]), this run's is [0.000402, 0.000402]"),
    (8, None),
])
def test_a_branch_restarted_with_another_length_is_told_its_lr_jumps(tiny_cfg, tmp_path, caplog, steps, said):
    """An 8-step branch from step 20 finished at step 28 (LR 0); restarted with resume=auto and
    decay_branch.steps=16, its step 28 ran at 0.25 of the peak (0.00075), the LR jumping up from 0 without a word:
    a branch's restart skipped the resume's LR check, and the branch's own check reads only the source."""
    src = _checkpoint(tmp_path / "src" / "checkpoints" / "step000020.ckpt", 20, lr=0.003)
    own = _checkpoint(tmp_path / "branch" / "checkpoints" / "last.ckpt", 28, lr=0.0)
    (tmp_path / "branch" / "config_resolved.yaml").write_text("decay_branch:\n  steps: 8\n")
    cfg = tiny_cfg(f"decay_branch.ckpt={src}", f"decay_branch.steps={steps}", "resume=auto", run="branch")
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.schedules"):
        apply_decay_branch(cfg)
        warn_if_the_resume_moves_the_lr(cfg, src, 20)  # the branch's start: apply_decay_branch's own check
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        warn_if_the_resume_moves_the_lr(cfg, own, 28)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if said is None:
        assert messages == []
        return
    [message] = messages
    assert said in message
    assert message.endswith(f"restart this decay branch with decay_branch.steps=8, the one it started with (now "
                            f"decay_branch.steps={steps}), or branch a decay of another length into a new run_name")


def test_a_branch_restarted_shorter_than_it_trained_is_told_the_key_it_can_set(tiny_cfg, tmp_path):
    """The same branch restarted with decay_branch.steps=4 (its end, step 24, lies before its checkpoint's 28) was
    told 'set trainer.max_steps >= 28', which a decay branch refuses (it sets trainer.max_steps itself)."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.resume import check_start_step

    src = _checkpoint(tmp_path / "src" / "checkpoints" / "step000020.ckpt", 20, lr=0.003)
    own = _checkpoint(tmp_path / "branch" / "checkpoints" / "last.ckpt", 28, lr=0.0)
    cfg = tiny_cfg(f"decay_branch.ckpt={src}", "decay_branch.steps=4", "resume=auto", run="branch")
    apply_decay_branch(cfg)
    with pytest.raises(ConfigError) as e:
        check_start_step(cfg, 28, str(own))
    assert str(e.value) == (f"checkpoint {str(own)!r} is at step 28, past this decay branch's end, step 20 + "
                            "decay_branch.steps=4 = 24; restart it with decay_branch.steps >= 8 (= its steps trained "
                            "only validates it), or branch into a new run_name")
    cfg = tiny_cfg(f"decay_branch.ckpt={src}", "decay_branch.steps=8", "resume=auto", run="branch")
    apply_decay_branch(cfg)
    check_start_step(cfg, 28, str(own))  # the length it started with: a finished branch, validated
