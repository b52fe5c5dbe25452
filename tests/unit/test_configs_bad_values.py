"""Bad config values, prompts and run names fail before compute, each named."""

import importlib.util

import pytest
import torch

from lit_dtrain.config_checks import check_config
from lit_dtrain.train import ConfigError


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
        # data.block_size is ${model.block_size}: the line named data.block_size, a key the command line left alone
        ("model.block_size=abc", r"^model.block_size must be an integer, got 'abc' \(str\)"),
        # a window of 1 token: each token predicts the next from itself alone (a bigram model), trained and exited 0
        ("data.block_size=1", r"^data.block_size=1: a window of 1 token trains the model without context; give >= 2$"),
        ("model.block_size=1", r"^model.block_size=1: a window of 1 token trains the model without context"),
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
        ("optimizer.eps=-1", r"^optimizer.eps must be > 0, got -1: Adam divides"),
        # torch takes 0: an element whose gradient is 0 at a step (an untied embedding row) became NaN
        ("optimizer.eps=0", r"^optimizer.eps must be > 0, got 0: Adam divides each update by sqrt\(v\) \+ eps"),
        # cosine and wsd refuse warmup > total_steps; constant trained without ever reaching optimizer.lr
        ("scheduler=constant scheduler.warmup_steps=10",
         r"scheduler.warmup_steps=10 exceeds trainer.max_steps=6: the LR would never reach optimizer.lr"),
        # torch only warns that the call 'has no effect'
        ("matmul_precision=hihg", r"matmul_precision must be one of 'highest', 'high', 'medium', got 'hihg'"),
        # Lightning skips clipping for a value <= 0: -1 trained unclipped, silently
        ("trainer.gradient_clip_val=-1", r"trainer.gradient_clip_val must be >= 0 \(null or 0: no clipping\), got -1"),
        # Lightning logs where step % every == 0: -1 wrote train/loss at every step, -3 every 3rd
        ("trainer.log_every_n_steps=-1",
         r"^trainer.log_every_n_steps must be >= 0 \(N: training rows every N optimizer steps; 0: none\), got -1$"),
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
        # FSDP gathers each state tensor as shaped like its parameter, bitsandbytes' block scales are not: the run
        # failed at its first checkpoint, 'The size of tensor a (32) must match the size of tensor b (96)'
        ("strategy=fsdp optimizer=adamw8bit",
         r"strategy=fsdp cannot be combined with optimizer=adamw8bit: FSDP cannot save bitsandbytes' 8-bit optimizer "
         r"state .* Use optimizer=adamw, or strategy=ddp"),
        # a ModuleNotFoundError from inside the Trainer's construction
        ("trainer.precision=transformer-engine",
         r"trainer.precision=transformer-engine needs NVIDIA's transformer_engine package, which is not installed"),
        ("trainer.gradient_clip_algorithm=nrm",
         r"trainer.gradient_clip_algorithm='nrm' must be one of 'value', 'norm'"),
        # Lightning's MisconfigurationException in Hydra's wrapper, naming only full_key: callbacks.lr_monitor
        ("callbacks.lr_monitor.logging_interval=abc",
         r"callbacks.lr_monitor.logging_interval='abc' must be 'step' \(the LR of every logged step\), 'epoch' "),
        ("callbacks.lr_monitor.logging_interval=0", r"callbacks.lr_monitor.logging_interval=0 must be 'step'"),
        # Lightning's 'found `ModelCheckpoint` in callbacks list', naming neither key nor fix
        ("+trainer.enable_checkpointing=false",
         r"^trainer.enable_checkpointing=false, but callbacks.model_checkpoint is a ModelCheckpoint, which Lightning "
         r"refuses beside it: for no checkpoints during training set callbacks.model_checkpoint=null instead"),
        ("callbacks.model_checkpoint.mode=minimum",
         r"callbacks.model_checkpoint.mode='minimum' must be 'min' or 'max' \(whether a lower or a higher val/loss"),
        *([] if torch.cuda.is_available() else [  # Lightning's 'No supported gpu backend found!' in Hydra's wrapper
            ("trainer.accelerator=gpu",
             r"trainer.accelerator=gpu \(trainer=gpu\), but torch .* finds no CUDA GPU: on this machine use "
             r"trainer=cpu \(or trainer=ddp_cpu\)"),
            ("trainer.accelerator=cuda", r"trainer.accelerator=cuda \(trainer=gpu\), but torch")]),
        # Lightning's ValueError (or, for tpu, torch_xla's ModuleNotFoundError) in Hydra's wrapper, after the seed
        ("trainer.accelerator=gpuu", r"^trainer.accelerator='gpuu' is not one of Lightning's accelerators: auto, gpu, "
                                     r"cpu, cuda, mps, tpu$"),
        ("trainer.accelerator=CPU", r"^trainer.accelerator='CPU' is not one of Lightning's accelerators"),
        *([] if importlib.util.find_spec("torch_xla") else [
            ("trainer.accelerator=tpu", r"^trainer.accelerator=tpu: Lightning's tpu accelerator is not available on "
                                        r"this machine \(available: auto, cpu.*\); use trainer.accelerator=auto$")]),
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
        # sample.top_p was no key (generate.py --top-p was): validated as generate.py's flag, before any compute
        ("sample.top_p=0", r"sample.top_p must be a number in \(0, 1\] \(1: all tokens\), got 0"),
        ("sample.top_p=1.5", r"sample.top_p must be a number in \(0, 1\] \(1: all tokens\), got 1.5"),
        ("sample.top_p=abc", r"sample.top_p must be a number in \(0, 1\] \(1: all tokens\), got 'abc'"),
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
        # the optimizer's dummy build ran first: "optimizer: adamw() got an unexpected keyword argument 'lrr'"
        ("++optimizer.lrr=1e-3", r"^optimizer.lrr is not an argument of lit_dtrain.optim.adamw; did you mean "
                                 r"'optimizer.lr'\?$"),
        # the schedule's dummy build: told "an experiment's setting for another schedule?", to drop it, no suggestion
        ("++scheduler.warmup_stepz=3", r"^scheduler.warmup_stepz is not an argument of wsd_scheduler; did you mean "
                                       r"'scheduler.warmup_steps'\?$"),
        ("data/sampler=fourier +data.sampler.lagg=1", r"^data.sampler.lagg is not an argument of .*FourierSampler; "
                                                      r"did you mean 'data.sampler.lag'\?$"),
        # the callback saved there, the end of the run and resume=auto used paths.checkpoint_dir: a run killed after
        # its step-6 checkpoint resumed from nothing (trained from step 0 again, exit 0)
        ("callbacks.model_checkpoint.dirpath=/elsewhere/ck",
         r"^callbacks.model_checkpoint.dirpath='/elsewhere/ck' is not paths.checkpoint_dir=.* set "
         r"paths.checkpoint_dir='/elsewhere/ck' instead"),
        ("callbacks.preemption.dirpath=/elsewhere/ck", r"^callbacks.preemption.dirpath='/elsewhere/ck' is not "),
        # Lightning's default dir: the step files went to <run dir>/tb/checkpoints, where resume=auto never looks
        ("callbacks.model_checkpoint.dirpath=null", r"^callbacks.model_checkpoint.dirpath=null saves in Lightning's "
                                                   r"default dir .* its default, \$\{paths.checkpoint_dir\}$"),
        ("paths.checkpoint_dir=null", r"^paths.checkpoint_dir=null saves in Lightning's default dir"),
        # falsy: Lightning's default, silently (the best file was '0-2.ckpt')
        ("callbacks.model_checkpoint.filename=''", r"^callbacks.model_checkpoint.filename is empty \(''\): give one, "
                                                   r"or null for Lightning's default \(\{epoch\}-\{step\}\)$"),
        ("callbacks.model_checkpoint.monitor=''", r"^callbacks.model_checkpoint.monitor is empty \(''\): .* \(no "
                                                  r"metric: the latest is kept\)$"),
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


def test_checkpointing_off_without_the_model_checkpoint_callback_passes(tiny_cfg):
    """The fix the enable_checkpointing=false error names is a config the checks take."""
    check_config(tiny_cfg("+trainer.enable_checkpointing=false", "callbacks.model_checkpoint=null"))


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
