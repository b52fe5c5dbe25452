"""The WSD experiment configs (``experiment=wsd_vs_cosine``, ``experiment=cpt_replay``): they compose, and what
cpt_replay needs or leaves behind (``init_from``, its ``scheduler:`` settings without a scheduler, under the WSD
callback, or under another schedule) is read or named in one line. (The workflows themselves are in
test_wsd_workflows.py.)"""

from __future__ import annotations

import re

import pytest

from lit_dtrain.train import ConfigError, train
from tests.conftest import compose_cfg


@pytest.mark.parametrize("experiment", ["wsd_vs_cosine", "cpt_replay"])
def test_experiment_configs_compose(experiment, tmp_path, corpus):
    """Each experiment's own settings win over the groups it composes (its ``_self_`` comes last): its budget,
    warmup and decay, and cpt_replay's two weighted corpora."""
    cfg = compose_cfg([f"experiment={experiment}"], tmp_path / experiment, tiny=False)
    assert cfg.scheduler._target_.endswith("wsd_scheduler")
    assert (cfg.scheduler.warmup_steps, cfg.scheduler.min_lr_factor) == (50, 0.0)
    if experiment == "cpt_replay":
        assert [(s.name, s.weight) for s in cfg.data.sources] == [("stdlib", 5), ("licenses", 95)]
        assert (cfg.trainer.max_steps, cfg.trainer.val_check_interval, cfg.scheduler.decay_fraction) == (500, 50, 0.2)
    else:
        assert (cfg.trainer.max_steps, cfg.trainer.val_check_interval) == (1000, 100)


def test_cpt_replay_without_init_from_is_an_error(tmp_path, corpus):
    """``experiment=cpt_replay`` continues a checkpoint. Without ``init_from`` it trained a fresh model on the
    mixture and said nothing (its own ``init_from: null`` was the root's value). Now an error naming the key,
    before any data is read; given on the command line, the path is used as is."""
    missing = compose_cfg(["experiment=cpt_replay", "sample.max_new_tokens=0"], tmp_path / "a", tiny=False)
    with pytest.raises(ConfigError, match=r"experiment=cpt_replay.*init_from=PATH"):
        train(missing)
    assert not (tmp_path / "token_cache").exists()  # nothing tokenized
    given = compose_cfg(["experiment=cpt_replay", "init_from=/x/last.ckpt"], tmp_path / "b", tiny=False)
    assert given.init_from == "/x/last.ckpt"
    with pytest.raises(ConfigError, match=r"init_from='/x/last.ckpt' does not exist"):
        train(given)


def test_an_experiments_scheduler_settings_without_a_scheduler(tmp_path, corpus):
    """``experiment=cpt_replay '~scheduler'`` leaves the experiment's ``scheduler:`` settings (warmup 50) as a node
    without ``_target_``. With the WSD callback they are its settings (its warmup_steps reads scheduler.warmup_steps);
    ``train()`` instantiated the node anyway and failed with ``TypeError: 'DictConfig' object is not callable``
    after tokenizing. Without the callback nothing reads them: an error naming the node, before any compute."""
    from lit_dtrain.config_checks import check_config, scheduler_config
    from lit_dtrain.train import ConfigError

    with_callback = compose_cfg(["experiment=cpt_replay", "~scheduler", "callbacks=[default,wsd]"],
                                tmp_path / "a", tiny=False)
    check_config(with_callback)
    assert scheduler_config(with_callback) is None
    assert with_callback.callbacks.wsd.warmup_steps == 50
    alone = compose_cfg(["experiment=cpt_replay", "~scheduler"], tmp_path / "b", tiny=False)
    with pytest.raises(ConfigError, match=r"scheduler has no _target_: it holds only \['warmup_steps', "
                                          r"'decay_fraction', 'min_lr_factor'\].*scheduler=wsd.*"
                                          r"callbacks=\[default,wsd\]"):
        check_config(alone)


def test_the_wsd_callback_takes_every_setting_an_experiment_leaves_in_scheduler(tmp_path, corpus):
    """``experiment=cpt_replay '~scheduler' 'callbacks=[default,wsd]' scheduler.decay_fraction=0.5``: the callback
    read only ``scheduler.warmup_steps`` and decayed over its own default 20% (100 of 500 steps, not 250), and a
    ``scheduler.min_lr_factor=0.1`` decayed to 0, without a word. Each of its keys now reads the node's; a key it
    has no argument for is an error naming it."""
    from lit_dtrain.callbacks import WSDScheduler
    from lit_dtrain.config_checks import check_config
    from lit_dtrain.train import build_callbacks

    common = ["experiment=cpt_replay", "init_from=/x/last.ckpt", "~scheduler", "callbacks=[default,wsd]"]
    cfg = compose_cfg([*common, "scheduler.decay_fraction=0.5", "scheduler.min_lr_factor=0.1",
                       "+scheduler.decay_type=linear"], tmp_path / "a", tiny=False)
    check_config(cfg)
    (callback,) = [c for c in build_callbacks(cfg) if isinstance(c, WSDScheduler)]
    assert (callback.total_steps, callback.warmup_steps, callback.decay_steps) == (500, 50, 250)
    assert (callback.decay_type, callback.min_lr_factor) == ("linear", 0.1)
    explicit = compose_cfg([*common, "callbacks.wsd.decay_fraction=0.1"], tmp_path / "b", tiny=False)
    assert explicit.callbacks.wsd.decay_fraction == 0.1  # the callback's own key wins
    unread = compose_cfg([*common, "+scheduler.decay_fracton=0.5"], tmp_path / "c", tiny=False)
    with pytest.raises(ConfigError, match=r"scheduler.decay_fracton is set.*callbacks.wsd.*nothing reads"):
        check_config(unread)


def test_cpt_replay_with_another_schedule_names_the_experiments_leftover_key(tmp_path):
    """``experiment=cpt_replay scheduler=cosine`` (the cosine re-warm of docs/wsd.md) kept the experiment's
    ``scheduler.decay_fraction``, an argument of WSD only: a ``TypeError`` traceback. Now one line naming the key and
    the override that drops it, which then composes and checks."""
    from lit_dtrain.config_checks import check_config

    common = ["experiment=cpt_replay", "init_from=/x/last.ckpt", "scheduler=cosine"]
    with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.2 is not an argument of cosine_scheduler .*"
                                          r"drop it with '~scheduler.decay_fraction'$"):
        check_config(compose_cfg(common, tmp_path / "a", tiny=False))
    fixed = compose_cfg([*common, "~scheduler.decay_fraction"], tmp_path / "b", tiny=False)
    check_config(fixed)
    # both re-warms decay to 0, as in the benchmark of docs/wsd.md (cosine's own default, 0.1, ended it at a tenth)
    assert (fixed.scheduler.warmup_steps, fixed.scheduler.total_steps, fixed.scheduler.min_lr_factor) == (50, 500, 0)
    # a constant re-warm takes neither of the experiment's decay settings: one line names both (it named only the
    # first, and the command line fixed by it failed again on the second)
    constant = ["experiment=cpt_replay", "init_from=/x/last.ckpt", "scheduler=constant"]
    with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.2 and scheduler.min_lr_factor=0.0 are not "
                                          r"arguments of constant_scheduler .*drop them with "
                                          r"'~scheduler.decay_fraction' '~scheduler.min_lr_factor'$"):
        check_config(compose_cfg(constant, tmp_path / "c", tiny=False))
    check_config(compose_cfg([*constant, "~scheduler.decay_fraction", "~scheduler.min_lr_factor"], tmp_path / "d",
                             tiny=False))


def test_a_key_added_on_the_command_line_that_the_schedule_does_not_take_names_removing_that_override(tmp_path,
                                                                                                      corpus):
    """``scheduler=cosine ++scheduler.decay_fraction=0.2`` was told "an experiment's setting for another schedule?;
    drop it with '~scheduler.decay_fraction'": no experiment set it, and that advice added failed in Hydra ('Could not
    delete from config. 'scheduler.decay_fraction' does not exist.'): the fix is to remove the '++' override. The
    line names that override; a key an experiment left keeps '~'."""
    from hydra.types import RunMode

    from lit_dtrain.config_checks import check_config
    from tests.unit._sweep_helpers import multirun_job

    typed = ["scheduler=cosine", "++scheduler.decay_fraction=0.2"]
    with multirun_job(tmp_path / "runs" / "a", [], typed, corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.2 is not an argument of cosine_scheduler; "
                                              r"remove '\+\+scheduler.decay_fraction=0.2' from the command line$"):
            check_config(cfg)
    with multirun_job(tmp_path / "runs" / "b", [], typed[:1], corpus, mode=RunMode.RUN) as cfg:
        check_config(cfg)  # the fixed command line
    two = ["scheduler=constant", "++scheduler.decay_fraction=0.2", "+scheduler.min_lr_factor=0.1"]
    with multirun_job(tmp_path / "runs" / "c", [], two, corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.2 and scheduler.min_lr_factor=0.1 are not "
                                              r"arguments of constant_scheduler; remove '\+\+scheduler.decay_fraction"
                                              r"=0.2' '\+scheduler.min_lr_factor=0.1' from the command line$"):
            check_config(cfg)


def test_a_swept_key_added_on_the_command_line_names_the_override_as_typed_after_minus_m(tmp_path, corpus):
    """``-m scheduler=cosine ++scheduler.decay_fraction=0.1,0.2``: job 0 was told "remove
    '++scheduler.decay_fraction=0.1' from the command line", a line the command line did not hold (each job's own
    override); it names the -m argument now."""
    from lit_dtrain.config_checks import check_config
    from tests.unit._sweep_helpers import multirun_job

    sweep = ["scheduler=cosine", "++scheduler.decay_fraction=0.1,0.2"]
    job = ["scheduler=cosine", "++scheduler.decay_fraction=0.1"]
    with multirun_job(tmp_path / "sweep" / "0", sweep, job, corpus) as cfg:
        with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.1 is not an argument of cosine_scheduler; "
                                              r"remove '\+\+scheduler.decay_fraction=0.1,0.2' from the command line$"):
            check_config(cfg)
    # swept mappings: it named the job's own '++scheduler={decay_fraction:0.1}', which the command line did not hold
    sweep = ["scheduler=cosine", "++scheduler={decay_fraction:0.1},{decay_fraction:0.2}"]
    job = ["scheduler=cosine", "++scheduler={decay_fraction:0.1}"]
    with multirun_job(tmp_path / "mappings" / "0", sweep, job, corpus) as cfg:
        with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.1 is not an argument of cosine_scheduler; "
                                              r"remove decay_fraction from '\+\+scheduler=\{decay_fraction:0.1\},"
                                              r"\{decay_fraction:0.2\}' on the command line$"):
            check_config(cfg)


def test_a_key_added_in_a_mapping_on_the_command_line_names_removing_it_from_that_mapping(tmp_path, corpus):
    """``scheduler=cosine '++scheduler={decay_fraction:0.2}'`` was taken for an experiment's setting ("an experiment's
    setting for another schedule?; drop it with '~scheduler.decay_fraction'"): it is the command line's, in the
    mapping that override gives; the line names removing it there, and the other keys of that mapping stay."""
    from hydra.types import RunMode

    from lit_dtrain.config_checks import check_config
    from tests.unit._sweep_helpers import multirun_job

    for n, mapping in enumerate(("++scheduler={decay_fraction:0.2}", "+scheduler={decay_fraction:0.2,warmup_steps:1}")):
        with multirun_job(tmp_path / "runs" / str(n), [], ["scheduler=cosine", mapping], corpus,
                          mode=RunMode.RUN) as cfg:
            with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.2 is not an argument of cosine_sched"
                                                  rf"uler; remove decay_fraction from '{re.escape(mapping)}' on the "
                                                  r"command line$"):
                check_config(cfg)
    with multirun_job(tmp_path / "runs" / "fixed", [], ["scheduler=cosine", "+scheduler={warmup_steps:1}"], corpus,
                      mode=RunMode.RUN) as cfg:
        check_config(cfg)  # the fixed command line
        assert cfg.scheduler.warmup_steps == 1


def test_a_key_both_an_experiment_and_the_command_line_set_is_fixed_in_one_start(tmp_path):
    """``experiment=cpt_replay scheduler=cosine ++scheduler.decay_fraction=0.3`` was told to remove the '++'
    override; the next start was then told to drop the experiment's own decay_fraction with '~': two starts. The
    line names both at once: replace the override with '~', which composes and passes."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lit_dtrain.config_checks import check_config
    from tests.conftest import CONF_DIR, in_hydra_job

    def checked(*job: str) -> None:
        typed = ["experiment=cpt_replay", "init_from=/x/last.ckpt", "scheduler=cosine", *job]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            full = compose(config_name="train", overrides=typed, return_hydra_config=True)
        with open_dict(full):
            full.hydra.overrides.task, full.paths.output_dir = typed, str(tmp_path / "run")
        with in_hydra_job(full) as cfg:
            check_config(cfg)

    with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.3 is not an argument of cosine_scheduler; "
                                          r"replace '\+\+scheduler.decay_fraction=0.3' with "
                                          r"'~scheduler.decay_fraction' \(experiment=cpt_replay sets it too\)$"):
        checked("++scheduler.decay_fraction=0.3")
    checked("~scheduler.decay_fraction")  # the fixed command line
    # a mapping's key: replacing the whole line dropped its other keys, and warmup_steps:1 trained as the experiment's
    # 50 without a word; its key is removed from the mapping and the experiment's dropped with '~'
    with pytest.raises(ConfigError, match=r"^scheduler.decay_fraction=0.3 is not an argument of cosine_scheduler; "
                                          r"remove decay_fraction from '\+\+scheduler=\{decay_fraction:0.3,"
                                          r"warmup_steps:1\}' and add '~scheduler.decay_fraction' \(experiment="
                                          r"cpt_replay sets it too\)$"):
        checked("++scheduler={decay_fraction:0.3,warmup_steps:1}")
    checked("++scheduler={warmup_steps:1}", "~scheduler.decay_fraction")  # the fixed command line
