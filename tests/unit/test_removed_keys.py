"""``~key`` (Hydra's deletion) of a key lit_dtrain needs: one line naming it and the fix, not a traceback, not the
class's own default (``lit_dtrain._removed_keys``)."""

from __future__ import annotations

import pytest

from lit_dtrain._removed_keys import check_removed_keys
from lit_dtrain.train import ConfigError, train
from tests.conftest import TINY
from tests.unit.test_hydra_chdir import hydra_job


def job(tmp_path, overrides: list[str]):
    """``python train.py *overrides`` (the tiny run's overrides of a removed section left out) as the job gets it."""
    sections = {o[1:] + "." for o in overrides if o.startswith("~") and "." not in o}
    tiny = [o for o in TINY if not o.startswith(tuple(sections))]
    return hydra_job(tmp_path / "run", [*tiny, f"run_name={tmp_path.name}", *overrides])


@pytest.mark.parametrize("removed, message", [
    # was OmegaConf's traceback: "Key 'optimizer' is not in struct"
    ("~optimizer", r"^~optimizer removes the 'optimizer' config, which lit_dtrain needs: choose an option instead "
                   r"\(optimizer=adamw\)$"),
    # was "trainer.max_steps must be a positive step budget, got -1" (Lightning's default, never typed)
    ("~trainer.max_steps", r"^~trainer.max_steps removes a value the config sets: .*\(trainer.max_steps=<value>\)$"),
])
def test_train_refuses_a_removed_key_in_one_line(tmp_path, removed, message):
    with job(tmp_path, [removed]) as cfg, pytest.raises(ConfigError, match=message):
        train(cfg)


@pytest.mark.parametrize("removed", ["~optimizer.lr", "~data.sources", "~model.n_layer", "~data.batch_size",
                                     # no warmup (step 0 at the peak LR); the newest checkpoint kept as the 'best'
                                     "~scheduler.warmup_steps", "~callbacks.model_checkpoint.monitor",
                                     # data=mixture's 0.5/0.5 drew 0.70/0.30 (CorpusSource's weight 1.0)
                                     "~data.sources.0.weight"])
def test_a_removed_value_is_not_the_class_default(tmp_path, removed):
    """~optimizer.lr trained with AdamW's lr 1e-3 (val loss 5.5324 for 5.4665), ~data.sources of data=textfiles on
    the stdlib corpus: a removed value of an instantiated section is refused."""
    with job(tmp_path, ["data=textfiles", removed]) as cfg, pytest.raises(ConfigError, match=f"^{removed} removes"):
        check_removed_keys(cfg)


@pytest.mark.parametrize("overrides", [
    # trained with BlockQuantizer(bits=8), exit 0
    ["strategy=ddp_compressed/int4", "~strategy.compressor.bits"],
    ["data/sampler=fourier", "~data.sampler.lag"], ["strategy=ddp", "~strategy.collective_timeout_s"]])
def test_a_removed_argument_of_a_nested_node_is_refused(tmp_path, overrides):
    """The sampler's, the strategy's and its codec's arguments, as a callback's and the scheduler's are."""
    with job(tmp_path, overrides) as cfg, pytest.raises(ConfigError, match=f"^{overrides[-1]} removes a value"):
        check_removed_keys(cfg)


@pytest.mark.parametrize("removed", [["~scheduler"], ["~sample"], ["~logger"], ["~callbacks.lr_monitor"],
                                     ["~scheduler._target_"], ["~model.n_layer", "+model.n_layer=3"],
                                     ["strategy=ddp_compressed/int4", "~strategy.compressor"],
                                     ["strategy=ddp_compressed/local_sgd", "~strategy.local_update"],
                                     # docs/wsd.md's cosine re-warm: cpt_replay's WSD key, which cosine does not take
                                     ["experiment=cpt_replay", "scheduler=cosine", "~scheduler.decay_fraction"]])
def test_optional_and_re_added_keys_may_be_removed(tmp_path, removed):
    with job(tmp_path, removed) as cfg:
        check_removed_keys(cfg)


def test_a_partial_config_as_the_primary_one_is_one_line(tmp_path):
    """``--config-name experiment/wsd_vs_cosine`` ended in OmegaConf's "Key 'optimizer' is not in struct" traceback."""
    with hydra_job(tmp_path / "run", ["trainer.max_steps=2"], config_name="experiment/wsd_vs_cosine") as cfg:
        with pytest.raises(ConfigError, match=r"^the config 'experiment/wsd_vs_cosine' has no model, data, optimizer, "
                                              r".*experiment=<name>, not --config-name"):
            train(cfg)


@pytest.mark.parametrize("removed", ["~callbacks.model_checkpoint.dirpath", "~callbacks.preemption.dirpath"])
def test_a_removed_key_holding_the_run_dir_is_refused_in_one_line(tmp_path, monkeypatch, removed):
    """Hydra reads the value it deletes while composing, before it sets the run dir: ``python train.py
    '~callbacks.model_checkpoint.dirpath'`` ended in "Error merging override ... HydraConfig was not set"."""
    from lit_dtrain import config_resolvers

    monkeypatch.setattr(config_resolvers, "_composing", False)
    config_resolvers.compose_for_a_run()  # as train.py does before Hydra composes
    with job(tmp_path, [removed]) as cfg, pytest.raises(ConfigError, match=f"^{removed} removes a value"):
        check_removed_keys(cfg)


def test_the_run_dir_of_a_config_composed_outside_train_py_names_the_key_to_set():
    from omegaconf import OmegaConf

    from lit_dtrain.config_resolvers import RequiredValueError

    cfg = OmegaConf.create({"paths": {"output_dir": "${lit.run_dir:}", "checkpoint_dir": "${paths.output_dir}/c"}})
    with pytest.raises(RequiredValueError, match=r"composed outside it needs paths.output_dir=<dir>"):
        _ = cfg.paths.checkpoint_dir


def test_a_removed_source_name_points_to_null(tmp_path):
    """``~data.sources.1.name`` was told to set a value only: ``name=null`` names a source from its paths."""
    with job(tmp_path, ["data=mixture", "~data.sources.1.name"]) as cfg:
        with pytest.raises(ConfigError, match=r"\(data.sources.1.name=<value>, or null to name the source from its "
                                              r"paths\)$"):
            check_removed_keys(cfg)


@pytest.mark.parametrize("removed", ["~paths.checkpoint_dir", "~paths.cache_dir"])
def test_a_removed_path_is_refused_in_one_line(tmp_path, monkeypatch, removed):
    """``~paths.checkpoint_dir`` ended in OmegaConf's traceback: "Key 'checkpoint_dir' is not in struct"."""
    from lit_dtrain import config_resolvers

    monkeypatch.setattr(config_resolvers, "_composing", True)  # as train.py composes
    with job(tmp_path, [removed]) as cfg, pytest.raises(ConfigError, match=rf"^{removed} removes a path lit_dtrain "
                                                                           rf"needs \(.*\); set it instead"):
        check_removed_keys(cfg)


@pytest.mark.parametrize("override, fix", [("optimizer=[]", "(options: adamw, adamw8bit); choose an option instead "
                                                            "(optimizer=adamw)"),
                                           ("model=[]", "(options: llama_125m, nano, small); choose an option instead "
                                                        "(model=nano)"),
                                           ("optimizer=[ ]", "(options: adamw, adamw8bit); choose an option instead "
                                                             "(optimizer=adamw)")])
def test_a_needed_group_given_an_empty_list_is_told_to_take_an_option(tmp_path, override, fix):
    """``optimizer=[]`` chooses no option, so the config has no optimizer: it was told "the config 'train' has no
    optimizer: it is not a whole config ...; apply an experiment with experiment=<name>, not --config-name", a
    command line without --config-name. It gets the line of ``optimizer=null`` (so does ``optimizer=[ ]``, which
    kept the old line)."""
    with hydra_job(tmp_path / "run", ["trainer.max_steps=2", override]) as cfg:
        with pytest.raises(ConfigError) as refused:
            train(cfg)
    group = override.partition("=")[0]
    assert str(refused.value) == (f"{override}: config group '{group}' takes the name of one of its options, not an "
                                  f"empty list {fix}")
