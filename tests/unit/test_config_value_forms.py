"""Forms of a value a user legitimately writes (a number from the environment, ...): each either works as meant or
is one ``ConfigError`` that says why and what to write instead."""

import pytest
from hydra.utils import instantiate

from lit_dtrain.config_checks import check_config
from lit_dtrain.errors import ConfigError
from lit_dtrain.train import val_check_in_batches


def test_a_number_from_the_environment_is_refused_naming_the_decode_resolver(tiny_cfg, monkeypatch):
    """``${oc.env:X}`` is text: ``trainer.max_steps=${oc.env:STEPS}`` was refused as 'must be an integer, got '8'
    (str)', naming no way to pass a number from the environment; ``${oc.decode:...}`` reads it as one."""
    monkeypatch.setenv("STEPS", "8")
    monkeypatch.setenv("SEED", "3")
    decoded = r"\$\{oc.decode:\$\{oc.env:STEPS\}\}"
    with pytest.raises(ConfigError, match=rf"^trainer.max_steps must be an integer, got '8' \(str\): "
                                          rf"\$\{{oc.env:...\}} gives text; read it as a number with {decoded} "
                                          rf"\(quoted on the command line: trainer.max_steps='{decoded}'\)$"):
        check_config(tiny_cfg("trainer.max_steps=${oc.env:STEPS}"))
    with pytest.raises(ConfigError, match=r"^data.seed must be an integer, got '3' \(str\): .*decode:\$\{oc.env:SEED"):
        check_config(tiny_cfg("data.seed=${oc.env:SEED}"))  # a _target_ node's argument
    cfg = tiny_cfg("trainer.max_steps='${oc.decode:${oc.env:STEPS}}'")
    check_config(cfg)
    assert cfg.trainer.max_steps == 8
    with pytest.raises(ConfigError, match=r"^trainer.max_steps must be an integer, got 'abc' \(str\)$"):
        check_config(tiny_cfg("trainer.max_steps=abc"))  # no environment: no hint


def test_a_whole_float_for_an_integer_key_is_taken_as_that_integer(tiny_cfg):
    """``trainer.max_steps=1e3`` (or ``20.0``) was refused as 'must be an integer, got 1000.0 (float)', while the
    Python API's check_int takes a float that is exactly an integer: the config now holds the int (a real 8.0-step
    run with val_check_interval=4.0 validated at steps 4 and 8, val_loss 3.5852 as with the integers)."""
    cfg = tiny_cfg("trainer.max_steps=1e3", "trainer.val_check_interval=20.0", "data.seed=3.0",
                   "trainer.log_every_n_steps=5.0")
    check_config(cfg)
    got = (cfg.trainer.max_steps, cfg.trainer.val_check_interval, cfg.data.seed, cfg.trainer.log_every_n_steps)
    assert got == (1000, 20, 3, 5) and all(type(v) is int for v in got)
    for override, match in [("trainer.max_steps=1.5", r"^trainer.max_steps must be an integer, got 1.5 \(float\)$"),
                            ("data.seed=2.5", r"^data.seed must be an integer, got 2.5 \(float\)$"),
                            ("trainer.max_steps=-3.0", r"^trainer.max_steps must be a positive step budget, got -3$")]:
        with pytest.raises(ConfigError, match=match):
            check_config(tiny_cfg(override))


STEPS = r"give the optimizer steps between validations as an integer"


@pytest.mark.parametrize("overrides, match", [
    # Lightning's fraction of an epoch: each was 'must be an integer, got 1.0 (float)', naming no reason
    (["trainer.val_check_interval=1.0"], rf"=1.0 is a fraction of an epoch .* an epoch never ends: {STEPS}"),
    (["trainer.val_check_interval=0.5"], rf"=0.5 is a fraction of an epoch .* an epoch never ends: {STEPS}"),
    (["trainer.val_check_interval=2.5"], rf"=2.5 is not a whole number of steps: {STEPS}"),
    (["trainer=ddp_cpu", "trainer.val_check_interval='00:00:00:10'"], r"own clock: the ranks could decide"),
    (["trainer.accumulate_grad_batches=2", "+trainer.val_check_interval={minutes:1}"],
     r"in the middle of an optimizer step's accumulation"),
    (["+trainer.val_check_interval={minuts:1}"], r"is no duration .*minuts.*: use datetime.timedelta's keys"),
    (["trainer.val_check_interval=abc"], r"='abc' must be optimizer steps \(an integer\) or a duration"),
    (["trainer.val_check_interval=-2.0"], r"^trainer.val_check_interval must be a positive integer, got -2$"),
])
def test_a_val_check_interval_that_cannot_work_is_refused_saying_why(overrides, match, tiny_cfg):
    with pytest.raises(ConfigError, match=match):
        check_config(tiny_cfg(*overrides))


@pytest.mark.parametrize(("value", "seconds"), [("'00:00:00:10'", 10), ("{minutes:1}", 60)])
def test_a_duration_val_check_interval_passes_on_one_process(value, seconds, tiny_cfg):
    """Lightning's validation by time: a real 40-step nano run with '00:00:00:03' validated 16 times, about every
    3 s, and checkpointed after each (it was refused as 'must be an integer'). The mapping form reaches the Trainer
    as a duration: Hydra passed it the DictConfig, and trainer.val_check_interval={seconds:2} failed before training
    ("'<=' not supported between instances of 'int' and 'DictConfig'")."""
    cfg = tiny_cfg(f"{'+' if value.startswith('{') else ''}trainer.val_check_interval={value}")
    check_config(cfg)
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          **val_check_in_batches(cfg))
    assert trainer._val_check_time_interval == seconds


def test_a_fraction_of_the_training_epoch_is_refused_before_compute(tiny_cfg):
    """trainer.limit_train_batches=0.5 ended a real run in Lightning's MisconfigurationException traceback once fit
    started ('When using an IterableDataset, Trainer(limit_train_batches) must be 1.0 or an int'); 3 and 1.0 work
    (a real run with 3 validated at steps 4 and 8, val_loss 3.5852 as without)."""
    with pytest.raises(ConfigError, match=r"^trainer.limit_train_batches=0.5 must be a whole number of batches per "
                                          r"epoch .* a fraction of an epoch cannot be taken; to train less, lower "
                                          r"trainer.max_steps$"):
        check_config(tiny_cfg("+trainer.limit_train_batches=0.5"))
    for value in ("3", "1.0"):
        check_config(tiny_cfg(f"+trainer.limit_train_batches={value}"))


def test_min_steps_above_max_steps_is_refused_naming_both(tiny_cfg):
    """Lightning stopped at max_steps without a word: a run with min_steps=10 max_steps=4 trained 4 steps."""
    with pytest.raises(ConfigError, match=r"^trainer.min_steps=10 exceeds trainer.max_steps=4: the run stops at "):
        check_config(tiny_cfg("trainer.max_steps=4", "+trainer.min_steps=10"))
    check_config(tiny_cfg("trainer.max_steps=4", "+trainer.min_steps=4"))


def test_min_steps_and_epochs_as_whole_floats_are_named_as_integers(tiny_cfg):
    """+trainer.min_steps=1e9 was refused as 'min_steps=1000000000.0'; min_epochs and max_epochs read alike."""
    with pytest.raises(ConfigError, match=r"^trainer.min_steps=1000000000 exceeds trainer.max_steps=4: "):
        check_config(tiny_cfg("trainer.max_steps=4", "+trainer.min_steps=1e9"))
    with pytest.raises(ConfigError, match=r"^trainer.min_epochs=2 exceeds trainer.max_epochs=1: "):
        check_config(tiny_cfg("+trainer.min_epochs=2e0", "+trainer.max_epochs=1e0"))


def test_limit_train_batches_0_is_refused_before_a_run_of_no_steps(tiny_cfg):
    """+trainer.limit_train_batches=0 with trainer.max_steps=4: a real run trained 0 steps, wrote last.ckpt and
    summary.json (steps 0, val_loss 5.2873 of the initial weights) and exited 0, as if done."""
    with pytest.raises(ConfigError, match=r"^trainer.limit_train_batches=0 switches training off: the run would train "
                                          r"0 of its trainer.max_steps steps"):
        check_config(tiny_cfg("+trainer.limit_train_batches=0"))
    check_config(tiny_cfg("+trainer.limit_train_batches=1"))


def test_a_whole_float_overfit_batches_reaches_lightning_as_an_int(tiny_cfg):
    """``+trainer.overfit_batches=2.0`` passed the check (a whole number of batches) but Lightning keeps the float as
    ``limit_train_batches``: 'MisconfigurationException: When using an IterableDataset, Trainer(limit_train_batches)
    must be 1.0 or an int' in Hydra's traceback at the fit's start. The config now holds the int 2."""
    cfg = tiny_cfg("+trainer.overfit_batches=2.0")
    check_config(cfg)
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert (trainer.overfit_batches, trainer.limit_train_batches) == (2, 2)
    assert type(trainer.limit_train_batches) is int


def test_a_whole_float_limit_val_batches_is_that_many_batches(tiny_cfg):
    """``trainer.limit_val_batches=2.0`` was refused, 'must be null (all), a number of batches >= 1 or a fraction in
    (0, 1], got 2.0', while every integer key takes a whole float (Lightning takes 2.0 as 2 batches too); 1.0 stays
    Lightning's fraction (all batches) and 1.5 is refused."""
    cfg = tiny_cfg("trainer.limit_val_batches=2.0")
    check_config(cfg)
    assert cfg.trainer.limit_val_batches == 2 and type(cfg.trainer.limit_val_batches) is int
    cfg = tiny_cfg("trainer.limit_val_batches=1.0")
    check_config(cfg)
    assert type(cfg.trainer.limit_val_batches) is float
    with pytest.raises(ConfigError, match=r"^trainer.limit_val_batches must be null .*got 1.5$"):
        check_config(tiny_cfg("trainer.limit_val_batches=1.5"))


def test_a_whole_float_number_of_devices_is_that_many(tiny_cfg):
    """``trainer=ddp_cpu trainer.devices=2.0`` was refused as 'must be a number of devices >= 1, ... got 2.0'."""
    cfg = tiny_cfg("trainer=ddp_cpu", "trainer.devices=2.0")
    check_config(cfg)
    assert cfg.trainer.devices == 2 and type(cfg.trainer.devices) is int


def test_a_time_written_unquoted_in_a_config_file_is_refused_not_read_as_base_60_steps(tmp_path, corpus):
    """``val_check_interval: 1:00:00:00`` in an experiment file composed as 216000 (YAML 1.1's base-60 integer) and
    trained as steps without a word (a 3-step run validated once, at its end); 216000 written as steps is taken."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from lit_dtrain.config_lightning import check_val_check_interval
    from tests.conftest import CONF_DIR

    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    for name, value in (("day", "1:00:00:00  # daily"), ("steps", "216000"), ("hours", "1:30:00")):
        (tmp_path / "conf" / "experiment" / f"{name}.yaml").write_text(
            f"# @package _global_\ntrainer:\n  val_check_interval: {value}\n")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfgs = [compose("train", [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"experiment={name}"],
                        return_hydra_config=True) for name in ("day", "steps", "hours")]
    try:
        HydraConfig.instance().set_config(cfgs[0])
        with pytest.raises(ConfigError) as refused:
            check_val_check_interval(cfgs[0])
        HydraConfig.instance().set_config(cfgs[1])
        check_val_check_interval(cfgs[1])
        HydraConfig.instance().set_config(cfgs[2])  # H:MM:SS: the quoted form it names is one that is taken
        with pytest.raises(ConfigError, match=r"quote it for a duration, val_check_interval: '00:01:30:00', or "):
            check_val_check_interval(cfgs[2])
        cfgs[2].trainer.val_check_interval = "00:01:30:00"
        check_val_check_interval(cfgs[2])
    finally:
        HydraConfig.instance().cfg = None
    day = tmp_path / "conf" / "experiment" / "day.yaml"
    assert str(refused.value) == (
        f"trainer.val_check_interval=216000 comes from {str(day)!r}, where it is written unquoted as 1:00:00:00, which "
        "YAML reads as the base-60 number 216000 (steps): quote it for a duration, val_check_interval: '1:00:00:00', "
        "or write 216000 for steps")
    assert cfgs[1].trainer.val_check_interval == 216000


def test_a_number_of_steps_given_on_the_command_line_is_not_refused_for_a_files_base_60_time(tmp_path):
    """`experiment=day trainer.val_check_interval=216000`, with day.yaml writing 1:00:00:00 unquoted: the command line
    sets the steps, yet it was refused as coming from day.yaml, the fix it named ('or write 216000 for steps') done."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from lit_dtrain.config_lightning import check_val_check_interval
    from tests.conftest import CONF_DIR

    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "day.yaml").write_text(
        "# @package _global_\ntrainer:\n  val_check_interval: 1:00:00:00\n")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=day",
                                "trainer.val_check_interval=216000"], return_hydra_config=True)
    try:
        HydraConfig.instance().set_config(cfg)
        check_val_check_interval(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert cfg.trainer.val_check_interval == 216000
