"""The warning of a resume whose schedule moves the LR of the checkpoint's next step (schedules/_resume_lr.py).

It fires exactly when the resumed LR differs from the one the checkpoint holds for that step (the LR its run would
have trained it with), names the right cause, and stays quiet for the documented deliberate re-warm (a warmup the
user gave past the step) and for a decay that starts at the checkpoint's step. Before: a typed re-warm was told its
warmup was the default that grows with max_steps and to pass the warmup it had passed; a smaller max_steps whose
default warmup shrank below a checkpoint in its warmup was blamed on 'a larger trainer.max_steps'; a cosine or
constant schedule was never checked (a cosine resumed with a larger max_steps raised the LR without a word).
"""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from lit_dtrain.config_resolvers import register
from lit_dtrain.schedules.workflows import fit_default_warmup, warn_if_the_resume_moves_the_lr
from tests.unit.test_wsd_callback import Toy, fit

DEFAULT = "${lit.warmup:${trainer.max_steps}}"  # the configs' warmup: min(100, max(1, max_steps // 10))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Toy (SGD, peaks 0.1 and 0.05) run with WSD over 100 steps (warmup 10, decay 20) saved at step 3 (inside
    its warmup: 0.4 of the peak) and step 30 (stable: the peak)."""
    root = tmp_path_factory.mktemp("resume_lr")
    paths = {}
    for step in (3, 30):
        trainer = fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=step,
                      root=root)
        paths[step] = root / f"{step}.ckpt"
        trainer.save_checkpoint(paths[step])
    return paths


def messages(caplog, path, step: int, max_steps: int, target: str = "wsd", lr: float | None = None,
             **schedule) -> list[tuple[str, str]]:
    register()
    node = {"_target_": f"lit_dtrain.schedules.{target}_scheduler", "_partial_": True, **schedule}
    if target != "constant":
        node.setdefault("total_steps", "${trainer.max_steps}")
    if target == "wsd":
        node.setdefault("decay_fraction", 0.2)
    cfg = OmegaConf.create({"trainer": {"max_steps": max_steps}, "scheduler": node})
    if lr is not None:
        cfg.optimizer = {"lr": lr}
    caplog.clear()
    with caplog.at_level("INFO", logger="lit_dtrain.schedules.workflows"):
        fit_default_warmup(cfg, path, step)  # as train() does first (logged: a grown default fitted to the step)
        caplog.clear()
        warn_if_the_resume_moves_the_lr(cfg, path, step)
    return [(r.levelname, r.getMessage()) for r in caplog.records]


def test_the_same_schedule_and_an_unchanged_lr_are_quiet(checkpoints, caplog):
    assert messages(caplog, checkpoints[3], 3, 100, warmup_steps=DEFAULT) == []
    assert messages(caplog, checkpoints[30], 30, 100, warmup_steps=DEFAULT) == []
    assert messages(caplog, checkpoints[30], 30, 50, warmup_steps=DEFAULT) == []  # shrunk, still stable at 30
    assert messages(caplog, checkpoints[30], 30, 500, warmup_steps=DEFAULT) == []  # fitted to 30 in train()


def test_a_warmup_the_user_gave_past_the_step_is_a_re_warm_logged_not_warned(checkpoints, caplog):
    [(level, message)] = messages(caplog, checkpoints[30], 30, 500, warmup_steps=60)
    assert level == "INFO"
    assert "step 30 lies in scheduler.warmup_steps=60 as given, so the resumed steps warm up again" in message


def test_a_grown_default_warmup_warns_that_it_follows_max_steps(checkpoints, caplog):
    [(level, message)] = messages(caplog, checkpoints[3], 3, 500, warmup_steps=DEFAULT)
    assert level == "WARNING"
    assert "its LR for step 3 is [0.04, 0.02] (peak [0.1, 0.05]), this run's is [0.008, 0.004]: " \
           "scheduler.warmup_steps=50 (the default min(100, max(1, max_steps // 10)), which follows " \
           "trainer.max_steps) lies past the step, so the resumed steps warm up again from a lower LR" in message


def test_a_shrunk_default_warmup_is_not_blamed_on_a_larger_max_steps(checkpoints, caplog):
    [(level, message)] = messages(caplog, checkpoints[3], 3, 50, warmup_steps=DEFAULT)
    assert level == "WARNING"
    assert "this run's is [0.08, 0.04]: scheduler.warmup_steps=5 (the default" in message
    assert "is shorter than the checkpoint's run's warmup, so the LR jumps up" in message
    assert "larger trainer.max_steps" not in message
    # max_steps 5: the default warmup is 1 and step 3 lies in the stable phase, at the peak
    [(level, message)] = messages(caplog, checkpoints[3], 3, 5, warmup_steps=DEFAULT)
    assert level == "WARNING" and "this run's is [0.1, 0.05]: the checkpoint is below its peak" in message
    assert "the step lies past this run's scheduler.warmup_steps=1 (the default" in message
    assert "larger trainer.max_steps" not in message


def test_a_decay_moved_before_the_step_warns_and_one_starting_at_it_does_not(checkpoints, caplog):
    # max_steps 32: decay_fraction 0.2 -> 6 steps from step 26, so step 30 runs at 0.18 of the peak
    [(level, message)] = messages(caplog, checkpoints[30], 30, 32, warmup_steps=DEFAULT)
    assert level == "WARNING"
    # no config_resolved.yaml beside the checkpoint's dir to tell what changed: this run's settings
    assert "this run's scheduler (total_steps=32, decay_fraction=0.2; total_steps from trainer.max_steps) is not the " \
           "checkpoint's run's: its decay starts at step 26, so the LR drops at the resume" in message
    # a decay of 10 steps from step 30 (the way a decay branch decays): its first LR is the continuous path
    assert messages(caplog, checkpoints[30], 30, 40, warmup_steps=DEFAULT, decay_fraction=None, decay_steps=10) == []


def test_a_decay_moved_before_the_step_names_the_settings_that_moved_it(checkpoints, caplog, tmp_path):
    """A WSD run resumed at step 30 of 100 with another decay_fraction, trainer.max_steps unchanged, was warned
    'this run's scheduler (total_steps=100, from trainer.max_steps) is not the checkpoint's run's' (train.py: a
    10-step run stopped at 5, resumed with scheduler.decay_fraction=0.8: 'total_steps=10, from trainer.max_steps'),
    and so was one whose scheduler.total_steps was given. The settings that differ from the checkpoint's run's
    config_resolved.yaml are named now, each with its old value."""
    ckpt = tmp_path / "run" / "checkpoints" / "30.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(checkpoints[30].read_bytes())
    (tmp_path / "run" / "config_resolved.yaml").write_text(
        "trainer: {max_steps: 100}\nscheduler: {_target_: lit_dtrain.schedules.wsd_scheduler, total_steps: 100, "
        "warmup_steps: 10, decay_steps: 20, decay_fraction: null}\n")
    os.utime(tmp_path / "run" / "config_resolved.yaml", (ckpt.stat().st_mtime - 10,) * 2)  # written at its start
    drops = ": its decay starts at step {}, so the LR drops at the resume"
    [(level, said)] = messages(caplog, ckpt, 30, 100, warmup_steps=DEFAULT, decay_steps=None, decay_fraction=0.8)
    assert level == "WARNING" and "this run's scheduler.decay_steps=null where the checkpoint's run had 20 and " \
        "scheduler.decay_fraction=0.8 where the checkpoint's run had null" + drops.format(20) in said
    assert "trainer.max_steps" not in said and "total_steps" not in said
    [(_, said)] = messages(caplog, ckpt, 30, 100, warmup_steps=DEFAULT, total_steps=40, decay_steps=20,
                           decay_fraction=None)
    assert "this run's scheduler.total_steps=40 where the checkpoint's run had 100" + drops.format(20) in said
    [(_, said)] = messages(caplog, ckpt, 30, 40, warmup_steps=DEFAULT, decay_steps=20, decay_fraction=None)
    assert "this run's trainer.max_steps=40 (which scheduler.total_steps follows) where the checkpoint's run had " \
        "100" + drops.format(20) in said


def test_a_cosine_or_constant_schedule_that_moves_the_lr_warns_too(checkpoints, caplog):
    # the checkpoint (WSD at its peak) resumed as a cosine over 300 steps: 0.97 of the peak at step 30
    [(level, message)] = messages(caplog, checkpoints[30], 30, 300, "cosine", warmup_steps=10, min_lr_factor=0.1)
    assert level == "WARNING" and "its decay starts at step 10, so the LR drops at the resume" in message
    # inside its warmup, resumed on a constant LR without warmup: up to the peak
    [(level, message)] = messages(caplog, checkpoints[3], 3, 100, "constant", warmup_steps=0)
    assert level == "WARNING" and "this run's is [0.1, 0.05]" in message and "jumps up" in message


def test_a_grown_default_warmup_of_a_constant_schedule_is_fitted_to_a_checkpoint_at_its_peak(checkpoints, caplog):
    """``scheduler=constant`` resumed at step 30 (at its peak) with ``trainer.max_steps=500``: the default warmup grew
    to 50 and put step 30 back in a warmup, 31/50 of the peak, with a warning; WSD's was fitted to the step. It is
    fitted for a constant schedule too now (quiet: the LR stays at the peak); a warmup the user gave is not."""
    assert messages(caplog, checkpoints[30], 30, 500, "constant", warmup_steps=DEFAULT) == []
    register()
    cfg = OmegaConf.create({"trainer": {"max_steps": 500}, "scheduler": {
        "_target_": "lit_dtrain.schedules.constant_scheduler", "_partial_": True, "warmup_steps": DEFAULT}})
    fit_default_warmup(cfg, checkpoints[30], 30)
    assert cfg.scheduler.warmup_steps == 30
    cfg.scheduler.warmup_steps = 50  # given: a deliberate re-warm, kept
    fit_default_warmup(cfg, checkpoints[30], 30)
    assert cfg.scheduler.warmup_steps == 50


def test_only_rank_0_warns(checkpoints, caplog, monkeypatch):
    """Under torchrun every rank resumes the same checkpoint: each printed the same warning (2 lines on 2 ranks)."""
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert messages(caplog, checkpoints[3], 3, 500, warmup_steps=DEFAULT) == []
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    assert [level for level, _ in messages(caplog, checkpoints[3], 3, 500, warmup_steps=DEFAULT)] == ["WARNING"]


def test_the_lr_move_is_judged_against_the_configured_optimizer_lr(checkpoints, caplog):
    """Step 3 (0.4 of the peaks: LRs 0.04, 0.02) resumed with warmup_steps=2 gives the step the full factor. With
    optimizer.lr=0.02 the resume trains at 0.02 (no group's LR rises), yet it was warned 'this run's is [0.1, 0.05]
    ... the LR jumps up', the checkpoint's peaks times the factor; a raised optimizer.lr names its own LR."""
    [(level, said)] = messages(caplog, checkpoints[3], 3, 100, warmup_steps=2)
    assert level == "WARNING" and "this run's is [0.1, 0.05]" in said
    assert [m for m in messages(caplog, checkpoints[3], 3, 100, lr=0.02, warmup_steps=2) if m[0] == "WARNING"] == []
    [said] = [m for lvl, m in messages(caplog, checkpoints[3], 3, 100, lr=0.2, warmup_steps=2) if lvl == "WARNING"]
    assert "its LR for step 3 is [0.04, 0.02] (peak [0.1, 0.05]), this run's is [0.2, 0.2]" in said
    assert "the LR jumps up" in said


@pytest.mark.parametrize("settings, warmup", [
    ({}, 30),  # '~scheduler' alone: the callback's own default, fitted to the checkpoint's step
    ({"warmup_steps": DEFAULT}, 30),  # an experiment's scheduler node holding the default
    ({"warmup_steps": 50}, 50),  # given (the default of max_steps=500 too): a deliberate re-warm, kept
    ({"warmup_steps": 60}, 60),
])
def test_a_callback_warmup_read_from_the_scheduler_settings_is_judged_by_how_it_is_written(checkpoints, settings,
                                                                                          warmup):
    """Under the ``wsd`` callback the warmup is ``${oc.select:scheduler.warmup_steps,<default>}``: a warmup given in
    the ``scheduler:`` settings (``experiment=cpt_replay scheduler.warmup_steps=W``) equal to the default of this
    ``trainer.max_steps`` was taken for the default and fitted to the step (step 5 of a CPT run resumed with
    ``warmup_steps=7 trainer.max_steps=70`` ran at the peak, with ``trainer.max_steps=60`` at 6/7 of it)."""
    register()
    cfg = OmegaConf.create({"trainer": {"max_steps": 500}, "callbacks": {"wsd": {
        "_target_": "lit_dtrain.callbacks.WSDScheduler", "total_steps": "${trainer.max_steps}", "decay_fraction": 0.2,
        "warmup_steps": "${oc.select:scheduler.warmup_steps,${lit.warmup:${trainer.max_steps}}}"}}})
    if settings:
        cfg.scheduler = settings
    fit_default_warmup(cfg, checkpoints[30], 30)
    assert cfg.callbacks.wsd.warmup_steps == warmup


def test_an_lr_that_jumps_up_names_the_settings_that_raised_it(caplog, tmp_path):
    """A nano run of 10 steps resumed (resume=auto) with trainer.max_steps=12 was warned that step 10 'lies in this
    run's decay ... which gives it a higher LR than the checkpoint's run's schedule did (another total_steps, decay
    length, decay_type, min_lr_factor or warmup)', and with max_steps=40 that it lies past the warmup: neither named
    the setting that had changed, as the warning of an LR that drops does. Now both name each setting that differs
    from the checkpoint's run's config_resolved.yaml, with its old value; without that file, the old wording."""
    ckpt = tmp_path / "run" / "checkpoints" / "95.ckpt"
    ckpt.parent.mkdir(parents=True)
    trainer = fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=95,
                  root=tmp_path)  # in its decay, from step 80: 0.29 of the peak at step 95 (1-sqrt)
    trainer.save_checkpoint(ckpt)
    bare = tmp_path / "95.ckpt"  # no config_resolved.yaml beside its dir
    bare.write_bytes(ckpt.read_bytes())
    (tmp_path / "run" / "config_resolved.yaml").write_text(
        "trainer: {max_steps: 100}\nscheduler: {_target_: lit_dtrain.schedules.wsd_scheduler, total_steps: 100, "
        "warmup_steps: 10, decay_steps: 20, decay_fraction: null}\n")
    os.utime(tmp_path / "run" / "config_resolved.yaml", (ckpt.stat().st_mtime - 10,) * 2)  # written at its start
    longer = "trainer.max_steps={} (which scheduler.total_steps follows) where the checkpoint's run had 100"
    # 110 steps: its decay runs from step 90, so step 95 is earlier in it
    [(level, said)] = messages(caplog, ckpt, 95, 110, warmup_steps=10, decay_steps=20, decay_fraction=None)
    assert level == "WARNING" and "which gives it a higher LR than the checkpoint's run's schedule did: this run's " \
        + longer.format(110) + ", so the LR jumps up; resume with" in said
    [(_, said)] = messages(caplog, bare, 95, 110, warmup_steps=10, decay_steps=20, decay_fraction=None)
    assert "did (another total_steps, decay length, decay_type, min_lr_factor or warmup), so the LR jumps up" in said
    # 200 steps with another warmup: step 95 lies in the stable phase, at the peak
    [(level, said)] = messages(caplog, ckpt, 95, 200, warmup_steps=20, decay_steps=20, decay_fraction=None)
    assert level == "WARNING" and "so the LR jumps up without a re-warmup; this run's scheduler.warmup_steps=20 " \
        "where the checkpoint's run had 10 and " + longer.format(200) + "; pass scheduler.warmup_steps=" in said
    [(_, said)] = messages(caplog, bare, 95, 200, warmup_steps=20, decay_steps=20, decay_fraction=None)
    assert "so the LR jumps up without a re-warmup; pass scheduler.warmup_steps=" in said


def test_a_config_rewritten_after_the_checkpoint_is_not_named_as_its_runs(caplog, tmp_path):
    """A 10-step nano run resumed with trainer.max_steps=2000 and killed in training (before its first checkpoint)
    left config_resolved.yaml of max_steps=2000 beside last.ckpt of step 10; resumed again with max_steps=20, the
    warning said 'trainer.max_steps=20 ... where the checkpoint's run had 2000' (and warmup_steps 'had 100'), the
    values of the killed start, not those the checkpoint was trained with. A config whose schedule does not give the
    checkpoint's step the LR the checkpoint holds is not read: the wording without that file. One that does is read
    even where it is newer (a re-run of the finished run's command, which only validated, rewrote it)."""
    ckpt = tmp_path / "run" / "checkpoints" / "95.ckpt"
    ckpt.parent.mkdir(parents=True)
    trainer = fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=95,
                  root=tmp_path)
    trainer.save_checkpoint(ckpt)
    config = tmp_path / "run" / "config_resolved.yaml"
    config.write_text("trainer: {max_steps: 2000}\nscheduler: {_target_: lit_dtrain.schedules.wsd_scheduler, "
                      "total_steps: 2000, warmup_steps: 100, decay_steps: 20, decay_fraction: null}\n")
    os.utime(config, (ckpt.stat().st_mtime + 10,) * 2)  # the killed start's, after the checkpoint
    [(level, said)] = messages(caplog, ckpt, 95, 200, warmup_steps=20, decay_steps=20, decay_fraction=None)
    assert level == "WARNING" and "had 2000" not in said and "had 100" not in said
    assert "so the LR jumps up without a re-warmup; pass scheduler.warmup_steps=" in said
    config.write_text("trainer: {max_steps: 100}\nscheduler: {_target_: lit_dtrain.schedules.wsd_scheduler, "
                      "total_steps: 100, warmup_steps: 10, decay_steps: 20, decay_fraction: null}\n")
    os.utime(config, (ckpt.stat().st_mtime + 10,) * 2)
    [(_, said)] = messages(caplog, ckpt, 95, 200, warmup_steps=20, decay_steps=20, decay_fraction=None)
    assert "this run's scheduler.warmup_steps=20 where the checkpoint's run had 10 and trainer.max_steps=200" in said


def test_a_decayed_checkpoint_resumed_inside_a_longer_warmup_is_not_said_to_be_in_a_longer_one(caplog, tmp_path):
    """A 10-step nano run (warmup 1, decayed to LR 0 at step 10) resumed with trainer.max_steps=2000 (its default
    warmup 100) was told 'scheduler.warmup_steps=100 ... is shorter than the checkpoint's run's warmup, so the LR
    jumps up; pass scheduler.warmup_steps=<the checkpoint's run's>': its run's warmup was 1, and the checkpoint was
    in its decay. Where config_resolved.yaml gives a warmup at or before the step, the warning says so."""
    ckpt = tmp_path / "run" / "checkpoints" / "95.ckpt"
    ckpt.parent.mkdir(parents=True)
    trainer = fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=95,
                  root=tmp_path)  # in its decay, from step 80: 0.29 of the peak at step 95 (1-sqrt)
    trainer.save_checkpoint(ckpt)
    bare = tmp_path / "95.ckpt"  # no config_resolved.yaml beside its dir
    bare.write_bytes(ckpt.read_bytes())
    config = tmp_path / "run" / "config_resolved.yaml"
    config.write_text("trainer: {max_steps: 100}\nscheduler: {_target_: lit_dtrain.schedules.wsd_scheduler, "
                      "total_steps: 100, warmup_steps: 10, decay_steps: 20, decay_fraction: null}\n")
    os.utime(config, (ckpt.stat().st_mtime - 10,) * 2)  # written at its start
    # warmup 200: step 95 at 96/200 = 0.48 of the peak
    [(level, said)] = messages(caplog, ckpt, 95, 1000, warmup_steps=200)
    assert level == "WARNING" and ": the checkpoint is past its run's warmup (scheduler.warmup_steps=10) and below " \
        "its peak, in its decay, and this run's scheduler.warmup_steps=200 gives the step a higher LR, so the LR " \
        "jumps up; extend a stable-phase checkpoint" in said
    assert "shorter than the checkpoint's run's warmup" not in said
    [(_, said)] = messages(caplog, bare, 95, 1000, warmup_steps=200)
    assert "scheduler.warmup_steps=200 is shorter than the checkpoint's run's warmup, so the LR jumps up" in said


def test_the_wsd_callbacks_horizon_is_named_as_the_trainer_max_steps_it_follows(caplog, tmp_path):
    """callbacks=[default,wsd] '~scheduler', a 10-step nano run resumed with trainer.max_steps=12, was told 'this
    run's callbacks.wsd.total_steps=12 where the checkpoint's run had 10': a key not given, as conf/callbacks/wsd.yaml
    writes it ${oc.select:scheduler.total_steps,${trainer.max_steps}}. It names trainer.max_steps, as the
    scheduler's."""
    register()
    ckpt = tmp_path / "run" / "checkpoints" / "95.ckpt"
    ckpt.parent.mkdir(parents=True)
    trainer = fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=95,
                  root=tmp_path)
    trainer.save_checkpoint(ckpt)
    wsd = {"_target_": "lit_dtrain.callbacks.WSDScheduler", "warmup_steps": 10, "decay_steps": 20,
           "decay_fraction": None}
    config = tmp_path / "run" / "config_resolved.yaml"
    config.write_text(OmegaConf.to_yaml({"trainer": {"max_steps": 100},
                                         "callbacks": {"wsd": {**wsd, "total_steps": 100}}}))
    os.utime(config, (ckpt.stat().st_mtime - 10,) * 2)  # written at its start
    cfg = OmegaConf.create({"trainer": {"max_steps": 110}, "callbacks": {"wsd": {
        **wsd, "total_steps": "${oc.select:scheduler.total_steps,${trainer.max_steps}}"}}})
    with caplog.at_level("INFO", logger="lit_dtrain.schedules.workflows"):
        warn_if_the_resume_moves_the_lr(cfg, ckpt, 95)
    [said] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "this run's trainer.max_steps=110 (which callbacks.wsd.total_steps follows) where the checkpoint's run " \
        "had 100, so the LR jumps up" in said


def test_a_switched_schedule_is_named(caplog, tmp_path):
    """A 10-step nano run (scheduler=wsd) resumed with trainer.max_steps=12 scheduler=cosine was warned that the LR
    jumps up, naming no setting: _changed compared only a schedule of the same target. It names the switch now."""
    ckpt = tmp_path / "run" / "checkpoints" / "95.ckpt"
    ckpt.parent.mkdir(parents=True)
    trainer = fit(Toy(schedule=dict(total_steps=100, warmup_steps=10, decay_steps=20)), [], max_steps=95,
                  root=tmp_path)  # in its decay, from step 80: 0.29 of the peak at step 95 (1-sqrt)
    trainer.save_checkpoint(ckpt)
    config = tmp_path / "run" / "config_resolved.yaml"
    config.write_text("trainer: {max_steps: 100}\nscheduler: {_target_: lit_dtrain.schedules.wsd_scheduler, "
                      "total_steps: 100, warmup_steps: 10, decay_steps: 20, decay_fraction: null}\n")
    os.utime(config, (ckpt.stat().st_mtime - 10,) * 2)  # written at its start
    [(level, said)] = messages(caplog, ckpt, 95, 1000, target="cosine", warmup_steps=10)
    assert level == "WARNING" and "so the LR jumps up without a re-warmup; this run's scheduler=cosine where the " \
        "checkpoint's run had wsd; pass" in said
