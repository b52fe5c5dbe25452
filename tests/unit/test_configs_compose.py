"""Every option of every config group, every experiment and sweep value composes and instantiates; shipped choices
pass the argument check."""

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import get_class, instantiate

from lit_dtrain.config_checks import check_config
from lit_dtrain.strategies.by_name import build_strategy
from lit_dtrain.train import ConfigError, build_callbacks
from tests.conftest import CONF_DIR, compose_cfg


def options(group: str) -> list[str]:
    root = Path(CONF_DIR) / group
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def check(cfg):
    check_config(cfg)
    model = instantiate(cfg.model)
    params = [p for p in model.parameters()]
    opt = instantiate(cfg.optimizer)([{"params": params}])
    if cfg.get("scheduler"):
        sched = instantiate(cfg.scheduler)(opt)
        assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    cbs = build_callbacks(cfg)
    assert all(isinstance(c, L.Callback) for c in cbs)
    strategy = build_strategy(cfg)
    logger = instantiate(cfg.logger) if cfg.logger else False
    trainer_kwargs = dict(callbacks=cbs, logger=logger, strategy=strategy)
    return instantiate(cfg.trainer, **trainer_kwargs)


@pytest.mark.parametrize("group", ["model", "optimizer", "scheduler", "callbacks", "trainer", "logger", "strategy"])
def test_every_option_composes_and_instantiates(group, tmp_path, corpus):
    opts = options(group)
    assert opts, group
    for opt in opts:
        if group == "trainer" and opt == "gpu" and not torch.cuda.is_available():
            continue
        overrides, tiny = [f"{group}={opt}"], True
        if group == "callbacks":
            overrides = [f"callbacks=[default,{opt}]"] if opt != "default" else []
        if group == "callbacks" and opt == "wsd":  # the callback form of WSD replaces the scheduler (README)
            overrides, tiny = ["~scheduler", *overrides, "trainer.max_steps=6", "trainer.accelerator=cpu"], False
        if group == "strategy" and opt == "fsdp":
            if not torch.cuda.is_available():
                continue  # FSDPStrategy needs CUDA devices (its config is checked below)
            overrides.append("trainer.accelerator=gpu")
        cfg = compose_cfg(overrides, tmp_path / group / opt.replace("/", "_"), corpus, tiny=tiny)
        trainer = check(cfg)
        assert isinstance(trainer, L.Trainer), (group, opt)


def test_fsdp_config_builds_a_module_wrap_policy_of_the_named_blocks(tmp_path, corpus):
    """conf/strategy/fsdp.yaml used to hand FSDPStrategy a ListConfig of classes, which it called as a policy at
    setup ("'ListConfig' object is not callable", seen on a GPU); make_fsdp gives it the set Lightning expects."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lit_dtrain.models import Block

    strategy = build_strategy(compose_cfg(["strategy=fsdp"], tmp_path / "fsdp", corpus))
    assert isinstance(strategy, FSDPStrategy)
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {Block}
    assert strategy._timeout.total_seconds() == 1800
    with pytest.raises(InstantiationException, match="wrap_modules must name at least one"):
        build_strategy(compose_cfg(["strategy=fsdp", "strategy.wrap_modules=[]"], tmp_path / "none", corpus))


def test_fsdp_on_a_cpu_is_refused_when_the_trainer_is_built(tmp_path, corpus):
    """Lightning refuses FSDP on a CPU only for its own class; make_fsdp's subclass got past that and failed in fit,
    after the ranks had started, with torch's traceback 'RuntimeError: FSDP needs a non-CPU accelerator device'."""
    from lit_dtrain.strategies import make_fsdp

    refusal = r"FSDP \(make_fsdp, strategy=fsdp\) shards the model over GPUs, but this Trainer runs on the CPU: on a "
    with pytest.raises(ConfigError, match=refusal):
        L.Trainer(accelerator="cpu", strategy=make_fsdp(wrap_modules=[torch.nn.Linear]), logger=False)
    with pytest.raises(ConfigError, match=refusal):  # strategy=fsdp: train.py prints it as one line, 'error: ...'
        L.Trainer(accelerator="cpu", strategy=build_strategy(compose_cfg(["strategy=fsdp"], tmp_path, corpus)))


def test_make_fsdp_takes_one_class_path_and_names_one_that_is_no_class_in_a_line(caplog):
    """wrap_modules='torch.nn.Linear' was read letter by letter ("Error loading 't'"), and a path that is no class
    gave Hydra's logged error and a 3-line ImportError (10 lines under train.py)."""
    from lit_dtrain.strategies import make_fsdp

    assert make_fsdp(wrap_modules="torch.nn.Linear").kwargs["auto_wrap_policy"]._module_classes == {torch.nn.Linear}
    for path, why in [("torch.nn.Linearr", "Are you sure that 'Linearr' is importable from module 'torch.nn'?"),
                      ("torch.nn.functional.relu", "a function")]:
        with pytest.raises(ConfigError) as e:
            make_fsdp(wrap_modules=[path])
        assert str(e.value) == (f"make_fsdp: wrap_modules entry {path!r} is not a class ({why}); give dotted class "
                                "paths, e.g. lit_dtrain.models.Block")
    assert caplog.records == []


@pytest.mark.parametrize("data", ["stdlib", "textfiles", "mixture"])
def test_data_options_instantiate(data, tmp_path, corpus):
    overrides = [f"data={data}"]
    if data == "textfiles":
        overrides.append(f"data.sources.0.paths=[{corpus}]")
    if data == "mixture":
        overrides.append(f"data.sources.1.paths=[{corpus}]")
    cfg = compose_cfg(overrides, tmp_path / data, None)
    dm = instantiate(cfg.data, _convert_="all")
    assert dm.block_size == cfg.model.block_size
    assert len(dm.sources) == (2 if data == "mixture" else 1)


def test_sampler_options_instantiate(tmp_path, corpus):
    """Each ``data/sampler`` option gives the datamodule a sampler of its ``_target_`` class holding every value its
    file sets (a null is resolved by the sampler); the class name's first four letters were all that was checked."""
    assert options("data/sampler") == ["fourier", "random"]
    for opt in options("data/sampler"):
        cfg = compose_cfg([f"data/sampler={opt}"], tmp_path / opt, corpus)
        dm = instantiate(cfg.data, _convert_="all")
        assert type(dm.sampler) is get_class(cfg.data.sampler._target_)
        written = {key: value for key, value in cfg.data.sampler.items() if key != "_target_" and value is not None}
        assert {key: getattr(dm.sampler, key) for key in written} == written, opt


def test_unknown_key_is_rejected(tmp_path, corpus):
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_cfg(["optimizer.lrr=1e-3"], tmp_path / "x", corpus)
    with pytest.raises(ConfigCompositionException, match="max_stepz"):
        compose_cfg(["trainer.max_stepz=3"], tmp_path / "x", corpus)


@pytest.mark.parametrize("group", ["strategy", "callbacks", "data/sampler", "optimizer", "scheduler", "trainer"])
def test_every_shipped_choice_passes_the_argument_check(group, tiny_cfg):
    """check_target_arguments refuses no value the configs ship, nor null or 'warn' where a parameter takes them."""
    from lit_dtrain.config_checks import check_target_arguments

    conf = Path(__file__).resolve().parents[2] / "conf" / group
    names = sorted(str(p.relative_to(conf).with_suffix("")) for p in conf.rglob("*.yaml"))
    assert names
    for name in names:
        choice = f"callbacks=[default,{name}]" if group == "callbacks" else f"{group}={name}"
        check_target_arguments(tiny_cfg(*choice.split(" ")))
    check_target_arguments(tiny_cfg("trainer.deterministic=warn", "optimizer.fused=null", "optimizer.fused=true"))


def test_a_target_without_a_signature_is_left_to_its_call():
    """check_target_keys follows a target's signature; a builtin without one (getattr) is not an error of the check."""
    from omegaconf import OmegaConf

    from lit_dtrain.config_checks import check_target_arguments

    check_target_arguments(OmegaConf.create({"x": {"_target_": "builtins.getattr", "_args_": [1, "real"]}}))
    with pytest.raises(ConfigError, match=r"^x.lagg is not an argument of .*FourierSampler; did you mean 'x.lag'\?"):
        check_target_arguments(OmegaConf.create({"x": {"_target_": "lit_dtrain.data.samplers.FourierSampler",
                                                       "lagg": 1}}))


def test_lightning_choices_that_are_valid_pass(tiny_cfg):
    gpu = ("trainer.precision=16-mixed trainer.accelerator=gpu",) if torch.cuda.is_available() else ()
    gpu_devices = ("trainer.devices=-1", "trainer.devices=[0,1]", "trainer.devices='0,1'") \
        if torch.cuda.is_available() else ()  # device ids and -1 (all): a GPU's; on a CPU, refused (a count only)
    for override in (*gpu, "trainer.precision=bf16-mixed",
                     "trainer.precision=32", "trainer.precision=64-true", "trainer.precision=bf16-true",
                     "trainer.precision=16-true optimizer.eps=1e-4",
                     "trainer.gradient_clip_algorithm=value", "trainer.gradient_clip_algorithm=null",
                     "callbacks.model_checkpoint.mode=max", "callbacks.lr_monitor.logging_interval=epoch",
                     "callbacks.lr_monitor.logging_interval=null", "trainer.devices=auto", *gpu_devices,
                     "trainer.devices=2", "trainer.accelerator=cpu trainer.devices='2'", "+trainer.overfit_batches=2",
                     "+trainer.overfit_batches=0", "+trainer.overfit_batches=3.0",
                     "paths.checkpoint_dir=/elsewhere/ck/ callbacks.preemption.dirpath=/elsewhere/ck",
                     "strategy=ddp +strategy.find_unused_parameters=true", "strategy=ddp_compressed/int8_rs "
                     "+strategy.static_graph=true strategy.compressor.block_size=64"):
        check_config(tiny_cfg(*override.split(" ")))


def test_the_default_callbacks_pass_without_an_error_logged(tiny_cfg, caplog):
    """Every train.py run logged '[hydra.utils][ERROR] - Error getting class at
    lit_dtrain.callbacks.token_throughput_monitor: Located non-class of type 'function'' from the callbacks' check."""
    caplog.set_level(logging.DEBUG)
    check_config(tiny_cfg())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_validation_limits_that_validate_something_pass(tiny_cfg):
    for value in ("null", "1", "3", "0.5", "1.0"):
        check_config(tiny_cfg(f"trainer.limit_val_batches={value}"))


def test_sample_top_k_zero_and_null_are_valid(tiny_cfg):
    """sample.top_k=0 means all tokens (as scripts/generate.py --top-k 0); it used to crash after training."""
    for override in ("sample.top_k=0", "sample.top_k=null", "sample.temperature=0", "sample.max_new_tokens=0",
                     "sample.top_p=0.9", "sample.top_p=1", "sample.top_p=null"):
        check_config(tiny_cfg(override))


def test_checkpoint_monitors_that_lit_dtrain_logs_are_valid(tiny_cfg, tmp_path, corpus):
    # fourier/mix: another family, left to Lightning
    for metric in ("val/loss", "val/ppl", "train/loss", "train/grad_norm", "fourier/mix"):
        check_config(tiny_cfg(f"callbacks.model_checkpoint.monitor={metric}"))
    mixture = compose_cfg(["data=mixture", f"data.sources.1.paths=[{corpus}]",
                           "callbacks.model_checkpoint.monitor=val/text/loss"], tmp_path / "m", None)
    check_config(mixture)
    with pytest.raises(ConfigError, match="val/text/los"):
        check_config(compose_cfg(["data=mixture", f"data.sources.1.paths=[{corpus}]",
                                  "callbacks.model_checkpoint.monitor=val/text/los"], tmp_path / "m", None))


def test_default_warmup_scales_with_short_runs(tmp_path, corpus):
    from lit_dtrain.config_resolvers import default_warmup

    assert [default_warmup(n) for n in (1, 10, 500, 1000, 5000)] == [1, 1, 50, 100, 100]
    cfg = compose_cfg(["trainer.max_steps=10"], tmp_path / "w", corpus, tiny=False)
    assert cfg.scheduler.warmup_steps == 1
    check_config(cfg)  # a 10-step run is valid without touching the warmup


def test_every_sweep_value_of_every_experiment_composes(tmp_path):
    """A multirun composes each job only when it starts: a typo in a sweep value would fail mid-sweep."""
    from omegaconf import OmegaConf

    checked = 0
    for name in options("experiment"):
        params = OmegaConf.load(Path(CONF_DIR) / "experiment" / f"{name}.yaml").get("hydra", {})
        params = params.get("sweeper", {}).get("params", {})
        for key, values in params.items():
            for value in str(values).split(","):
                cfg = compose_cfg([f"experiment={name}", f"{key}={value.strip()}"], tmp_path / name, None, tiny=False)
                check_config(cfg)
                if key == "strategy":  # the group option named by the value is the one built
                    strategy = build_strategy(cfg)
                    assert type(strategy).__name__ == "CompressedDDPStrategy", value
                    want = value.strip().split("/")[-1]
                    lu = getattr(strategy, "local_update", None)
                    built = lu.name if lu is not None else strategy.compressor.name
                    assert built == want, value
                elif "." in key:  # a plain value lands at its key
                    assert OmegaConf.select(cfg, key) == pytest.approx(float(value)), (key, value)
                else:  # a config group: its option's target
                    assert cfg[key]["_target_"].endswith(f"{value.strip()}_scheduler"), (key, value)
                checked += 1
    assert checked >= 10  # wsd_vs_cosine's 5 values and compression_sweep's 5


def test_every_experiment_composes(tmp_path, corpus):
    for name in options("experiment"):
        cfg = compose_cfg([f"experiment={name}"], tmp_path / name, None, tiny=False)
        check_config(cfg)
        model = instantiate(cfg.model)
        assert isinstance(model, torch.nn.Module) and sum(p.numel() for p in model.parameters()) > 0
        optimizer = instantiate(cfg.optimizer)(model.parameters())
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr)


@pytest.mark.parametrize("group", ["scheduler", "strategy", "logger", "data/sampler"])
def test_an_empty_list_of_a_group_that_may_be_left_out_composes_as_the_group_left_out(group, tmp_path):
    """docs/running.md: ``scheduler=[]`` (Hydra's list of options, here none) trains as ``~scheduler`` does; only a
    group lit_dtrain needs (``optimizer=[]``) or a value that names no option (``scheduler=null``) is refused."""
    from omegaconf import OmegaConf

    empty, left_out, default = (OmegaConf.to_container(compose_cfg(overrides, tmp_path / "run", tiny=False))
                                for overrides in ([f"{group}=[]"], [f"~{group}"], []))
    assert empty == left_out != default


@pytest.mark.parametrize("override, key", [
    ("+trainer.max_time={seconds:${nope}}", "trainer.max_time.seconds"),
    ("trainer.max_steps=${nope}", "trainer.max_steps"),
    # read by a check with node.get(), where OmegaConf names no key: 'Interpolation key 'nope' not found' alone
    ("trainer.precision=${nope}", "trainer.precision"),
    ("callbacks.lr_monitor.logging_interval=${nope}", "callbacks.lr_monitor.logging_interval"),
])
def test_an_interpolation_naming_no_key_is_one_line_naming_the_key(tmp_path, corpus, override, key):
    """`'+trainer.max_time={seconds:${nope}}'` (also in a sweep's jobs) and `trainer.max_steps=${nope}` failed in
    OmegaConf's traceback, 'InterpolationKeyError: Interpolation key 'nope' not found', inside the config checks."""
    from lit_dtrain.train import train

    cfg = compose_cfg([override], tmp_path / "r", corpus_dir=corpus)
    with pytest.raises(ConfigError) as refused:
        train(cfg)
    assert str(refused.value) == (f"{key}: interpolation key 'nope' not found: an interpolation names a key the "
                                  f"config does not hold; fix it, or give {key} a value")


@pytest.mark.parametrize("override, key, hint", [
    ("optimizer.lr=${oc.evn:HOME}", "optimizer.lr", "did you mean oc.env?"),
    ("trainer.max_steps=${nopefn:1}", "trainer.max_steps",
     "fix its name, or register it before train() checks the config (resolvers here: oc.env, "),
    # node.get(): 'Unsupported interpolation type oc.evn' alone, neither the key nor the hint
    ("callbacks.lr_monitor.logging_interval=${oc.evn:X}", "callbacks.lr_monitor.logging_interval",
     "did you mean oc.env?"),
])
def test_an_interpolation_naming_no_resolver_is_one_line_naming_the_key(tmp_path, corpus, override, key, hint):
    """A resolver's name mistyped ('optimizer.lr=${oc.evn:HOME}') failed in Hydra's traceback ending
    'omegaconf.errors.UnsupportedInterpolationType: Unsupported interpolation type oc.evn', from the config checks."""
    from lit_dtrain.train import train

    cfg = compose_cfg([override], tmp_path / "r", corpus_dir=corpus)
    with pytest.raises(ConfigError) as refused:
        train(cfg)
    name = override.partition("${")[2].partition(":")[0]
    assert str(refused.value).startswith(f"{key}: unsupported interpolation type {name}: no resolver has that name; "
                                         f"{hint}")


def test_a_mistyped_resolver_of_the_users_own_is_named_in_the_hint(tmp_path, corpus):
    """A resolver the user's code registered, mistyped ('${my.scal:2}' for my.scale), got a hint that left it out:
    'fix its name (resolvers here: oc.env, ..., lit.launch_run_name)', as if there were no my.scale."""
    from omegaconf import OmegaConf

    from lit_dtrain.train import train

    OmegaConf.register_new_resolver("my.scale", lambda x: 2 * x)
    try:
        cfg = compose_cfg(["optimizer.lr=${my.scal:2}"], tmp_path / "r", corpus_dir=corpus)
        with pytest.raises(ConfigError) as refused:
            train(cfg)
    finally:
        OmegaConf.clear_resolver("my.scale")
    assert str(refused.value) == ("optimizer.lr: unsupported interpolation type my.scal: no resolver has that name; "
                                  "did you mean my.scale?")
