"""Every option of every config group composes and instantiates; bad configs fail before compute."""

import logging
import math
import re
from datetime import datetime
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate

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
    for opt in options("data/sampler"):
        cfg = compose_cfg([f"data/sampler={opt}"], tmp_path / opt, corpus)
        dm = instantiate(cfg.data, _convert_="all")
        assert dm.sampler.__class__.__name__.lower().startswith(opt.split("_")[0][:4])


def test_unknown_key_is_rejected(tmp_path, corpus):
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_cfg(["optimizer.lrr=1e-3"], tmp_path / "x", corpus)
    with pytest.raises(ConfigCompositionException, match="max_stepz"):
        compose_cfg(["trainer.max_stepz=3"], tmp_path / "x", corpus)


@pytest.mark.parametrize(
    "override, match",
    [
        ("optimizer.lr=-1e-3", "optimizer.lr"),
        ("data.block_size=64", "data.block_size=64 exceeds model.block_size=32"),
        ("scheduler.warmup_steps=100", "warmup_steps"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("resume=sometimes", "resume"),
        ("ckpt_path=/nonexistent.ckpt", "ckpt_path"),
        ("trainer.max_steps=abc", r"trainer.max_steps must be an integer, got 'abc' \(str\)"),
        ("optimizer.lr=3e-3x", r"optimizer.lr must be a number, got '3e-3x'"),
        ("data.batch_size=1.5", "data.batch_size must be an integer, got 1.5"),
        ("trainer.val_check_interval=0.5", "trainer.val_check_interval=0.5 is a fraction of an epoch"),
        ("model.d_model=abc", r"model.d_model must be an integer, got 'abc' \(str\)"),
        ("optimizer.weight_decay=abc", r"optimizer.weight_decay must be a number, got 'abc'"),
        ("data.val_fraction=abc", r"data.val_fraction must be a number, got 'abc'"),
        ("data.val_fraction=1", r"data.val_fraction must be in \(0, 1\) \(the share of documents held out\), got 1"),
        ("data.val_fraction=0", r"data.val_fraction must be in \(0, 1\)"),
        ("data.max_val_windows=abc", r"data.max_val_windows must be an integer, got 'abc'"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval must be a positive integer, got 0"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches must be a positive integer, got 0"),
        # Lightning's seed_everything: 'ValueError: -1 is not in bounds, numpy accepts from 0 to 4294967295'
        ("seed=-1", r"seed must be an integer in \[0, 4294967295\] \(numpy's range\), got -1"),
        ("seed=4294967296", r"seed must be an integer in \[0, 4294967295\]"),
        # a RuntimeError from WSDScheduler.on_train_start, inside fit, after the corpus was tokenized
        ("callbacks=[default,wsd]",
         r"callbacks.wsd sets the LR itself, and scheduler=\S+ configures an LR scheduler too; .*'~scheduler'"),
        # a non-empty string is truthy: compile=off compiled, check_finite=no kept the check on
        ("module.compile=off", r"module.compile must be true or false, got 'off' \(str\)"),
        ("module.check_finite=no", r"module.check_finite must be true or false, got 'no' \(str\)"),
        ("model.tie_embeddings=0", r"model.tie_embeddings must be true or false, got 0 \(int\)"),
        # the same for the flags of every _target_ node (read with bool(value) or `if value:`)
        ("strategy=ddp_compressed/int8 strategy.compressor.error_feedback=no",
         r"strategy.compressor.error_feedback must be true or false, got 'no' \(str\)"),
        ("callbacks=[default,loss_spike] callbacks.loss_spike.check_grad=off",
         r"callbacks.loss_spike.check_grad must be true or false, got 'off' \(str\)"),
        ("data/sampler=fourier data.sampler.stages=maybe", r"data.sampler.stages must be true or false, got 'maybe'"),
        ("strategy=ddp_compressed/diloco strategy.local_update.nesterov=yes",
         r"strategy.local_update.nesterov must be true or false, got 'yes'"),
        ("optimizer.fused=maybe", r"optimizer.fused must be true or false or null, got 'maybe'"),
        ("trainer.deterministic=maybe", r"trainer.deterministic must be true or false or null or 'warn', got 'maybe'"),
        # and a string where a number belongs: "'<' not supported between instances of 'float' and 'str'"
        ("data/sampler=fourier data.sampler.min_prob=abc", r"data.sampler.min_prob must be a number, got 'abc'"),
        ("callbacks.model_checkpoint.save_top_k=abc",
         r"callbacks.model_checkpoint.save_top_k must be an integer, got 'abc' \(str\)"),
        # null, a bool or a fraction where an int belongs: int(value) in the constructor trained data.seed=1.5 and
        # data.seed=true as seed 1, silently; data.seed=null failed in Hydra's wrapper naming only 'full_key: data'
        ("data.seed=null", r"data.seed must be an integer, got None \(NoneType\)"),
        ("data.seed=1.5", r"data.seed must be an integer, got 1.5 \(float\)"),
        ("data.seed=true", r"data.seed must be an integer, got True \(bool\)"),
        ("data.seed=abc", r"data.seed must be an integer, got 'abc' \(str\)"),
        ("data/sampler=fourier data.sampler.max_freq=2.5",
         r"data.sampler.max_freq must be an integer or null, got 2.5 \(float\)"),
        ("data/sampler=fourier data.sampler.min_prob=true",
         r"data.sampler.min_prob must be a number, got True \(bool\)"),
        ("trainer.num_nodes=null", r"trainer.num_nodes must be an integer, got None"),
        ("seed=null", r"seed must be an integer in \[0, 4294967295\] \(numpy's range\), got None"),
        # lr=inf made the first update inf; the run stopped at step 1 with a NonFiniteError that blamed the
        # gradients and said the weights were still finite
        ("optimizer.lr=inf", r"optimizer.lr must be a finite number, got inf"),
        ("optimizer.weight_decay=inf", r"optimizer.weight_decay must be a finite number, got inf"),
        ("model.rope_theta=inf", r"model.rope_theta must be a finite number, got inf"),
        ("model.init_std=nan", r"model.init_std must be a finite number, got nan"),
        ("optimizer.eps=nan", r"optimizer.eps must be a finite number, got nan"),
        ("model.norm_eps=inf", r"model.norm_eps must be a finite number, got inf"),
        # the optimizer is built in configure_optimizers, inside fit: these were TypeErrors there
        ("optimizer.lr=null", r"optimizer.lr must be > 0, got None"),
        ("optimizer.betas=[0.9,abc]", r"optimizer.betas must be two numbers in \[0, 1\), got \[0.9, 'abc'\]"),
        ("optimizer.betas=0.9", r"optimizer.betas must be two numbers in \[0, 1\), got 0.9"),
        ("optimizer.betas=[0.9,1.5]", r"optimizer.betas must be two numbers in \[0, 1\), got \[0.9, 1.5\]"),
        ("optimizer.eps=-1", r"optimizer: Invalid epsilon value: -1"),
        # cosine and wsd refuse warmup > total_steps; constant trained without ever reaching optimizer.lr
        ("scheduler=constant scheduler.warmup_steps=10",
         r"scheduler.warmup_steps=10 exceeds trainer.max_steps=6: the LR would never reach optimizer.lr"),
        # torch only warns that the call 'has no effect'
        ("matmul_precision=hihg", r"matmul_precision must be one of 'highest', 'high', 'medium', got 'hihg'"),
        # Lightning skips clipping for a value <= 0: -1 trained unclipped, silently
        ("trainer.gradient_clip_val=-1", r"trainer.gradient_clip_val must be >= 0 \(null or 0: no clipping\), got -1"),
        # an IndexError from the embedding at the first training step
        ("model.vocab_size=100", r"model.vocab_size=100 is below the tokenizer's 257 token ids \(byte tokenizer"),
        # a MisconfigurationException at the first validation, after val_check_interval steps, with no checkpoint
        ("callbacks.model_checkpoint.monitor=val/los",
         r"callbacks.model_checkpoint.monitor='val/los' is not a metric lit_dtrain logs; .*'val/loss', 'val/ppl'"),
        ("callbacks.model_checkpoint.monitor=val_loss", r"callbacks.model_checkpoint.monitor='val_loss' is not"),
        # refused by Lightning when the Trainer or callback is built, in Hydra's wrapper: 'Error in call to target
        # lightning.pytorch.trainer.trainer.Trainer ... full_key: trainer', not naming the key
        ("trainer.precision=fp16", r"trainer.precision='fp16' is not one of Lightning's precisions: .*'bf16-mixed'"),
        # Lightning trained these in bf16-mixed on a CPU, with only a warning among the start-up lines
        ("trainer.precision=16-mixed trainer.accelerator=cpu",
         r"trainer.precision=16-mixed \(fp16 autocast with loss scaling\) does not run on CPU "
         r"\(trainer.accelerator=cpu\): Lightning would train in bf16-mixed instead"),
        ("trainer.precision=16 trainer.accelerator=cpu",
         r"trainer.precision=16 \(fp16 autocast .* does not run on CPU"),
        # AdamW's fp16 second moments underflow to 0 and updates are g / eps: weights 1 -> 105 in a step, NaN at step 3
        ("trainer.precision=16-true",
         r"trainer.precision=16-true keeps the optimizer's second moments in fp16, where optimizer.eps=1e-08 is below"),
        ("trainer.precision=16-true optimizer=adamw8bit", r"trainer.precision=16-true .* optimizer.eps=1e-08"),
        # bitsandbytes updates in fp32: every weight of a 64-true run was an fp32 value after each step, silently
        ("trainer.precision=64-true optimizer=adamw8bit",
         r"trainer.precision=64-true cannot be combined with optimizer=adamw8bit: bitsandbytes computes the update in "
         r"fp32 .* train in float64 with optimizer=adamw"),
        # a ModuleNotFoundError from inside the Trainer's construction
        ("trainer.precision=transformer-engine",
         r"trainer.precision=transformer-engine needs NVIDIA's transformer_engine package, which is not installed"),
        ("trainer.gradient_clip_algorithm=nrm",
         r"trainer.gradient_clip_algorithm='nrm' must be one of 'value', 'norm'"),
        # Lightning's MisconfigurationException in Hydra's wrapper, naming only full_key: callbacks.lr_monitor
        ("callbacks.lr_monitor.logging_interval=abc",
         r"callbacks.lr_monitor.logging_interval='abc' must be 'step' \(the LR of every logged step\), 'epoch' "),
        ("callbacks.lr_monitor.logging_interval=0", r"callbacks.lr_monitor.logging_interval=0 must be 'step'"),
        ("callbacks.model_checkpoint.mode=minimum",
         r"callbacks.model_checkpoint.mode='minimum' must be 'min' or 'max' \(whether a lower or a higher val/loss"),
        *([] if torch.cuda.is_available() else [  # Lightning's 'No supported gpu backend found!' in Hydra's wrapper
            ("trainer.accelerator=gpu",
             r"trainer.accelerator=gpu \(trainer=gpu\), but torch .* finds no CUDA GPU: on this machine use "
             r"trainer=cpu \(or trainer=ddp_cpu\)"),
            ("trainer.accelerator=cuda", r"trainer.accelerator=cuda \(trainer=gpu\), but torch")]),
        ("trainer.devices=0", r"trainer.devices=0 must be a number of devices >= 1, -1 \(all\), 'auto' or a list of"),
        ("trainer.devices=[]", r"trainer.devices=\[\] must be a number of devices >= 1"),
        ("trainer.devices=-2", r"trainer.devices=-2 must be a number of devices >= 1"),
        # Lightning's TypeError('`devices` selected with `CPUAccelerator` should be an int > 0.') in Hydra's wrapper
        ("trainer.accelerator=cpu trainer.devices=-1",
         r"trainer.devices=-1 does not run on a CPU \(trainer.accelerator=cpu\), where it is a number of processes "
         r">= 1: use trainer.devices=1 \(or 'auto'\), or trainer=ddp_cpu trainer.devices=N for N processes"),
        ("trainer.accelerator=cpu trainer.devices=null", r"trainer.devices=None does not run on a CPU"),
        ("trainer.accelerator=cpu trainer.devices=[0,1]", r"trainer.devices=\[0, 1\] does not run on a CPU"),
        *([] if torch.cuda.is_available() or torch.backends.mps.is_available() else [
            ("trainer.accelerator=auto trainer.devices=-1",
             r"trainer.devices=-1 does not run on a CPU \(trainer.accelerator=auto, and no GPU here\)")]),
        # the end-of-run sample used to crash after training (before summary.json was written)
        ("sample.top_k=-3", r"sample.top_k must be an integer >= 0 \(0: all tokens\), got -3"),
        ("sample.top_k=abc", r"sample.top_k must be an integer >= 0 \(0: all tokens\), got 'abc'"),
        ("sample.temperature=abc", r"sample.temperature must be a finite number >= 0 \(0: greedy\), got 'abc'"),
        ("sample.temperature=-1", r"sample.temperature must be a finite number >= 0 \(0: greedy\), got -1"),
        # passed, while generate.py --temperature inf was refused: every logit / inf is 0, a uniform draw ignoring top_k
        ("sample.temperature=inf", r"sample.temperature must be a finite number >= 0 \(0: greedy\), got inf"),
        ("sample.temperature=nan", r"sample.temperature must be a finite number >= 0 \(0: greedy\), got nan"),
        ("sample.max_new_tokens=1.5", r"sample.max_new_tokens must be an integer >= 0, got 1.5"),
        ("sample.max_new_tokens=-5", r"sample.max_new_tokens must be an integer >= 0, got -5"),
        # Lightning switches validation off: no checkpoint before the end, and a NaN val_loss (summary.json: null)
        (
            "trainer.limit_val_batches=0",
            r"trainer.limit_val_batches=0 switches validation off, .*checkpoints.*val_loss.*"
            r"trainer.val_check_interval >= trainer.max_steps",
        ),
        ("trainer.limit_val_batches=0.0", r"trainer.limit_val_batches=0.0 switches validation off"),
        # Lightning's 'invalid value -1 for limit_val_batches', in Hydra's wrapper; 'abc' was a TypeError there
        (
            "trainer.limit_val_batches=-1",
            r"trainer.limit_val_batches must be null \(all\), a number of batches >= 1 or a fraction in "
            r"\(0, 1\], got -1",
        ),
        ("trainer.limit_val_batches=1.5", r"trainer.limit_val_batches must be null \(all\), .* got 1.5"),
        ("trainer.limit_val_batches=abc", r"trainer.limit_val_batches must be null \(all\), .* got 'abc'"),
        # a nested config group set with a dot: the datamodule's AttributeError ('str' object has no attribute
        # 'min_block_size'), in Hydra's wrapper naming only 'full_key: data'
        ("data.sampler=fourier", r"data.sampler='fourier' sets the key to a string, not a sampler config: pick a "
                                 r"sampler with the config group data/sampler=fourier"),
        # a key added with '+' that the target takes no argument for: a strategy's failed only in fit, after the
        # token cache was built, as DistributedDataParallel's TypeError naming neither strategy nor the key
        ("strategy=ddp_compressed +strategy.compresion=int8",
         r"^strategy.compresion is not an argument of lit_dtrain.strategies.CompressedDDPStrategy; did you mean "
         r"'strategy.compressor'\?$"),
        ("strategy=ddp +strategy.find_unused_paramters=true",  # make_ddp's **kwargs, followed to DDP's arguments
         r"^strategy.find_unused_paramters is not an argument of .*make_ddp; did you mean "
         r"'strategy.find_unused_parameters'\?$"),
        # a codec or local-update rule given as a mapping (or a name): the codec class's TypeError in Hydra's wrapper
        ("strategy=ddp_compressed/topk ~strategy.compressor +strategy.compressor={name:topk,ratoi:0.01}",
         r"^strategy.compressor.ratoi is not an argument of the compressor 'topk' \(TopK\); did you mean "
         r"'strategy.compressor.ratio'\?$"),
        ("strategy=ddp_compressed/int8 +strategy.compressor={name:topk,ratio:0.01}",  # merged into int8's node
         r"^strategy.compressor holds the preset's _target_ \(lit_dtrain.strategies.BlockQuantizer\) and a name "
         r"\('topk'\): .* '~strategy.compressor' '\+strategy.compressor=\{name: topk, ...\}', or "
         r"strategy.compressor=topk$"),
        ("strategy=ddp_compressed/topk ~strategy.compressor +strategy.compressor={name:topk,error_feedback:no}",
         r"^strategy.compressor.error_feedback must be true or false, got 'no' \(str\)$"),  # trained with it on
        ("strategy=ddp_compressed/topk strategy.compressor=topkk",
         r"^strategy.compressor: unknown compressor 'topkk'; expected one of \[.*\]; did you mean 'topk'\?$"),
        ("strategy=ddp_compressed/int8 ~strategy.compressor +strategy.compressor={name:int8,bits:4}",
         r"^strategy.compressor.bits: the compressor 'int8' sets bits=8 itself$"),
        ("strategy=ddp_compressed/diloco +strategy.local_update.compressor={name:int8,block_sise:64}",
         r"^strategy.local_update.compressor.block_sise is not an argument .*'strategy.local_update.compressor"
         r".block_size'\?$"),
        ("strategy=ddp_compressed/local_sgd ~strategy.local_update +strategy.local_update={name:diloco,sync_perod:4}",
         r"^strategy.local_update.sync_perod is not an argument of the local-update rule 'diloco' \(DiLoCo\); "
         r"did you mean 'strategy.local_update.sync_period'\?$"),
        ("data/sampler=fourier +data.sampler.lagg=1", r"^data.sampler.lagg is not an argument of .*FourierSampler; "
                                                      r"did you mean 'data.sampler.lag'\?$"),
        # the callback saved there, the end of the run and resume=auto used paths.checkpoint_dir: a run killed after
        # its step-6 checkpoint resumed from nothing (trained from step 0 again, exit 0)
        ("callbacks.model_checkpoint.dirpath=/elsewhere/ck",
         r"^callbacks.model_checkpoint.dirpath='/elsewhere/ck' is not paths.checkpoint_dir=.* set "
         r"paths.checkpoint_dir='/elsewhere/ck' instead"),
        ("callbacks.preemption.dirpath=/elsewhere/ck", r"^callbacks.preemption.dirpath='/elsewhere/ck' is not "),
        # Lightning's 'MisconfigurationException: When using an IterableDataset, Trainer(limit_train_batches) must
        # be 1.0 or an int' in Hydra's traceback, naming a key the user did not set
        ("+trainer.overfit_batches=0.5", r"^trainer.overfit_batches=0.5 must be a whole number of batches .* "
                                         r"has no length, so a fraction of it cannot be taken$"),
        ("+trainer.overfit_batches=1.0", r"^trainer.overfit_batches=1.0 must be a whole number"),  # int(1.0): 1 batch
        ("+trainer.overfit_batches=-1", r"^trainer.overfit_batches=-1 must be a whole number"),
        ("+callbacks.model_checkpoint.save_topk=2",
         r"^callbacks.model_checkpoint.save_topk is not an argument of .*ModelCheckpoint; did you mean "
         r"'callbacks.model_checkpoint.save_top_k'"),
    ],
)
def test_bad_values_fail_before_compute(override, match, tiny_cfg):
    from lit_dtrain.train import resolve_ckpt_path

    cfg = tiny_cfg(*override.split(" "))
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)
        resolve_ckpt_path(cfg)


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
    for override in ("sample.top_k=0", "sample.top_k=null", "sample.temperature=0", "sample.max_new_tokens=0"):
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


def test_sweeps_started_in_the_same_second_get_their_own_dirs(monkeypatch, tmp_path):
    """Two `python train.py -m ...` started in the same second (one per GPU from a script, a SLURM array) used to
    resolve the same outputs/multiruns/<time>, so their job 0, 1, ... wrote into each other's dirs."""
    import time

    from hydra import compose, initialize_config_dir

    monkeypatch.delenv("LIT_DTRAIN_SWEEP_DIR", raising=False)
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path))

    def sweep_dir() -> tuple[str, int]:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="train", return_hydra_config=True)
            return str(cfg.hydra.sweep.dir), int(time.time())

    for _ in range(5):  # two composes a few ms apart, in the same wall-clock second
        (a, sa), (b, sb) = sweep_dir(), sweep_dir()
        if sa == sb:
            break
    assert sa == sb
    assert a.startswith(str(tmp_path / "multiruns")) and a != b


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_output_or_cache_variable_means_the_default_dir(monkeypatch, empty):
    """LIT_DTRAIN_OUTPUT= (set, but empty) put the run dirs at the filesystem's root (/runs/<name>) and
    LIT_DTRAIN_CACHE= the token caches in the working dir; an empty one now reads as unset (as XDG_* are read)."""
    from hydra import compose, initialize_config_dir

    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", empty)
    monkeypatch.setenv("LIT_DTRAIN_CACHE", empty)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["run_name=r"], return_hydra_config=True)
        assert (cfg.paths.log_dir, cfg.paths.cache_dir, cfg.data.cache_dir) == ("outputs", "~/.cache/lit_dtrain",
                                                                                 "~/.cache/lit_dtrain")
        assert cfg.hydra.run.dir == "outputs/runs/r" and cfg.hydra.sweep.dir.startswith("outputs/multiruns/")
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", "/data/out")
    monkeypatch.setenv("LIT_DTRAIN_CACHE", "/data/cache")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["run_name=r"], return_hydra_config=True)
        assert (cfg.hydra.run.dir, cfg.data.cache_dir) == ("/data/out/runs/r", "/data/cache")


@pytest.mark.parametrize("strategy", ["ddp", "ddp_compressed/int8", "ddp_compressed/diloco"])
@pytest.mark.parametrize("value, shown", [("-1", "-1"), ("0", "0"), ("abc", "'abc'")])
def test_collective_timeout_must_be_a_positive_number(strategy, value, shown, tmp_path, corpus):
    """strategy.collective_timeout_s=-1 used to reach torch's TCPStore ('The client socket has timed out after
    -1000ms'), 0 made every collective time out at once, and 'abc' was 'could not convert string to float'."""
    cfg = compose_cfg([f"strategy={strategy}", f"strategy.collective_timeout_s={value}"], tmp_path / "t", corpus)
    message = rf"strategy.collective_timeout_s must be a number of seconds > 0, got {shown}"
    with pytest.raises((ValueError, InstantiationException), match=message):  # Hydra wraps it, keeping the text
        build_strategy(cfg)
    ok = compose_cfg([f"strategy={strategy}", "strategy.collective_timeout_s=8"], tmp_path / "t", corpus)
    assert build_strategy(ok)._timeout.total_seconds() == 8


def test_a_checkpoint_past_max_steps_is_refused(tiny_cfg, tmp_path):
    """ckpt_path/resume=auto of a run at step 9 with trainer.max_steps=3 trained nothing, exited 0, reported
    steps=9 and logged 'the checkpoint is already at step 9 = trainer.max_steps'. At max_steps it stays the
    documented validate-only resume of a finished run."""
    from lit_dtrain.train import check_start_step

    cfg = tiny_cfg("trainer.max_steps=3")
    with pytest.raises(ConfigError, match=r"is at step 9, past trainer.max_steps=3; .*trainer.max_steps >= 9"):
        check_start_step(cfg, 9, "run/checkpoints/last.ckpt")
    check_start_step(cfg, 3, "run/checkpoints/last.ckpt")  # a finished run: validated only
    check_start_step(cfg, 0, None)


def test_resume_auto_without_a_run_name_is_refused(tmp_path, corpus):
    """`python train.py resume=auto` (no run_name) resolved run_name to a new timestamp, so it never found the run
    to continue and silently started a fresh one in a new dir; an explicit run_name without checkpoints still
    starts fresh (README: 'picks up last.ckpt of that run dir, if any')."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "runs" / str(cfg.run_name))  # as conf/hydra puts a single run
        cfg.paths.checkpoint_dir = str(tmp_path / "runs" / str(cfg.run_name) / "checkpoints")
    with pytest.raises(ConfigError, match=r"resume=auto needs run_name=<the run to continue>"):
        resolve_ckpt_path(cfg)
    named = compose_cfg(["resume=auto", "run_name=exp1"], tmp_path / "x", corpus)
    with open_dict(named):
        named.paths.output_dir = str(tmp_path / "runs" / "exp1")
        named.paths.checkpoint_dir = str(tmp_path / "runs" / "exp1" / "checkpoints")
    assert resolve_ckpt_path(named) is None  # a fresh start of the named run
    # a run_name given on the command line that looks like the default timestamp (continuing a default-named run
    # killed before its first checkpoint) is a name like any other: it was refused as if no run_name were given
    stamp = "2026-12-03_19-45-00"
    given = compose_cfg(["resume=auto", f"run_name={stamp}"], tmp_path / "x", corpus)
    with open_dict(given):
        given.paths.output_dir = str(tmp_path / "runs" / stamp)
        given.paths.checkpoint_dir = str(tmp_path / "runs" / stamp / "checkpoints")
    assert resolve_ckpt_path(given) is None


def test_a_checkpoint_key_naming_a_directory_says_so(tiny_cfg, tmp_path):
    """ckpt_path=<run>/checkpoints (the dir, not the file) was reported as 'does not exist'."""
    from lit_dtrain.schedules.workflows import apply_decay_branch, check_init_from
    from lit_dtrain.train import resolve_ckpt_path

    d = tmp_path / "somerun" / "checkpoints"
    d.mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"ckpt_path='{d}' is a directory; give a checkpoint file"):
        resolve_ckpt_path(tiny_cfg(f"ckpt_path={d}"))
    with pytest.raises(ConfigError, match=rf"init_from='{d}' is a directory; give a checkpoint file"):
        check_init_from(tiny_cfg(f"init_from={d}"))
    with pytest.raises(ConfigError, match=rf"decay_branch.ckpt='{d}' is a directory; give a checkpoint file"):
        apply_decay_branch(tiny_cfg(f"decay_branch.ckpt={d}", "decay_branch.steps=2"))



def test_a_directory_named_last_ckpt_in_the_run_dir_is_refused_before_training(tiny_cfg):
    """A directory `checkpoints/last.ckpt` beside a step checkpoint: resume=auto passed it over as unreadable, resumed
    the step file, trained, and failed at its first save ('could not write checkpoint .../last.ckpt: Is a directory;
    the previous file at that path is intact'); a fresh start was told to resume=auto. Both are refused before any
    training now, naming the directory."""
    from lit_dtrain.train import resolve_ckpt_path

    for overrides in (["resume=auto", "run_name=exp1"], []):
        cfg = tiny_cfg(*overrides)
        last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
        last.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": 2}, last.parent / "step000002.ckpt")
        with pytest.raises(ConfigError, match=rf"^'{last}' is a directory: every run saves its last checkpoint at "
                                              "that path, so this one would train and fail at its first save"):
            resolve_ckpt_path(cfg)

def test_adamw8bit_where_bitsandbytes_does_not_import_is_one_config_error(tiny_cfg, monkeypatch):
    """optimizer=adamw8bit without a working bitsandbytes was an ImportError with Hydra's traceback, from check_config's
    build of the optimizer on a dummy parameter; now one ConfigError line that names the cause and the way out."""
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # 'import bitsandbytes' raises ModuleNotFoundError
    with pytest.raises(ConfigError, match=r"^optimizer: optimizer=adamw8bit needs bitsandbytes, which does not import "
                                          r"here \(ModuleNotFoundError: .*\): pip install bitsandbytes, or use "
                                          r"optimizer=adamw$"):
        check_config(tiny_cfg("optimizer=adamw8bit"))


@pytest.mark.parametrize("saved, configured", [("torch", "adamw8bit"), ("bnb", "adamw")])
def test_resuming_with_the_other_adamw_is_refused_before_fit(saved, configured, tiny_cfg, tmp_path):
    """ckpt_path=<an AdamW run> optimizer=adamw8bit restored the checkpoint and died at the first step with
    KeyError: 'state1' inside bitsandbytes; the other way round with KeyError: 'exp_avg' inside torch.optim."""
    from lit_dtrain.train import check_optimizer_state

    t = torch.zeros(2)
    state = {"step": torch.tensor(3.0), "exp_avg": t, "exp_avg_sq": t} if saved == "torch" else \
        {"step": 3, "__bnb_optimizer_quant_state__": {}}
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 3, "state_dict": {}, "optimizer_states": [{"state": {0: state}, "param_groups": []}]},
               ckpt)
    with pytest.raises(ConfigError, match=rf"checkpoint '{ckpt}' holds .* optimizer state, but optimizer={configured}"
                                          r" is configured; .*init_from="):
        check_optimizer_state(tiny_cfg(f"optimizer={configured}"), str(ckpt))
    check_optimizer_state(tiny_cfg(f"optimizer={'adamw' if saved == 'torch' else 'adamw8bit'}"), str(ckpt))


def test_resume_auto_in_a_new_multirun_dir_is_refused(tmp_path, corpus):
    """Re-running a killed sweep as `python train.py -m ... resume=auto` wrote a new timestamped sweep dir, so every
    job logged 'no .../last.ckpt yet, starting fresh' and retrained from step 0 (reproduced: job 1 killed at step
    26 with last.ckpt; the re-run trained it 0..60 in a second sweep dir). With hydra.sweep.dir=<the old sweep dir>
    each job resumes its own <dir>/<job num>, and that stays allowed."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    def job_cfg(sweep_dir: Path, num: int, *extra: str):
        cfg = compose_cfg(["resume=auto", *extra], tmp_path / "x", corpus)
        with open_dict(cfg):  # as conf/hydra/default.yaml lays out a multirun job
            cfg.paths.output_dir = str(sweep_dir / str(num))
            cfg.paths.checkpoint_dir = str(sweep_dir / str(num) / "checkpoints")
        return cfg

    cfg = job_cfg(tmp_path / "multiruns" / "x", 1)
    fresh = tmp_path / "multiruns" / f"{cfg.run_name}.123456"  # ${now:%Y-%m-%d_%H-%M-%S.%f} of this start
    with pytest.raises(ConfigError, match=r"resume=auto in a multirun needs hydra\.sweep\.dir=<the sweep to "
                                          rf"continue>: .*'{fresh}' .*job N resumes <sweep dir>/N"):
        resolve_ckpt_path(job_cfg(fresh, 1))
    # run_name names nothing in a multirun: `-m ... run_name=exp1 resume=auto` also started every job fresh
    now = tmp_path / "multiruns" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")
    with pytest.raises(ConfigError, match=r"resume=auto in a multirun needs hydra\.sweep\.dir="):
        resolve_ckpt_path(job_cfg(now, 0, "run_name=exp1"))
    old = tmp_path / "multiruns" / "2020-01-02_03-04-05.678901"  # an earlier sweep, pinned with hydra.sweep.dir
    assert resolve_ckpt_path(job_cfg(old, 1)) is None  # that job had not started: a fresh start of it
    (old / "1" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 2, "state_dict": {}}, old / "1" / "checkpoints" / "last.ckpt")  # a readable one
    assert resolve_ckpt_path(job_cfg(old, 1)) == str(old / "1" / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize(
    "prompt, match",
    [
        # $'\xff' on a shell command line: Python's argv holds the undecodable byte as the lone surrogate \udcff
        ("\udcff", r"sample.prompt='\\udcff' is not valid text: character 0 is a lone surrogate \(byte 0xff"),
        ("ab\ud800", r"sample.prompt='ab\\ud800' is not valid text: character 2 is a lone surrogate"),
        # str(None) prompted the sample with the four characters 'None'
        (None, r"sample.prompt must be text \(a string; '' starts at a document start\), got None"),
    ],
)
def test_a_prompt_that_is_not_text_fails_before_compute(prompt, match, tiny_cfg):
    """The end-of-run sample encodes sample.prompt after the last step: a UnicodeEncodeError there ended a finished
    run with exit 1 before summary.json was written."""
    cfg = tiny_cfg()
    cfg.sample.prompt = prompt
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


def test_prompts_that_are_text_are_valid(tiny_cfg):
    for prompt in ("", "def ", "héllo ✓", 42):  # sample.prompt=42 arrives as an int: its digits
        cfg = tiny_cfg()
        cfg.sample.prompt = prompt
        check_config(cfg)


def test_a_run_name_that_is_not_utf8_text_fails_before_compute(tiny_cfg):
    """run_name names the run dir and TensorBoard's event file, whose name TensorBoard encodes as UTF-8: a byte that
    is not UTF-8 on the command line (run_name=$'\\xff', quoted for Hydra) failed in Lightning's setup with
    "UnicodeEncodeError: 'utf-8' codec can't encode character '\\udcff' in position 14", after the run dir was made."""
    cfg = tiny_cfg()
    cfg.run_name = "exp\udcff"
    with pytest.raises(ConfigError, match=r"run_name='exp\\udcff' is not valid text: character 3 is a lone surrogate "
                                          r"\(byte 0xff of a command line that is not UTF-8\)"):
        check_config(cfg)
    cfg.run_name = "expé_✓"
    check_config(cfg)


@pytest.mark.parametrize(
    "env, name",
    [
        ({}, "stamp"),
        ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "8"}, "slurm-123.4"),
        ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "1"}, "stamp"),  # one task
        ({"SLURM_JOB_ID": "123", "SLURM_NTASKS": "8"}, "stamp"),  # the batch script itself, not an srun step
        ({"TORCHELASTIC_RUN_ID": "5b3c-9f", "WORLD_SIZE": "2"}, "torchrun-5b3c-9f"),
        ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}, "stamp"),  # torchrun's default --rdzv-id
        ({"TORCHELASTIC_RUN_ID": "job/7", "WORLD_SIZE": "16"}, "torchrun-job_7"),
        ({"TORCHELASTIC_RUN_ID": "5b3c", "WORLD_SIZE": "1"}, "stamp"),
    ],
)
def test_the_default_run_name_is_the_launchs_id_under_srun_and_torchrun(env, name, monkeypatch):
    """Under a launcher every rank composes the config itself: the start-time default differed between ranks that
    started in different seconds, and rank 1 wrote a run dir of its own (tests/e2e/test_torchrun.py)."""
    from lit_dtrain.config_resolvers import launch_run_name

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_run_name("stamp") == name


def test_a_launchers_default_run_name_is_still_the_default(monkeypatch, tmp_path, corpus):
    """It names the launch, not a run to continue: resume=auto still needs run_name=..."""
    from omegaconf import open_dict

    from lit_dtrain.resume import _default_run_name
    from lit_dtrain.train import resolve_ckpt_path

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    assert cfg.run_name == "torchrun-abc" and _default_run_name(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "runs" / "torchrun-abc")
        cfg.paths.checkpoint_dir = str(tmp_path / "runs" / "torchrun-abc" / "checkpoints")
    with pytest.raises(ConfigError, match=r"resume=auto needs run_name=.*\(torchrun-abc: its start time, or its"):
        resolve_ckpt_path(cfg)
    assert not _default_run_name(compose_cfg(["run_name=torchrun-abc"], tmp_path / "x", corpus))


def test_resume_auto_under_srun_continues_the_requeued_job_in_its_default_run_dir(monkeypatch, tmp_path, corpus):
    """A requeue-ready batch script runs `srun python train.py resume=auto`: Slurm requeues a preempted job with its
    SLURM_JOB_ID and step, so the default run_name slurm-<job>.<step> names the same run dir again. It was refused
    like a new timestamp ('resume=auto needs run_name'), on the first start and after the requeue alike; now the
    first start trains fresh and the requeued one finds last.ckpt. torchrun (a new uuid per --standalone launch) is
    still refused (previous test)."""
    from omegaconf import open_dict

    from lit_dtrain.resume import _default_run_name
    from lit_dtrain.train import resolve_ckpt_path

    for key, value in {"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    assert cfg.run_name == "slurm-123.0" and _default_run_name(cfg)
    run = tmp_path / "runs" / "slurm-123.0"
    with open_dict(cfg):
        cfg.paths.output_dir, cfg.paths.checkpoint_dir = str(run), str(run / "checkpoints")
    assert resolve_ckpt_path(cfg) is None  # the first start: nothing to resume yet, a fresh run
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 4, "state_dict": {}}, run / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(run / "checkpoints" / "last.ckpt")  # the requeued start resumes


@pytest.mark.parametrize(
    "env, name",
    [
        ({"TORCHELASTIC_RUN_ID": "5b3c-9f", "WORLD_SIZE": "2"}, "torchrun-5b3c-9f"),
        ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "8"}, "slurm-123.4"),
    ],
)
def test_a_multiruns_default_sweep_dir_is_the_launchs_id_under_srun_and_torchrun(env, name, monkeypatch, tmp_path):
    """Every rank composes hydra.sweep.dir itself, and its default was each process's start time (to the
    microsecond): `torchrun --nproc_per_node=2 train.py -m ...` wrote two sweep dirs on every launch, rank 1's
    holding only .hydra/ and train.log of each job (tests/e2e/test_torchrun.py). It is the launch's id now, as
    run_name's default; without a launcher it is still the start time."""
    from hydra import compose, initialize_config_dir

    launcher = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")
    for key in (*launcher, "LIT_DTRAIN_SWEEP_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path))

    def sweep_dir() -> str:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return str(compose(config_name="train", return_hydra_config=True).hydra.sweep.dir)

    assert Path(sweep_dir()).parent == tmp_path / "multiruns"
    assert datetime.strptime(Path(sweep_dir()).name, "%Y-%m-%d_%H-%M-%S.%f")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert sweep_dir() == str(tmp_path / "multiruns" / name)


def test_resume_auto_in_a_launchers_new_default_sweep_dir_is_refused(monkeypatch, tmp_path, corpus):
    """The launch's id names a new sweep dir on each torchrun --standalone launch, so a sweep re-run with resume=auto
    and no hydra.sweep.dir would start every job fresh: refused, as in a new timestamped sweep dir. A re-launch with
    the same id (a requeued SLURM job, a fixed --rdzv-id) finds its earlier jobs' checkpoints there: each job resumes
    its own, and one that never started starts fresh."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sweep = tmp_path / "multiruns" / "torchrun-abc"

    def job_cfg(num: int, sweep_dir: Path = sweep):
        cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
        with open_dict(cfg):  # as conf/hydra/default.yaml lays out a multirun job
            cfg.paths.output_dir = str(sweep_dir / str(num))
            cfg.paths.checkpoint_dir = str(sweep_dir / str(num) / "checkpoints")
        return cfg

    for num in (0, 1):
        with pytest.raises(ConfigError, match=rf"resume=auto in a multirun needs hydra\.sweep\.dir=.*'{sweep}'"):
            resolve_ckpt_path(job_cfg(num))
    (sweep / "0" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 2, "state_dict": {}}, sweep / "0" / "checkpoints" / "last.ckpt")  # a readable one
    assert resolve_ckpt_path(job_cfg(0)) == str(sweep / "0" / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(job_cfg(1)) is None  # not started before: a fresh start of it
    # given with hydra.sweep.dir, a dir of that name is the user's, checkpoints or not
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    other = tmp_path / "multiruns2" / "torchrun-abc"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        HydraConfig.instance().set_config(
            compose(config_name="train", overrides=[f"hydra.sweep.dir={other}"], return_hydra_config=True)
        )
    try:
        assert resolve_ckpt_path(job_cfg(0, other)) is None
    finally:
        HydraConfig.instance().cfg = None


def test_a_val_fraction_that_rounds_to_no_batch_is_refused_before_the_first_step(tiny_cfg, monkeypatch):
    """trainer.limit_val_batches=0.1 of a 1-batch val loader: Lightning raised at the first validation,
    val_check_interval steps in and before any checkpoint (a run trained 15 steps and saved nothing). The loaders'
    sizes are known at fit start: the run now stops there, naming the key, the sizes and the smallest fraction that
    works; a fraction that leaves a batch trains."""
    from lit_dtrain.module import LitLLM
    from lit_dtrain.train import train

    steps = []
    original = LitLLM.training_step
    monkeypatch.setattr(LitLLM, "training_step", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    cfg = tiny_cfg("trainer.limit_val_batches=0.1", "data.max_val_windows=16", "data.val_batch_size=8")
    with pytest.raises(ConfigError, match=r"limit_val_batches=0\.1 leaves no validation batch.*'text': 2.*>= 0\.5"):
        train(cfg)
    assert steps == []
    assert not (Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt").exists()
    metrics, _ = train(tiny_cfg("trainer.limit_val_batches=0.5", "data.max_val_windows=16", "data.val_batch_size=8",
                                "sample.max_new_tokens=0", run="ok"))
    assert metrics["steps"] == 6 and math.isfinite(metrics["val_loss"])


@pytest.mark.parametrize("batches", [3, 9, 49, 1000])
def test_the_smallest_val_fraction_a_refusal_suggests_keeps_a_batch(batches):
    """The refusal of a val fraction that leaves no batch suggests the smallest fraction that works. It printed
    1 / batches to 3 significant digits, rounded to nearest: 0.333 for a 3-batch loader, which leaves int(3 x 0.333) = 0
    batches (Lightning's count) and is refused again; 1 / 49 fails even unrounded (49 x (1/49) < 1 in floats)."""
    from types import SimpleNamespace

    from lit_dtrain.train_callbacks import ValLimitCheck

    loaders = [range(batches), range(3 * batches)]  # 0.5 / batches leaves the large one a batch
    trainer = SimpleNamespace(datamodule=SimpleNamespace(val_dataloader=lambda: loaders))
    module = SimpleNamespace(val_names=["small", "large"])
    with pytest.raises(ConfigError, match=rf"is 0 for {{'small': {batches}}}.*fraction >= ([0-9.]+),") as e:
        ValLimitCheck(0.5 / batches).on_fit_start(trainer, module)
    suggested = float(re.search(r"fraction >= ([0-9.]+),", str(e.value)).group(1))
    assert all(int(len(loader) * suggested) >= 1 for loader in loaders), suggested
    assert suggested <= 1.01 / batches  # and it is still the smallest, to 3 significant digits
    ValLimitCheck(suggested).on_fit_start(trainer, module)  # the suggestion is accepted


def test_a_schedule_horizon_below_max_steps_is_warned_about(tiny_cfg, caplog):
    """scheduler=cosine scheduler.total_steps=3 trainer.max_steps=6 trained steps 3..5 at the floor
    (min_lr_factor of the peak; 0 for WSD) without a word; the WSD callback warns for the same case. A warning, not
    an error: a horizon above max_steps plans a stable run to branch from (docs/wsd.md)."""
    import logging

    from lit_dtrain.config_checks import warn_if_the_schedule_ends_early
    from lit_dtrain.train import train

    caplog.set_level(logging.WARNING, logger="lit_dtrain.config_checks")
    _, objs = train(tiny_cfg("scheduler=cosine", "scheduler.total_steps=3", "sample.max_new_tokens=0"))
    warned = [r.getMessage() for r in caplog.records if "scheduler.total_steps" in r.getMessage()]
    assert warned == [
        "scheduler.total_steps=3 is below trainer.max_steps=6: the cosine_scheduler ends at step 2 and the last 3 "
        "steps run at min_lr_factor=0.1 of the peak LR. Set scheduler.total_steps=6 (or leave it at its default, "
        "${trainer.max_steps}), or trainer.max_steps=3"
    ]
    lr = objs["trainer"].optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(0.1 * objs["module"].trainer.lr_scheduler_configs[0].scheduler.base_lrs[0])

    def warnings_for(*overrides, start_step=0):
        caplog.clear()
        warn_if_the_schedule_ends_early(tiny_cfg(*overrides), start_step)
        return [r.getMessage() for r in caplog.records]

    (wsd,) = warnings_for("scheduler.total_steps=4")  # the default wsd: its floor is 0
    assert wsd.startswith("scheduler.total_steps=4 is below trainer.max_steps=6: the wsd_scheduler ends at step 3 "
                          "and the last 2 steps run at min_lr_factor=0.0 of the peak LR")
    (resumed,) = warnings_for("scheduler=cosine", "scheduler.total_steps=3", start_step=4)  # this run's steps only
    assert "and the last 2 steps run at" in resumed
    (one,) = warnings_for("scheduler.total_steps=5")  # it said "the last 1 steps run at"
    assert "ends at step 4 and the last 1 step runs at min_lr_factor=0.0 of the peak LR" in one
    assert warnings_for("scheduler=cosine", "scheduler.total_steps=3", start_step=6) == []
    assert warnings_for("scheduler=cosine") == []  # total_steps: ${trainer.max_steps}
    assert warnings_for("scheduler=cosine", "scheduler.total_steps=100") == []  # a longer horizon, on purpose
    assert warnings_for("scheduler=constant") == []
    caplog.set_level(logging.INFO, logger="lit_dtrain.config_checks")  # a longer horizon says where the run stops
    assert warnings_for("scheduler=cosine", "scheduler.total_steps=100") == [
        "scheduler.total_steps=100 is above trainer.max_steps=6: this run stops at step 5 with the LR at 0.9943 of "
        "the peak, before its schedule ends (at step 99)"
    ]


def test_torchrun_restarts_that_cannot_continue_the_run_are_warned_about(tiny_cfg, caplog):
    """Under torchrun --max-restarts, a restarted worker runs the same command: without resume=auto it was a fresh
    start refused in the run dir (using up the restarts), and on gloo with the agent's shared store it hung or failed
    to connect in 3 of 4 tries (pytorch#135712). Both were silent until the restart."""
    import logging

    from lit_dtrain._launch_checks import warn_about_torchrun_restarts

    caplog.set_level(logging.WARNING, logger="lit_dtrain.config_checks")
    torchrun = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def warnings_for(env, *overrides):
        caplog.clear()
        warn_about_torchrun_restarts(tiny_cfg(*overrides), env)
        return [r.getMessage() for r in caplog.records]

    fresh, store = warnings_for(torchrun)  # tiny_cfg trains on the CPU (gloo) without resume=auto
    assert fresh.startswith("torchrun --max-restarts=2: a restarted worker continues this run only with resume=auto")
    assert store.startswith("torchrun --max-restarts=2 on gloo with torchrun's shared store") and \
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in store
    (store,) = warnings_for(torchrun, "resume=auto")
    assert "shared store" in store
    assert warnings_for({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}, "resume=auto") == []  # the setting
    assert warnings_for({**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"}) == []  # said at the first start only
    assert warnings_for({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}) == []  # no restarts
    assert warnings_for({}) == []  # not under torchrun


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        ((), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},  # tiny_cfg: trainer.devices=1
         "trainer.devices=1 starts 1 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2 workers per node: "
         "set trainer.devices=2 trainer.num_nodes=1"),
        (("trainer.devices=auto",), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},  # the default: 1 process on a CPU
         "trainer.devices=auto starts 1 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2 workers per "
         "node: set trainer.devices=2 trainer.num_nodes=1 (on a CPU: trainer=ddp_cpu trainer.devices=2), or torchrun "
         "--nproc_per_node=1 (each worker would train a run of its own, all in one run dir)"),
        (("trainer=ddp_cpu", "trainer.devices=4"), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},
         "trainer.devices=4 starts 4 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2"),
        (("trainer=ddp_cpu",), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
         "trainer.num_nodes=1 x 2 workers per node = 2 processes, but torchrun's WORLD_SIZE=4: set trainer.devices=2 "
         "trainer.num_nodes=2"),
        (("trainer=ddp_cpu",), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, None),  # what torchrun started
        (("trainer=ddp_cpu", "trainer.num_nodes=2"), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, None),
        ((), {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}, None),  # torchrun --nproc_per_node=1: one process
    ],
)
def test_a_torchrun_launch_that_does_not_match_the_trainer_is_refused_before_any_compute(tiny_cfg, overrides, env,
                                                                                          message):
    """`torchrun --nproc_per_node=2 train.py` with the default trainer.devices (auto: one process on a CPU) trained
    2 single-process runs into one run dir, both exiting 0 (last.ckpt and last-v1.ckpt); Lightning checks the world
    size only for a strategy of several processes."""
    from lit_dtrain._launch_checks import check_torchrun_launch

    env = {"TORCHELASTIC_RUN_ID": "abc", **env}
    if message is None:
        check_torchrun_launch(tiny_cfg(*overrides), env)
        check_torchrun_launch(tiny_cfg(*overrides), {})  # not under torchrun: nothing to check
        return
    with pytest.raises(ConfigError) as e:
        check_torchrun_launch(tiny_cfg(*overrides), env)
    assert str(e.value).startswith(message)
    check_torchrun_launch(tiny_cfg(*overrides), {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "trainer.num_nodes=2 without torchrun or srun: Lightning's own launch on each node reads the first "
             "node's address and this node's rank from MASTER_ADDR and NODE_RANK, and MASTER_ADDR and NODE_RANK are "
             "not set"),
        ({"MASTER_ADDR": "10.0.0.1"}, "and NODE_RANK is not set"),
        ({"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"}, None),  # Lightning's own multi-node launch
        ({"TORCHELASTIC_RUN_ID": "x"}, None),  # torchrun gives the ranks (its own check is check_torchrun_launch)
        ({"SLURM_NTASKS": "4"}, None),  # srun: lit_dtrain.slurm checks it
    ],
)
def test_several_nodes_without_a_launcher_or_their_addresses_are_refused(tiny_cfg, env, message):
    """`python train.py trainer=ddp_cpu trainer.num_nodes=2` on one machine, with no launcher and no MASTER_ADDR /
    NODE_RANK: Lightning's launch waited for the other node's 2 ranks on 127.0.0.1 until the collective timeout."""
    from lit_dtrain._launch_checks import check_multinode_launch

    cfg = tiny_cfg("trainer=ddp_cpu", "trainer.num_nodes=2")
    if message is None:
        check_multinode_launch(cfg, env)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_multinode_launch(cfg, env)
    check_multinode_launch(tiny_cfg("trainer=ddp_cpu"), {})  # one node: nothing to check


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


def start_warnings(check, tmp_path, caplog):
    """``warnings_for(*overrides)``: the warnings ``check`` logs for the composed config (not TINY's overrides: they
    switch off callbacks.progress_bar)."""
    import logging

    caplog.set_level(logging.WARNING, logger="lit_dtrain.config_checks")

    def warnings_for(*overrides):
        caplog.clear()
        check(compose_cfg(list(overrides), tmp_path / "run", tiny=False))
        return [r.getMessage() for r in caplog.records]

    return warnings_for


def test_a_callbacks_choice_without_the_defaults_is_warned_about(tmp_path, caplog):
    """``python train.py callbacks=loss_spike`` (for ``'callbacks=[default,loss_spike]'``) wrote no checkpoint
    before its end (none at a validation, none on SIGTERM) and no LR or throughput curves, not saying so."""
    from lit_dtrain.config_warnings import warn_if_the_default_callbacks_are_dropped

    warnings_for = start_warnings(warn_if_the_default_callbacks_are_dropped, tmp_path, caplog)
    assert warnings_for("callbacks=loss_spike") == [
        "callbacks=[loss_spike] replaces the default callbacks (model_checkpoint, preemption, lr_monitor, "
        "throughput): no checkpoint before the run's end, none on SIGTERM; to add to them: "
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
