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
