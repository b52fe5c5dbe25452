"""What a decay branch says about its first LR and about a checkpoint inside a warmup (schedules/workflows.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from lit_dtrain.errors import ConfigError
from lit_dtrain.schedules.workflows import apply_decay_branch

DEFAULT_WARMUP = "scheduler.warmup_steps='${lit.warmup:${trainer.max_steps}}'"  # the configs' (tiny_cfg sets 1)


def _checkpoint(root, step: int, lr: float, peak: float = 0.003, warmup: int | None = None):
    """A source run's checkpoint at ``step`` whose optimizer holds ``lr`` (its WSD peak ``peak``), and the run's
    ``config_resolved.yaml`` with ``scheduler.warmup_steps=warmup`` (none: no such file)."""
    (root / "checkpoints").mkdir(parents=True)
    path = root / "checkpoints" / f"step{step:06d}.ckpt"
    torch.save({"global_step": step, "optimizer_states": [{"param_groups": [{"lr": lr}, {"lr": lr}]}],
                "lr_schedulers": [{"base_lrs": [peak, peak]}], "state_dict": {}}, path)
    if warmup is not None:
        (root / "config_resolved.yaml").write_text(f"scheduler:\n  warmup_steps: {warmup}\n")
    return path


def _warnings(tiny_cfg, caplog, *overrides):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.schedules.workflows"):
        apply_decay_branch(tiny_cfg(*overrides, run="branch"))
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_branch_whose_optimizer_lr_is_lowered_to_the_checkpoint_s_is_not_told_the_lr_jumps(tiny_cfg, tmp_path,
                                                                                               caplog):
    """A branch from step 4 of a run in its warmup (LR 0.001875 of peak 0.003) over 20 steps starts at 0.776 of the
    peak: 0.00233, a jump up, warned. With optimizer.lr=0.001875 it starts at 0.00146 (the configured LR is the peak
    the branch uses), but it was still warned 'below the branch's first LR [0.00233, 0.00233] ... the LR jumps up'."""
    src = _checkpoint(tmp_path / "src", 4, lr=0.001875)
    common = (f"decay_branch.ckpt={src}", "decay_branch.steps=20", "scheduler.warmup_steps=2")
    [said] = _warnings(tiny_cfg, caplog, *common, "optimizer.lr=0.003")
    assert "is below its peak LR (in its warmup or decay): its LR for step 4 is [0.00187, 0.00187] (peak [0.003, " \
           "0.003]), below the branch's first LR [0.00233, 0.00233]" in said
    assert _warnings(tiny_cfg, caplog, *common, "optimizer.lr=0.001875") == []
    [said] = _warnings(tiny_cfg, caplog, *common, "optimizer.lr=0.004")  # raised: its first LR is 0.00311
    assert "below the branch's first LR [0.00311, 0.00311]" in said
    src = _checkpoint(tmp_path / "stable", 30, lr=0.003)  # at its peak: a raised optimizer.lr jumps up from it
    [said] = _warnings(tiny_cfg, caplog, f"decay_branch.ckpt={src}", "decay_branch.steps=20", "optimizer.lr=0.006")
    assert "is at its peak LR, below optimizer.lr=0.006: its LR for step 30 is [0.003, 0.003]" in said


@pytest.mark.parametrize("warmup, fix", [
    (8, "; the checkpoint is inside the source run's own warmup too (scheduler.warmup_steps=8 in its "
        "config_resolved.yaml): train the source run past step 8 first"),
    (2, ", or set scheduler.warmup_steps=2 (the source run's)"),
    (None, ", or set scheduler.warmup_steps to the source run's warmup if the checkpoint is past it (at most 4)"),
])
def test_a_branch_inside_its_default_warmup_is_told_a_fix_that_is_accepted(tiny_cfg, tmp_path, warmup, fix):
    """From step 4 over 50 steps the default warmup is 5: refused. The error said 'or set scheduler.warmup_steps to
    the source run's warmup', which, for a checkpoint inside the source run's warmup (8), is refused as well."""
    src = _checkpoint(tmp_path / "src", 4, lr=0.0015, warmup=warmup)
    with pytest.raises(ConfigError) as e:
        apply_decay_branch(tiny_cfg(f"decay_branch.ckpt={src}", "decay_branch.steps=50", DEFAULT_WARMUP, run="branch"))
    assert str(e.value).startswith("decay_branch.ckpt is at step 4, inside the warmup (scheduler.warmup_steps=5, the "
                                   "default min(100, max(1, max_steps // 10)) of the branch's max_steps=54); branch "
                                   "from a stable-phase checkpoint")
    assert str(e.value).endswith(fix)


def test_a_branch_inside_a_given_warmup_longer_than_the_source_run_s_is_told_the_source_run_s(tiny_cfg, tmp_path):
    """``experiment=cpt_replay``'s warmup is 50: a branch of a CPT run trained with ``scheduler.warmup_steps=2`` from
    its stable step 8 (the docs' command, scaled down) was told ``branch from a stable-phase checkpoint`` and no more,
    of a checkpoint that is one. The fix of a default warmup is told for a given one too."""
    src = _checkpoint(tmp_path / "src", 8, lr=0.003, warmup=2)
    with pytest.raises(ConfigError) as e:
        apply_decay_branch(tiny_cfg(f"decay_branch.ckpt={src}", "decay_branch.steps=2", "scheduler.warmup_steps=50",
                                    run="branch"))
    assert str(e.value) == ("decay_branch.ckpt is at step 8, inside the warmup (scheduler.warmup_steps=50); branch "
                            "from a stable-phase checkpoint, or set scheduler.warmup_steps=2 (the source run's)")


def test_a_branch_from_the_first_stable_step_is_accepted(tiny_cfg, tmp_path):
    """Step ``warmup_steps`` is the stable phase's first (factor 1.0): a checkpoint there is a stable-phase one."""
    src = _checkpoint(tmp_path / "src", 2, lr=0.003)
    cfg = tiny_cfg(f"decay_branch.ckpt={src}", "decay_branch.steps=4", "scheduler.warmup_steps=2", run="branch")
    assert apply_decay_branch(cfg) == 2
    assert (cfg.trainer.max_steps, cfg.scheduler.total_steps, cfg.scheduler.decay_steps) == (6, 6, 4)


@pytest.mark.parametrize("given", ["4.0", "4e0"])
def test_a_branch_length_written_as_a_whole_float_is_that_integer(tiny_cfg, tmp_path, given):
    """``decay_branch.steps=5.0`` was refused ('must be a positive integer, got 5.0') where ``trainer.max_steps=20.0``,
    ``scheduler.warmup_steps=2.0`` and every schedule argument take a float that is exactly an integer as it."""
    src = _checkpoint(tmp_path / "src", 2, lr=0.003)
    cfg = tiny_cfg(f"decay_branch.ckpt={src}", f"decay_branch.steps={given}", "scheduler.warmup_steps=2", run="branch")
    assert apply_decay_branch(cfg) == 2
    values = (cfg.decay_branch.steps, cfg.trainer.max_steps, cfg.scheduler.total_steps, cfg.scheduler.decay_steps)
    assert values == (4, 6, 6, 4) and all(type(v) is int for v in values)


@pytest.mark.parametrize("given, shown", [("4.5", "4.5"), ("0.0", "0"), ("true", "True")])
def test_a_branch_length_that_is_no_positive_integer_is_refused(tiny_cfg, tmp_path, given, shown):
    src = _checkpoint(tmp_path / "src", 2, lr=0.003)
    with pytest.raises(ConfigError) as e:
        apply_decay_branch(tiny_cfg(f"decay_branch.ckpt={src}", f"decay_branch.steps={given}", run="branch"))
    assert str(e.value) == f"decay_branch.steps must be a positive integer, got {shown}"
