"""Forms of a value a user legitimately writes (a number from the environment, ...): each either works as meant or
is one ``ConfigError`` that says why and what to write instead."""

import pytest

from lit_dtrain.config_checks import check_config
from lit_dtrain.errors import ConfigError


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
    run validated at steps 4 and 8, val_loss 3.5852 as with integers)."""
    cfg = tiny_cfg("trainer.max_steps=1e3", "data.seed=3.0", "trainer.log_every_n_steps=5.0")
    check_config(cfg)
    got = (cfg.trainer.max_steps, cfg.data.seed, cfg.trainer.log_every_n_steps)
    assert got == (1000, 3, 5) and all(type(v) is int for v in got)
    for override, match in [("trainer.max_steps=1.5", r"^trainer.max_steps must be an integer, got 1.5 \(float\)$"),
                            ("data.seed=2.5", r"^data.seed must be an integer, got 2.5 \(float\)$"),
                            ("trainer.max_steps=-3.0", r"^trainer.max_steps must be a positive step budget, got -3$")]:
        with pytest.raises(ConfigError, match=match):
            check_config(tiny_cfg(override))

