"""Exact results of schedules/_resume_lr.py where single-point mutants passed
test_resume_lr_warning.py, test_decay_branch_lr.py, test_decay_branch_restart.py, test_wsd_callback.py and the other
resume tests (ninth hand mutation audit): which peaks a checkpoint of several schedulers or optimizers gives (the
first scheduler's, the first optimizer's, a ``LambdaLR``'s over the callback's), and none where the peaks and the
param groups differ in number (every checkpoint those tests write has one optimizer and one schedule); a decay
that lowers the factor while a raised ``optimizer.lr`` trains the step higher; a drop at the first step past a given
warmup, which is no re-warm."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.schedules._resume_lr import checkpoint_lr_and_peak
from tests.unit.test_resume_lr_warning import messages
from tests.unit.test_wsd_callback import Toy, fit

LRS = [0.01, 0.02]  # the optimizer state's LRs of two param groups


def saved(tmp_path, schedulers=(), callbacks=None, groups=LRS):
    ckpt = {"optimizer_states": [{"param_groups": [{"lr": lr} for lr in groups]}, {"param_groups": [{"lr": 9.0}]}],
            "lr_schedulers": list(schedulers), "callbacks": callbacks or {}}
    path = tmp_path / "x.ckpt"
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """test_resume_lr_warning's: a Toy (SGD, peaks 0.1 and 0.05) under WSD over 100 steps (warmup 10, decay 20)
    saved at step 3 (0.4 of the peaks) and step 30 (the peaks)."""
    root = tmp_path_factory.mktemp("resume_lr")
    for step in (3, 30):
        fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=step,
            root=root).save_checkpoint(root / f"{step}.ckpt")
    return {step: root / f"{step}.ckpt" for step in (3, 30)}


def test_the_peaks_are_the_first_schedulers_that_has_them(tmp_path):
    """Two LR schedulers (two optimizers, each its own): the first optimizer's LRs go with the first one's peaks."""
    path = saved(tmp_path, [{"last_epoch": 3}, {"base_lrs": [0.1, 0.2]}, {"base_lrs": [0.3, 0.4]}])
    assert checkpoint_lr_and_peak(path) == (LRS, [0.1, 0.2])


def test_a_schedulers_peaks_win_over_a_wsd_callbacks(tmp_path):
    wsd = {"WSDScheduler{'total_steps': 10}": {"base_lrs": [[0.5, 0.6]]}}
    assert checkpoint_lr_and_peak(saved(tmp_path, [{"base_lrs": [0.1, 0.2]}], wsd)) == (LRS, [0.1, 0.2])


def test_the_wsd_callbacks_peaks_are_its_first_optimizers(tmp_path):
    """``WSDScheduler.base_lrs`` is per optimizer, per param group: the first optimizer's (two groups), not the
    second's (one group, which does not fit the two LRs)."""
    wsd = {"Other": {"base_lrs": [[7.0, 7.0]]}, "WSDScheduler{'total_steps': 10}": {"base_lrs": [[0.5, 0.6], [0.7]]}}
    assert checkpoint_lr_and_peak(saved(tmp_path, callbacks=wsd)) == (LRS, [0.5, 0.6])


def test_peaks_of_another_number_of_param_groups_give_none(tmp_path):
    """A group added since the schedule read its peaks (a ``BaseFinetuning`` unfreeze): no group-by-group judgement
    (zip would have judged the first group alone)."""
    assert checkpoint_lr_and_peak(saved(tmp_path, [{"base_lrs": [0.1]}])) is None
    assert checkpoint_lr_and_peak(saved(tmp_path, [{"base_lrs": [0.1, 0.2, 0.3]}])) is None


def test_a_decay_under_a_raised_optimizer_lr_that_trains_the_step_higher_is_not_told_the_lr_drops(checkpoints, caplog):
    """Step 30 (the peaks 0.1, 0.05) resumed into a decay starting at step 28 (factor 0.345 at step 30) with
    optimizer.lr=0.5: the step trains at 0.173 in both groups, above the checkpoint's LRs, so nothing drops."""
    said = messages(caplog, checkpoints[30], 30, 35, lr=0.5, warmup_steps=2)
    assert [level for level, _ in said] == ["INFO"] and "with optimizer.lr=0.5 as the peak LR" in said[0][1]
    [(level, said)] = messages(caplog, checkpoints[30], 30, 35, warmup_steps=2)  # the checkpoint's peaks: it drops
    assert level == "WARNING" and "this run's is [0.0345, 0.0173]" in said and "the LR drops at the resume" in said


def test_a_drop_at_the_first_step_past_a_given_warmup_is_warned_not_logged_as_a_re_warm(checkpoints, caplog):
    """Step 3 (0.4 of the peaks) resumed with warmup_steps=3 as given and a 2-step decay starting at step 3 (factor
    0.293): the step lies past the warmup, so the drop is the decay's, warned; only a step inside a given warmup
    (step < warmup_steps) is the documented re-warm, logged at info level."""
    [(level, said)] = messages(caplog, checkpoints[3], 3, 5, warmup_steps=3, decay_fraction=0.4)
    assert level == "WARNING" and "this run's is [0.0293, 0.0146]" in said
    assert "its decay starts at step 3, so the LR drops at the resume" in said
    [(level, said)] = messages(caplog, checkpoints[3], 3, 20, warmup_steps=11)  # factor 4/11, in the warmup
    assert level == "INFO" and "step 3 lies in scheduler.warmup_steps=11 as given" in said


def test_a_decayed_checkpoint_resumed_at_the_end_of_a_given_warmup_is_told_it_is_below_its_peak(tmp_path, caplog):
    """A checkpoint at 0.1 of its peaks (decayed) resumed at step 30 with warmup_steps=30 as given: the step has the
    full factor, so the LR jumps up because the checkpoint was decaying, not because this warmup is shorter than its
    run's (the cause for a step inside the warmup)."""
    from omegaconf import OmegaConf

    from lit_dtrain.schedules._resume_lr import warn_if_a_resume_moves_the_lr

    node = OmegaConf.create({"_target_": "lit_dtrain.schedules.wsd_scheduler", "total_steps": 100,
                             "warmup_steps": 30, "decay_fraction": 0.2})
    path = saved(tmp_path, [{"base_lrs": [0.1, 0.2]}])
    with caplog.at_level("INFO", logger="lit_dtrain.schedules.workflows"):
        warn_if_a_resume_moves_the_lr(path, 30, "scheduler", node, default_warmup=False)
    [said] = [r.getMessage() for r in caplog.records]
    assert "its LR for step 30 is [0.01, 0.02] (peak [0.1, 0.2]), this run's is [0.1, 0.2]" in said
    assert "the checkpoint is below its peak, in its run's warmup or decay, and the step lies past" in said


def test_the_source_runs_warmup_is_read_beside_its_checkpoints_dir_and_a_bool_is_none(tmp_path):
    """``<run>/checkpoints/x.ckpt`` has its run's config at ``<run>/config_resolved.yaml``; a warmup at the step is
    the fix to give (the checkpoint is past it), one past the step is not."""
    from lit_dtrain.schedules._resume_lr import branch_in_warmup_fix, source_warmup

    ckpt = tmp_path / "run" / "checkpoints" / "x.ckpt"
    ckpt.parent.mkdir(parents=True)
    config = tmp_path / "run" / "config_resolved.yaml"
    config.write_text("scheduler:\n  warmup_steps: 12\n")
    assert source_warmup(ckpt, "scheduler") == 12
    assert branch_in_warmup_fix(ckpt, "scheduler", 12) == ", or set scheduler.warmup_steps=12 (the source run's)"
    assert "train the source run past step 12 first" in branch_in_warmup_fix(ckpt, "scheduler", 11)
    config.write_text("scheduler:\n  warmup_steps: true\n")
    assert source_warmup(ckpt, "scheduler") is None


def test_a_decaying_checkpoint_resumed_inside_a_wsd_decay_of_another_shape_is_told_so_not_to_pass_a_warmup(tmp_path,
                                                                                                          caplog):
    """A checkpoint at 0.1 of its peaks (step 16 of a 1-sqrt decay) resumed at step 16 with decay_type=linear: the
    step lies in this run's decay, whose factor there (0.6) is higher. The cause is the decay's shape, not a warmup:
    it was told 'pass scheduler.warmup_steps=<the checkpoint's run's> to go on with its warmup' (train.py, a
    20-step run resumed from step000016 with scheduler.decay_type=linear scheduler.min_lr_factor=0.1)."""
    from omegaconf import OmegaConf

    from lit_dtrain.schedules._resume_lr import warn_if_a_resume_moves_the_lr

    node = OmegaConf.create({"_target_": "lit_dtrain.schedules.wsd_scheduler", "total_steps": 20, "warmup_steps": 4,
                             "decay_steps": 5, "decay_fraction": None, "decay_type": "linear",
                             "min_lr_factor": 0.0})
    path = saved(tmp_path, [{"base_lrs": [0.1, 0.2]}])
    with caplog.at_level("INFO", logger="lit_dtrain.schedules.workflows"):
        warn_if_a_resume_moves_the_lr(path, 16, "scheduler", node, default_warmup=False)
    [said] = [r.getMessage() for r in caplog.records]
    assert "its LR for step 16 is [0.01, 0.02] (peak [0.1, 0.2]), this run's is [0.06, 0.12]" in said
    assert ("the step lies in this run's decay (from step 15 to total_steps=20, decay_type=linear, min_lr_factor=0.0)"
            in said)
    assert ("so the LR jumps up; resume with the checkpoint's run's trainer.max_steps and scheduler decay settings"
            in said)
    assert "warmup_steps=<the checkpoint's run's>" not in said
