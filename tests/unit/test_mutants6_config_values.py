"""Exact results of the config value checks (lit_dtrain._config_values) where single-point mutants passed
test_config_values.py, test_config_value_forms.py, test_configs_bad_values.py (212 cases): the parameter kinds by
annotation, the oc.decode hint, the quote hint of a path, and the run names that name no run dir of their own."""

from __future__ import annotations

import re
from typing import Literal

import pytest
from omegaconf import OmegaConf

from lit_dtrain._config_values import _check_path, _decode_hint, _flag_or_number, check_run_name
from lit_dtrain.errors import ConfigError


@pytest.mark.parametrize("annotation, expected", [
    (int, ("int", set())),
    (int | None, ("int", {None})),
    (int | float, ("number", set())),
    (bool | Literal["warn"] | None, ("bool", {None, "warn"})),  # Lightning's deterministic
    (int | Literal["auto"], None),  # not int alone: the target judges it
    (float | Literal["auto"], None),
    (int | str, None),
])
def test_a_parameter_is_typed_by_its_annotation(annotation, expected):
    assert _flag_or_number(annotation) == expected


def test_the_decode_hint_is_for_an_environment_read_not_yet_decoded():
    said = _decode_hint("trainer.max_steps", "8", "${oc.env:STEPS}")
    assert said == (": ${oc.env:...} gives text; read it as a number with ${oc.decode:${oc.env:STEPS}} (quoted on the "
                    "command line: trainer.max_steps='${oc.decode:${oc.env:STEPS}}')")
    assert _decode_hint("trainer.max_steps", "abc", "${oc.decode:${oc.env:STEPS}}") == ""  # decoded: still text
    assert _decode_hint("trainer.max_steps", "8", "8") == ""


def test_a_number_for_a_path_is_told_to_quote_it_and_a_flag_is_not():
    with pytest.raises(ConfigError, match=r"^init_from must be a path, got 0 \(int\) \(a name that reads as a number: "
                                          r"quote it, init_from=\"'0'\"\)$"):
        _check_path("init_from", 0, "a path")
    with pytest.raises(ConfigError, match=r"^init_from must be a path, got True \(bool\)$"):
        _check_path("init_from", True, "a path")


@pytest.mark.parametrize("run_name", ["  ", "/", "..", "./x", "x/.", "..\\x", "a\\..\\b", " / "])
def test_a_run_name_that_names_no_run_dir_of_its_own_is_refused(run_name):
    with pytest.raises(ConfigError, match="^" + re.escape(f"run_name={run_name!r} names no run dir of its own")):
        check_run_name(run_name)


@pytest.mark.parametrize("run_name, shown", [
    (OmegaConf.create([1, 2]), "[1, 2] (list)"), (OmegaConf.create({"a": 1}), "{'a': 1} (dict)"), (True, "True (bool)"),
])
def test_a_run_name_that_is_no_name_is_refused(run_name, shown):
    """run_name=[1,2] trained in <log dir>/runs/'[1, 2]' and exited 0."""
    with pytest.raises(ConfigError, match="^" + re.escape(f"run_name must be a name (text), got {shown}") + "$"):
        check_run_name(run_name)


@pytest.mark.parametrize("run_name", ["exp1", "sweep/lr_3e-3", "a.b", "..x", "x..", 5])
def test_a_run_name_with_a_dir_of_its_own_passes(run_name):
    check_run_name(run_name)
