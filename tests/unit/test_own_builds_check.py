"""lit_dtrain's callbacks and codecs are built once with the config checks (``_own_builds_check``): their argument
checks come before the seed, and building them changes nothing a run sees (random state, files, signal handlers)."""

import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_dtrain.train import ConfigError

# (wsd beside a scheduler: refused by check_config, not by the build)
ALL_CALLBACKS = ("callbacks=[default,loss_spike,adaptive_grad_clip,fourier_sampler,optimizer_diagnostics,"
                 "selective_ckpt,wsd]", "data/sampler=fourier")  # (the callback feeds the FourierSampler)
PRESETS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf/strategy/ddp_compressed").glob("*.yaml"))


@pytest.mark.parametrize("override", [
    "callbacks=[default,loss_spike] callbacks.loss_spike.z_threshold=-1",
    "callbacks=[default,loss_spike] callbacks.loss_spike.actions=[log,skipp]",
    "callbacks.throughput.window_size=0",
    "callbacks.model_checkpoint.save_top_k=-2",
    "strategy=ddp_compressed strategy.compressor.matrix_approximation_rank=0",
    "strategy=ddp_compressed/topk strategy.compressor.ratio=2",
    "strategy=ddp_compressed/diloco strategy.local_update.sync_period=0",
    # Lightning's CSVLogger took 0 and failed at its first save, after training: 'integer modulo by zero'
    "logger=csv +logger.flush_logs_every_n_steps=0",
])
def test_a_bad_argument_of_lit_dtrains_own_callback_or_codec_is_refused_before_the_seed(tiny_cfg, monkeypatch,
                                                                                       override):
    """'Seed set to 1337' was printed before these refusals: the callbacks were built after the seed, the datamodule
    and the model, the strategy's codec later still. The message is the one the run's build gave."""
    import lightning as L

    from lit_dtrain.sweeps import user_error
    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    with pytest.raises(Exception) as refused:
        train(tiny_cfg(*override.split(" ")))
    error = user_error(refused.value)
    assert isinstance(error, ConfigError), refused.value
    key = override.split(" ")[-1].lstrip("+").rsplit(".", 1)[0]  # callbacks.loss_spike, strategy.compressor, ...
    assert str(error).startswith(f"{key}: "), str(error)


@pytest.mark.parametrize("overrides, line", [
    (["strategy=ddp_compressed", "strategy.collective_timeout_s=-5"],
     "strategy.collective_timeout_s must be a number of seconds > 0, got -5"),
    (["strategy=ddp_compressed", "strategy.connect_timeout_s=abc"],
     "strategy.connect_timeout_s must be a number of seconds > 0, got 'abc'"),
    (["strategy.collective_timeout_s=0"], "strategy.collective_timeout_s must be a number of seconds > 0, got 0"),
    (["strategy=ddp_compressed/local_sgd", "strategy.compressor=fp16"],
     "strategy: a local-update rule skips the per-step gradient all-reduce, so a gradient compressor would never run: "
     "set strategy.compressor=null (compressor=None in Python); a codec for DiLoCo's pseudo-gradient goes in "
     "strategy.local_update.compressor"),
])
def test_the_strategys_own_keys_are_refused_before_the_seed(tiny_cfg, monkeypatch, overrides, line):
    """The strategy is built after the seed (Lightning's for strategy=auto, inside the Trainer): its timeouts and a
    compressor beside a local-update rule were refused there, after 'Seed set to 1337'."""
    import lightning as L

    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    with pytest.raises(ConfigError) as refused:
        train(tiny_cfg(*overrides))
    assert str(refused.value) == line


@pytest.mark.parametrize("overrides", [["callbacks=[default,fourier_sampler]"],
                                       ["callbacks=[default,fourier_sampler]", "data/sampler=random"]])
def test_the_fourier_callback_without_its_sampler_is_refused_before_the_seed(tiny_cfg, monkeypatch, overrides):
    """It was FourierSamplerCallback's TypeError in its setup, inside fit: a 45-line traceback after the seed, the
    corpus's tokenization and config_resolved.yaml."""
    import lightning as L

    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    with pytest.raises(ConfigError) as refused:
        train(tiny_cfg(*overrides))
    assert str(refused.value) == ("callbacks.fourier_sampler (FourierSamplerCallback) feeds a FourierSampler, and "
                                  "data.sampler is RandomSampler: select data/sampler=fourier, or drop the callback")


def _state() -> tuple:
    return (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(),
            {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)})


@pytest.mark.parametrize("overrides", [ALL_CALLBACKS, ("logger=csv",),
                                       *[(f"strategy=ddp_compressed/{p}",) for p in PRESETS]])
def test_building_lit_dtrains_own_callbacks_and_codecs_draws_nothing_and_writes_nothing(
        tiny_cfg, tmp_path, monkeypatch, overrides):
    """Their ``__init__`` now also runs in the checks, before the seed and in runs that are refused: every own node
    a conf option holds is built here, and none changes the random generators' state, the signal handlers or the files
    under the run's and the working directory."""
    from lit_dtrain._own_builds_check import check_own_builds, own_nodes

    cfg = tiny_cfg(*overrides)
    nodes = own_nodes(cfg)
    codecs = [cfg.strategy.get(key) for key in ("compressor", "local_update")] if "_target_" in cfg.strategy else []
    # every callback but Lightning's progress bar; the codec and the local-update rule a preset holds; logger=csv's
    csv = cfg.logger.get("_target_") == "lit_dtrain.loggers.ResumableCSVLogger"
    assert len(nodes) == len(cfg.callbacks) - 1 + sum(node is not None for node in codecs) + csv
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    before, files = _state(), sorted(tmp_path.rglob("*"))
    check_own_builds(cfg)
    after = _state()
    assert torch.equal(before[0], after[0]) and before[1:2] == after[1:2] and (before[2] == after[2]).all()
    assert before[3] == after[3]
    assert sorted(tmp_path.rglob("*")) == files


def test_the_early_build_logs_nothing_and_the_runs_build_still_does(tiny_cfg, caplog):
    """A warning an ``__init__`` logs (WSDScheduler's 'decay_fraction=0.2 of total_steps=2 rounds to 0 decay steps',
    through ``logging``, which ``warnings.catch_warnings`` does not hold) was printed twice, the first time before
    'Seed set to 1337': the early build says nothing, the run's build says it once, as before the early build."""
    import logging

    from hydra.utils import instantiate

    from lit_dtrain._own_builds_check import check_own_builds

    cfg = tiny_cfg("callbacks=[default,wsd]", "callbacks.wsd.total_steps=2", "callbacks.wsd.warmup_steps=1",
                   "callbacks.wsd.decay_steps=null", "callbacks.wsd.decay_fraction=0.2")
    with caplog.at_level(logging.INFO):
        check_own_builds(cfg)
        assert [r.getMessage() for r in caplog.records] == []
        instantiate(cfg.callbacks.wsd)  # the run's build
    assert [r.getMessage()[:52] for r in caplog.records] == ["WSD: decay_fraction=0.2 of total_steps=2 rounds to 0"]


def test_a_users_target_is_not_built_before_the_seed(tiny_cfg):
    """A user's callback, or one of lit_dtrain's holding a user's ``_target_``, is built only where the run builds
    it, after the seed: its ``__init__`` may draw from the seeded generators."""
    from lit_dtrain._own_builds_check import own_nodes

    cfg = tiny_cfg("+callbacks.mine._target_=random.Random", "callbacks=[default,loss_spike]",
                   "+callbacks.loss_spike.path._target_=os.getcwd")
    targets = [node._target_ for node in own_nodes(cfg)]
    assert "random.Random" not in targets and "lit_dtrain.callbacks.LossSpikeMonitor" not in targets
    assert "lightning.pytorch.callbacks.TQDMProgressBar" not in targets
    assert "lit_dtrain.callbacks.ModelCheckpoint" in targets


def test_a_callback_argument_given_as_a_mapping_without_a_target_is_read_past(tiny_cfg):
    """Lightning's ``Timer(duration={minutes: 30})``, a valid callback, ended the run in a KeyError '_target_'
    traceback before the seed: the search for ``_target_`` indexed each mapping before asking whether it held one."""
    from lit_dtrain._own_builds_check import _targets, check_own_builds, own_nodes

    cfg = tiny_cfg("+callbacks.timer._target_=lightning.pytorch.callbacks.Timer",
                   "+callbacks.timer.duration={minutes:30}")
    check_own_builds(cfg)
    assert "lightning.pytorch.callbacks.Timer" not in [node._target_ for node in own_nodes(cfg)]
    assert _targets(cfg.callbacks.timer) == ["lightning.pytorch.callbacks.Timer"]
    assert _targets({"a": {"b": [{"_target_": "x.Y"}, {"c": 1}]}}) == ["x.Y"]


def test_a_good_runs_losses_are_those_it_had_without_the_early_builds(tiny_cfg, monkeypatch):
    """The early build of the callbacks changes nothing a run computes (it might through the config, which it must
    not alter, or state a class keeps): two steps' losses and the weights equal, bit for bit."""
    import lit_dtrain.train as train_module

    def losses(run):
        metrics, objs = train_module.train(tiny_cfg("callbacks=[default,loss_spike]", "trainer.max_steps=2",
                                                    "sample.max_new_tokens=0", run=run))
        return metrics["train_loss"], metrics["val_loss"], [p.detach().clone() for p in objs["module"].parameters()]

    with_builds = losses("with")
    monkeypatch.setattr(train_module, "check_own_builds", lambda cfg: None)
    without = losses("without")
    assert with_builds[:2] == without[:2]
    assert all(torch.equal(a, b) for a, b in zip(with_builds[2], without[2], strict=True))
