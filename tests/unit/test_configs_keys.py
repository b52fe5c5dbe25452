"""Config keys: those of conf/train.yaml, unknown keys in experiment files and interpolations; warnings at the
start of a run."""

from pathlib import Path

import pytest

from lit_dtrain.config_checks import check_config
from lit_dtrain.train import ConfigError
from tests.conftest import CONF_DIR
from tests.unit._config_helpers import start_warnings


def test_config_keys_are_those_of_conf_train_yaml():
    """CONFIG_KEYS (what check_known_keys accepts) is conf/train.yaml's groups, own keys and plain sections' keys."""
    from omegaconf import OmegaConf

    from lit_dtrain.config_keys import CONFIG_KEYS

    primary = OmegaConf.load(Path(CONF_DIR) / "train.yaml")
    groups = {next(iter(entry)) for entry in primary.defaults if not isinstance(entry, str)}
    assert set(CONFIG_KEYS[""]) == groups | (set(primary) - {"defaults"})
    sections = {key for key in primary if key != "defaults" and OmegaConf.is_dict(primary[key])}
    assert sections == set(CONFIG_KEYS) - {""}
    for section in sections:
        assert set(CONFIG_KEYS[section]) == set(primary[section]), section


@pytest.mark.parametrize(
    "experiment, match",
    [
        ("init_form: /some/run/last.ckpt", r"unknown config key 'init_form' .*did you mean 'init_from'\?"),
        ("sample:\n  promt: 'class '", r"unknown config key 'sample.promt' .*did you mean 'sample.prompt'\?"),
        ("decay_branch:\n  step: 500", r"unknown config key 'decay_branch.step' .*did you mean 'decay_branch.steps'"),
        ("module:\n  compiled: true", r"unknown config key 'module.compiled' .*did you mean 'module.compile'\?"),
        # strategy=auto is read by its name alone: `nme: ddp` trained with 'auto' and exited 0
        ("strategy:\n  nme: ddp", r"unknown config key 'strategy.nme' .*did you mean 'strategy.name'\?"),
        ("defaults:\n  - override /logger: none\nlogger:\n  name: tb2",
         r"unknown config key 'logger.name' .*\(logger without _target_ holds no keys\)"),
    ],
)
def test_an_unknown_key_in_an_experiment_file_is_refused(experiment, match, tmp_path):
    """Hydra refuses an unknown key on the command line only: an experiment file (@package _global_) added one without
    a word, and train() ignored it (init_form: trained from scratch; sample.promt, decay_branch.step did nothing)."""
    import shutil

    from hydra import compose, initialize_config_dir

    from lit_dtrain.config_checks import check_known_keys

    conf = shutil.copytree(CONF_DIR, tmp_path / "conf")
    (conf / "experiment" / "typo.yaml").write_text(f"# @package _global_\n{experiment}\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=typo"])
    with pytest.raises(ConfigError, match=match):
        check_known_keys(cfg)
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


@pytest.mark.parametrize(("added", "advice"), [
    ("+trainer.strategy=ddp", "choose it with 'strategy=<option of conf/strategy>'"),
    ("+trainer.logger=false", "choose it with 'logger=<option of conf/logger>' (logger=none: no logger)"),
    ("+trainer.callbacks=null", "choose them with 'callbacks=[default,<option of conf/callbacks>]'"),
    ("+trainer.plugins=null", "train.py passes its own"),
])
def test_a_trainer_argument_that_train_py_passes_itself_is_refused(added, advice):
    """train.py builds the Trainer with its own strategy, callbacks, logger and plugins, which win over the trainer
    node's: '+trainer.strategy=ddp' trained on one process and '+trainer.logger=false' still wrote TensorBoard
    events, both with exit status 0."""
    from hydra import compose, initialize_config_dir

    from lit_dtrain.config_checks import check_known_keys

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[added])
    key = added[1:].split("=")[0]
    with pytest.raises(ConfigError) as refused:
        check_known_keys(cfg)
    assert str(refused.value).startswith(f"{key} is passed to the Trainer by train.py, so a value here would be "
                                         f"ignored: {advice}")


def test_a_key_that_an_interpolation_reads_is_not_unknown(tmp_path):
    """A config's own variable (lightning-hydra-template style) is read through its interpolation: not refused."""
    import shutil

    from hydra import compose, initialize_config_dir

    from lit_dtrain.config_checks import check_known_keys

    conf = shutil.copytree(CONF_DIR, tmp_path / "conf")
    (conf / "experiment" / "vars.yaml").write_text("# @package _global_\nwidth: 48\nlr_peak: {base: 0.002}\n"
                                                   "model:\n  d_model: ${width}\noptimizer:\n  lr: ${lr_peak.base}\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=vars"])
        typo = compose(config_name="train", overrides=["experiment=vars", "+widht=64"])
    check_known_keys(cfg)
    assert (cfg.model.d_model, cfg.optimizer.lr) == (48, 0.002)
    with pytest.raises(ConfigError, match=r"unknown config key 'widht'"):  # no interpolation reads the typo
        check_known_keys(typo)


def test_train_refuses_an_unknown_key_before_the_decay_branch_reads_its_keys(tiny_cfg):
    from omegaconf import open_dict

    from lit_dtrain.train import train

    cfg = tiny_cfg("decay_branch.ckpt=/nonexistent.ckpt")
    with open_dict(cfg):
        cfg.decay_branch.step = 5  # what `decay_branch: {step: 5}` in a config file makes
    with pytest.raises(ConfigError, match=r"unknown config key 'decay_branch.step'"):
        train(cfg)


def test_a_callbacks_choice_without_the_defaults_is_warned_about(tmp_path, caplog):
    """``python train.py callbacks=loss_spike`` (for ``'callbacks=[default,loss_spike]'``) wrote no checkpoint
    before its end (none at a validation, none on SIGTERM) and no LR or throughput curves, not saying so."""
    from lit_dtrain.config_warnings import warn_if_the_default_callbacks_are_dropped

    warnings_for = start_warnings(warn_if_the_default_callbacks_are_dropped, tmp_path, caplog)
    assert warnings_for("callbacks=loss_spike") == [
        "callbacks=[loss_spike] replaces the default callbacks (model_checkpoint, preemption, lr_monitor, "
        "throughput, memory): no checkpoint before the run's end, none on SIGTERM; to add to them: "
        "'callbacks=[default,loss_spike]'"
    ]
    assert len(warnings_for("callbacks=[loss_spike,adaptive_grad_clip]")) == 1
    assert warnings_for("callbacks=[default,loss_spike]") == []
    assert warnings_for("callbacks=none") == []  # nothing at all: meant
    assert warnings_for("callbacks.model_checkpoint=null") == []  # one default switched off: meant


def test_a_checkpoint_name_that_shows_another_metric_than_its_monitor_is_warned_about(tmp_path, caplog):
    """``callbacks.model_checkpoint.monitor=val/text/loss`` with the default filename wrote the best checkpoint by the
    text source's loss as ``step000012-val3.5197.ckpt``, the pooled val/loss, without a word."""
    from lit_dtrain.config_warnings import warn_if_a_checkpoint_name_shows_another_metric

    warnings_for = start_warnings(warn_if_a_checkpoint_name_shows_another_metric, tmp_path, caplog)
    assert warnings_for("callbacks.model_checkpoint.monitor=val/text/loss") == [
        "callbacks.model_checkpoint ranks its checkpoints by monitor=val/text/loss, but its filename "
        "'step{step:06d}-val{val/loss:.4f}' shows val/loss: the best file's name holds another metric's value; to name "
        "it by the ranked one: callbacks.model_checkpoint.filename='step{step:06d}-val{val/text/loss:.4f}'"
    ]
    assert warnings_for() == []  # val/loss, shown and ranked
    assert warnings_for("callbacks.model_checkpoint.monitor=val/text/loss",
                        "callbacks.model_checkpoint.filename='{step}-{val/text/loss:.3f}'") == []
    assert warnings_for("callbacks.model_checkpoint.monitor=val/text/loss",
                        "callbacks.model_checkpoint.filename='step{step:06d}'") == []  # no metric shown


def test_a_fourier_stage_schedule_longer_than_the_run_is_warned_about(tmp_path, caplog):
    """``python train.py data/sampler=fourier`` (1000 steps; the brief's stages: LR x0.1 to step 5000, x0.5 to
    20000) trained every step at 0.1 of optimizer.lr without a word."""
    from lit_dtrain.config_warnings import warn_if_the_stages_outlast_the_run

    warnings_for = start_warnings(warn_if_the_stages_outlast_the_run, tmp_path, caplog)
    assert warnings_for("data/sampler=fourier") == [
        "data/sampler=fourier: trainer.max_steps=1000 ends in the sampler's stage 'warmup' (LR x0.1 of optimizer.lr, "
        "x0.1 from step 0): its last stage (x1) starts at step 20000 = 20 x data.sampler.step_unit=1000. Scale the "
        "stages to the run with data.sampler.step_unit=<max_steps / 50>, or set data.sampler.stage_lr=false"
    ]
    assert "stage 'ramp' (LR x0.5" in warnings_for("data/sampler=fourier", "trainer.max_steps=6000")[0]
    assert warnings_for("data/sampler=fourier", "data.sampler.step_unit=20") == []  # stable from step 400
    assert warnings_for("data/sampler=fourier", "trainer.max_steps=20001") == []  # its last step is in the stable
    assert len(warnings_for("data/sampler=fourier", "trainer.max_steps=20000")) == 1  # step 19999: still the ramp
    assert warnings_for("data/sampler=fourier", "data.sampler.stage_lr=false") == []
    assert warnings_for("data/sampler=fourier", "data.sampler.stages=false") == []
    assert warnings_for() == []  # the random sampler
