"""Bad values a user could type for each config key (0, -1, null, a string, a list where a number or a path
belongs): each is one ``ConfigError`` naming the key, before any compute, where it used to be a traceback from
inside the model, Lightning or the datamodule, or a run that trained with the value read as something else."""

import pytest

from lit_dtrain.callbacks import LossSpikeMonitor, SelectiveCheckpointing
from lit_dtrain.config_checks import check_config
from lit_dtrain.errors import ConfigError

# Null where a number or flag is needed is refused
NULLS = [
    # Hydra's wrapper of build_llama: "TypeError: '<=' not supported between instances of 'NoneType' and 'int'",
    # naming only the node (full_key: model)
    ("model.n_layer=null", r"^model.n_layer must be an integer, got None \(NoneType\)$"),
    ("model.d_model=null", r"^model.d_model must be an integer, got None"),
    ("model.rope_theta=null", r"^model.rope_theta must be a number, got None"),
    ("model.init_std=null", r"^model.init_std must be a number, got None"),
    ("model.dropout=null", r"^model.dropout must be a number, got None"),
    ("model.dropout=abc", r"^model.dropout must be a number, got 'abc' \(str\)$"),
    # "optimizer: '<=' not supported between instances of 'float' and 'NoneType'", naming neither key
    ("optimizer.eps=null", r"^optimizer.eps must be a number, got None"),
    ("optimizer.weight_decay=null", r"^optimizer.weight_decay must be a number, got None"),
    ("optimizer.betas=null", r"^optimizer.betas must be two numbers in \[0, 1\), got None$"),
    # read with `if value:`: check_finite=null trained with the check off, tie_embeddings=null untied (val 4.76
    # against 4.55 in a 2-step nano run), silently
    ("module.check_finite=null", r"^module.check_finite must be true or false, got None \(NoneType\)$"),
    ("module.compile=null", r"^module.compile must be true or false, got None"),
    ("model.tie_embeddings=null", r"^model.tie_embeddings must be true or false, got None"),
    ("model.depth_scaled_init=null", r"^model.depth_scaled_init must be true or false, got None"),
]


# A list or mapping for a flag or number argument is refused
CONTAINERS = [
    # a list reached the constructor: fused=[] built a foreach AdamW, auto_insert_metric_name=[] read as false
    ("optimizer.fused=[]", r"^optimizer.fused must be true or false or null, got \[\] \(list\)$"),
    ("callbacks.model_checkpoint.auto_insert_metric_name=[]",
     r"^callbacks.model_checkpoint.auto_insert_metric_name must be true or false, got \[\] \(list\)$"),
    ("callbacks.model_checkpoint.save_top_k=[1]",
     r"^callbacks.model_checkpoint.save_top_k must be an integer, got \[1\] \(list\)$"),
    ("data.seed={a:1}", r"^data.seed must be an integer, got \{'a': 1\} \(dict\)$"),
]


# A flag or number of a parent class that a subclass's **kwargs pass on: ShardedBlockQuantizer's (int8_rs) were
# unchecked, so error_feedback=abc trained with error feedback on, and block_size=null failed in Hydra's wrapper
INHERITED = [
    ("strategy=ddp_compressed/int8_rs strategy.compressor.error_feedback=abc",
     r"^strategy.compressor.error_feedback must be true or false, got 'abc' \(str\)$"),
    ("strategy=ddp_compressed/int8_rs strategy.compressor.start_step=2.5",
     r"^strategy.compressor.start_step must be an integer, got 2.5 \(float\)$"),
    ("strategy=ddp_compressed/int8_rs strategy.compressor.block_size=null",
     r"^strategy.compressor.block_size must be an integer, got None \(NoneType\)$"),
]

# A path key that is not text is refused
PATHS = [
    # falsy, so read as "no checkpoint": the run trained from scratch and exited 0, silently
    ("ckpt_path=[]", r"^ckpt_path must be a path \(text\) or null, got \[\] \(list\)$"),
    ("init_from=0", r"^init_from must be a path \(text\) or null, got 0 \(int\) \(a name that reads as a number: "
                    r"quote it, init_from=\"'0'\"\)$"),
    ("decay_branch.ckpt=[a]", r"^decay_branch.ckpt must be a path \(text\) or null, got \['a'\] \(list\)$"),
    # "TypeError: expected str, bytes or os.PathLike object, not int" from the token cache's build
    ("data.cache_dir=0", r"^data.cache_dir must be a path \(text\), got 0 \(int\)"),
    ("data.cache_dir=null", r"^data.cache_dir must be a path \(text\), got None \(NoneType\)$"),
    # the same TypeError in Hydra's wrapper of the datamodule, naming only 'full_key: data'; 0 excluded nothing
    ("data.exclude_dirs=[-1]", r"^data.exclude_dirs must be a list of paths \(text\), one path or null, "
                               r"got \[-1\] "),
    ("data.exclude_dirs=0", r"^data.exclude_dirs must be a list of paths \(text\), one path or null, got 0 "),
]


# A checkpoint monitor or filename that is not text is refused
CHECKPOINT_NAMES = [
    # Lightning's MisconfigurationException "ModelCheckpoint(monitor=0) could not find the monitored key" at the
    # first validation, after training; filename=-1 a TypeError from re.findall at the first save; filename=0
    # or [] (falsy) named the files by Lightning's default, silently
    ("callbacks.model_checkpoint.monitor=0",
     r"^callbacks.model_checkpoint.monitor must be text or null, got 0 \(int\)$"),
    ("callbacks.model_checkpoint.monitor=[]",
     r"^callbacks.model_checkpoint.monitor must be text or null, got \[\] \(list\)$"),
    ("callbacks.model_checkpoint.filename=-1",
     r"^callbacks.model_checkpoint.filename must be text or null, got -1 \(int\)$"),
    ("callbacks.model_checkpoint.filename=0",
     r"^callbacks.model_checkpoint.filename must be text or null, got 0 \(int\)$"),
]


# Trainer and logger values lightning fails on are refused
LIGHTNING_VALUES = [
    # Lightning's Timer in Hydra's wrapper: "AttributeError: 'float' object has no attribute 'total_seconds'"
    ("trainer.max_time=2.5", r"^trainer.max_time=2.5 must be 'DD:HH:MM:SS' \(e.g. '00:12:00:00'\), a mapping"),
    ("trainer.max_time=abc", r"^trainer.max_time='abc' must be 'DD:HH:MM:SS'"),
    # YAML reads an unquoted 1:00:00:00 in a config file as base 60: the refusal named only 216000
    ("trainer.max_time=216000", r"^trainer.max_time=216000 must be 'DD:HH:MM:SS' .*, or null \(no limit\); written "
                                r"unquoted in a YAML file, 1:00:00:00 is YAML's base-60 number 216000: quote it, "
                                r"max_time: '1:00:00:00' \(or, for 216000 seconds, \{seconds: 216000\}\)$"),
    ("trainer.max_time=43200", r"; written unquoted in a YAML file, 12:00:00 is YAML's base-60 number 43200: quote "
                               r"it, max_time: '00:12:00:00'"),
    # Lightning's Timer takes two digits for hours, minutes and seconds: its MisconfigurationException in a traceback
    ("trainer.max_time=00:1:00:00", r"^trainer.max_time='00:1:00:00' must be 'DD:HH:MM:SS' \(e.g. '00:12:00:00'\)"),
    # datetime.timedelta's "TypeError: 'mins' is an invalid keyword argument for __new__()" in Hydra's traceback
    ("trainer.max_time={mins:5}", r"^trainer.max_time's mins=5: a mapping takes numbers >= 0 under weeks, days, "
                                  r"hours, minutes, seconds, milliseconds, microseconds \(e.g. \{hours: 12\}\)"),
    ("trainer.max_time={hours:abc}", r"^trainer.max_time's hours='abc': a mapping takes numbers >= 0"),
    ("trainer.max_time={seconds:-5}", r"^trainer.max_time's seconds=-5: a mapping takes numbers >= 0"),
    ("trainer.max_time={hours:inf}", r"^trainer.max_time=\{'hours': inf\} is beyond datetime.timedelta \(cannot "
                                     r"convert float infinity to integer\): give a finite time"),
    # timedelta's "ValueError: cannot convert float NaN to integer" in Hydra's traceback
    ("trainer.max_time={hours:nan}", r"^trainer.max_time's hours=nan: a mapping takes numbers >= 0"),
    # Lightning's Timer: "OverflowError: days=1000000000; must have magnitude <= 999999999" in Hydra's traceback
    ("trainer.max_time=1000000000:00:00:00", r"^trainer.max_time='1000000000:00:00:00' is beyond datetime.timedelta "
                                             r"\(days=1000000000; must have magnitude <= 999999999\): give a finite"),
    ("trainer.max_time=999999999:24:00:00", r"^trainer.max_time='999999999:24:00:00' is beyond datetime.timedelta"),
    # a nano run trained 0 steps, wrote last.ckpt and summary.json (stopped=max_time) and exited 0
    ("trainer.max_time=00:00:00:00", r"^trainer.max_time='00:00:00:00' is no time: the run would train 0 of its "
                                     r"trainer.max_steps steps and end as if done; give a time > 0"),
    ("trainer.max_time={minutes:0}", r"^trainer.max_time=\{'minutes': 0\} is no time"),
    # max_epochs=0: as max_time 0 (stopped=max_epochs); -2: Lightning's error after the seed, naming 'trainer:'
    ("+trainer.max_epochs=0", r"^trainer.max_epochs=0 switches training off: the run would train 0 of its "
                              r"trainer.max_steps steps and end as if done; give a number of epochs >= 1, or -1 or "
                              r"null \(no epoch limit: the run stops at trainer.max_steps\)$"),
    ("+trainer.max_epochs=-2", r"^trainer.max_epochs=-2 is not a number of epochs \(Lightning takes -1 for no "
                               r"limit\); give a number of epochs >= 1"),
    # a nano run ran no sanity validation and exited 0 (Lightning takes -1 for all batches and checks no bound)
    ("trainer.num_sanity_val_steps=-2", r"^trainer.num_sanity_val_steps=-2 must be an integer >= -1 \(N: validation "
                                        r"batches before training; 0: none; -1: all\)$"),
    # -2.0 passed the bound and was made -2 after it: the same silent run without sanity validation
    ("trainer.num_sanity_val_steps=-2.0", r"^trainer.num_sanity_val_steps=-2 must be an integer >= -1"),
    # a ZeroDivisionError in Lightning's fit loop at the end of the first epoch
    ("trainer.check_val_every_n_epoch=0", r"^trainer.check_val_every_n_epoch must be null \(validate by steps: "
                                          r"trainer.val_check_interval\) or an integer >= 1, got 0$"),
    # "TypeError: expected str, bytes or os.PathLike object, not int" in Hydra's wrapper of the Trainer / logger
    ("trainer.default_root_dir=0", r"^trainer.default_root_dir must be a path \(text\) or null, got 0 \(int\)"),
    ("logger.save_dir=null", r"^logger.save_dir must be a path \(text\), got None \(NoneType\)$"),
    # a 2-step run exited 0 with its metrics.csv (or tb/) in the working dir, none in the run dir
    ("logger=csv logger.save_dir=''", r"^logger.save_dir is empty \(''\), which puts the logs in the working dir, "
                                      r"not the run dir: leave it at its default, \$\{paths.output_dir\}"),
    # TensorBoardLogger's "join() argument must be str, bytes, or os.PathLike object, not 'int'" in setup
    ("logger.name=-1", r"^logger.name must be a path \(text\) or null, got -1 \(int\)"),
]


# A name a technique's argument annotated text takes that is not text is refused
TEXT_ARGUMENTS = [
    # a 4-step nano run logged '0/decay/grad_rms', ... and exited 0
    ("callbacks=[default,optimizer_diagnostics] callbacks.optimizer_diagnostics.prefix=0",
     r"^callbacks.optimizer_diagnostics.prefix must be text, got 0 \(int\) \(a name that reads as a number: quote it, "
     r"callbacks.optimizer_diagnostics.prefix=\"'0'\"\)$"),
    ("callbacks=[default,optimizer_diagnostics] callbacks.optimizer_diagnostics.prefix=null",
     r"^callbacks.optimizer_diagnostics.prefix must be text, got None \(NoneType\)$"),
    # falsy, so read as no path: an 8-step run's spikes went to <run dir>/spikes.jsonl, silently
    ("callbacks=[default,loss_spike] callbacks.loss_spike.path=0",
     r"^callbacks.loss_spike.path must be text or null, got 0 \(int\) \(a name that reads as a number"),
    ("callbacks=[default,loss_spike] callbacks.loss_spike.path=[a]",
     r"^callbacks.loss_spike.path must be text or null, got \['a'\] \(list\)$"),
]


REFUSED = NULLS + CONTAINERS + INHERITED + PATHS + CHECKPOINT_NAMES + LIGHTNING_VALUES + TEXT_ARGUMENTS


@pytest.mark.parametrize("override, match", REFUSED)
def test_a_bad_value_is_refused_naming_the_key(override, match, tiny_cfg):
    with pytest.raises(ConfigError, match=match):
        check_config(tiny_cfg(*override.split(" ")))


# nulls, zeros and text that mean something
MEANINGFUL = [
    "model.mlp_hidden=null", "trainer.gradient_clip_val=null", "data.val_batch_size=null", "model.dropout=0",
    "sample.top_k=null", "ckpt_path=null", "init_from=null", "data.exclude_dirs=null", "data.exclude_dirs=[]",
    "data.exclude_dirs=/tmp/x", "data.exclude_dirs=[/tmp/x,/tmp/y]", "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.filename=null", "trainer.max_time=00:01:00:00", "trainer.max_time={hours:1}",
    "trainer.max_time={minutes:1.5,seconds:3}", "trainer.max_time={hours:${trainer.max_steps}}",
    "trainer.num_sanity_val_steps=-1", "trainer.num_sanity_val_steps=-1.0", "trainer.max_time=00:00:00:01",
    "+trainer.max_epochs=-1", "+trainer.max_epochs=1", "+trainer.max_epochs=null",
    "trainer.check_val_every_n_epoch=1", "logger.name=null", "logger=none",
    "callbacks=[default,loss_spike] callbacks.loss_spike.path=null",
    "callbacks=[default,loss_spike] callbacks.loss_spike.path=/tmp/spikes.jsonl",
    "callbacks=[default,optimizer_diagnostics] callbacks.optimizer_diagnostics.prefix='0'",
]


@pytest.mark.parametrize("override", MEANINGFUL)
def test_values_that_mean_something_pass(override, tiny_cfg):
    check_config(tiny_cfg(*override.split(" ")))


@pytest.mark.parametrize(
    "build, match",
    [
        # Hydra's wrapper: "TypeError: 'int' object is not iterable" / "'NoneType' object is not iterable"
        (lambda: SelectiveCheckpointing(save_ops=0), r"^SelectiveCheckpointing: save_ops must be a list of op names"),
        (lambda: LossSpikeMonitor(actions=None), r"^LossSpikeMonitor: actions must be a non-empty subset of .*None$"),
        (lambda: LossSpikeMonitor(actions=0), r"^LossSpikeMonitor: actions must be a non-empty subset of .*got 0$"),
        # "AttributeError: 'int' object has no attribute 'split'" in setup, inside fit
        (lambda: SelectiveCheckpointing(module_pattern=0),
         r"^SelectiveCheckpointing: module_pattern must be a glob over module paths .*, got 0$"),
    ],
)
def test_a_technique_argument_of_the_wrong_type_is_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()
