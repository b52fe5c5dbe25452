"""How :mod:`lit_dtrain.config_keys` types one value: a path that must be text, a flag or number by a parameter's
annotation, a whole float an integer key takes, and the hint for a number read from the environment as text."""

from __future__ import annotations

import os
import re

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.args import is_flag, is_number, type_name

_WHOLE_FLOATS: dict[str, float] = {}  # key -> the whole float an integer key took as its integer, in this start


def as_integer(key: str, value: float) -> int:
    """``value``, a float that is exactly an integer (``1e3``, ``1.0``) given for the integer key ``key``, as that
    integer, remembered as given for :func:`as_given`: the checks after the conversion read the integer, so a refusal
    of ``data.block_size=1.0`` quoted ``data.block_size=1`` and ``decay_branch.steps=0.0`` 'got 0', values the user
    did not type."""
    _WHOLE_FLOATS[key] = value
    return int(value)


def forget_given_values() -> None:
    """Start a new record for :func:`as_integer` (each start of a run, each job of a sweep)."""
    _WHOLE_FLOATS.clear()


def as_given(message: str, node: str = "") -> str:
    """``message`` with each whole float it quotes as an integer said as given: ``data.block_size=1: ...`` gains
    ``(data.block_size was given as 1.0, read as the integer 1)``. A key counts as quoted where it is named whole, or
    its node and its own name are (``LossSpikeMonitor: warmup_steps must be ...`` of the ``node``
    ``callbacks.loss_spike``, which the line names first)."""
    def named(name: str, after: str = r"\w.") -> bool:  # (its own name after a class's: LlamaConfig.n_layer)
        return re.search(rf"(?<![{after}])" + re.escape(name) + r"(?![\w])", f"{node}: {message}") is not None

    notes = [f"{key} was given as {value!r}, read as the integer {int(value)}" for key, value in _WHOLE_FLOATS.items()
             if named(key) or "." in key and named(key.rpartition(".")[0]) and named(key.rpartition(".")[2], r"\w")]
    return f"{message} ({'; '.join(notes)})" if notes else message


def said_as_given(error: BaseException) -> None:
    """:func:`as_given` applied to a refusal's message in place: ``error``'s own, or that of the constructor's error
    that Hydra's ``instantiate`` wrapped (``data.batch_size=0.0``: ``data: data.batch_size must be >= 1, got 0``)."""
    from hydra.errors import InstantiationException

    node = ""
    if isinstance(error, InstantiationException) and error.__cause__ is not None:  # its 'full_key: <node>' line
        node = next((line[len("full_key: "):] for line in str(error).splitlines() if line.startswith("full_key: ")), "")
        error = error.__cause__
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (as_given(error.args[0], node),)


def _check_path(key: str, value, what: str) -> None:
    if isinstance(value, (str, os.PathLike)):  # (a Path set from Python)
        return
    shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
    quote = f" (a name that reads as a number: quote it, {key}=\"'{value}'\")" if isinstance(value, (int, float)) \
        and not isinstance(value, bool) else ""
    raise ConfigError(f"{key} must be {what}, got {shown!r} ({type(shown).__name__}){quote}")


def _flag_or_number(annotation) -> tuple[str, set] | None:
    """``("bool", allowed)`` for a parameter annotated ``bool`` (``allowed``: the other values it takes, such as
    None or a ``Literal`` like Lightning's ``deterministic="warn"``), ``("int", allowed)`` for ``int`` alone,
    ``("number", allowed)`` for ``float`` or ``int | float``, ``("text", allowed)`` for ``str`` alone; None for any
    other annotation."""
    import types
    import typing

    if annotation in (bool, str):
        return ("bool" if annotation is bool else "text"), set()
    if annotation is int:
        return "int", set()
    if annotation is float:
        return "number", set()
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(annotation)
    allowed = {None} if type(None) in args else set()
    rest = [a for a in args if a is not type(None)]
    literals = [a for a in rest if typing.get_origin(a) is typing.Literal]
    for literal in literals:
        allowed.update(typing.get_args(literal))
    plain = [a for a in rest if a not in literals]
    if plain in ([bool], [str]):
        return ("bool" if plain == [bool] else "text"), allowed
    if plain == [int] and not literals:
        return "int", allowed
    if plain and not literals and all(a in (int, float) for a in plain):
        return "number", allowed
    return None


def _env_hint(cfg: DictConfig, key: str, value) -> str:
    """For a number refused as text: where the key's value is ``${oc.env:X}`` (always text), the resolver that
    reads it as a number; ``""`` otherwise. ``trainer.max_steps=${oc.env:STEPS}`` was refused as 'must be an integer,
    got '8' (str)', naming no way to pass a number from the environment."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return _decode_hint(key, value, node._get_node(last)._value() if isinstance(node, DictConfig) else None)


def _decode_hint(key: str, value, raw) -> str:
    if not isinstance(value, str) or not isinstance(raw, str) or "${oc.env:" not in raw or "oc.decode" in raw:
        return ""
    decoded = "${oc.decode:" + raw.strip() + "}"
    return (f": ${{oc.env:...}} gives text; read it as a number with {decoded} (quoted on the command line: "
            f"{key}='{decoded}')")


def _check_value(full: str, annotation, value, raw=None) -> None:
    expected = _flag_or_number(annotation)
    if expected is None:
        return
    kind, allowed = expected
    if value is None and None in allowed or isinstance(value, str) and value in allowed:
        return
    others = "".join(" or null" if v is None else f" or {v!r}" for v in sorted(allowed, key=str))
    if kind == "text":  # a number taken as a name: optimizer_diagnostics.prefix=0 logged '0/decay/...', and
        if not isinstance(value, (str, os.PathLike)):  # loss_spike.path=0 (falsy) wrote the default spikes.jsonl
            _check_path(full, value, f"text{others}")
        return
    if kind == "bool" and not is_flag(value):
        raise ConfigError(f"{full} must be true or false{others}, got {value!r} ({type_name(value)})")
    if kind != "bool" and not is_number(value, integer=kind == "int"):
        what = "an integer" if kind == "int" else "a number"
        raise ConfigError(f"{full} must be {what}{others}, got {value!r} ({type_name(value)})"
                          f"{_decode_hint(full, value, raw)}")


def check_run_name(run_name) -> None:
    """A ``run_name`` that names no dir of its own under ``<log dir>/runs``: ``''`` or blank (the run wrote its
    checkpoints, ``summary.json`` and ``train.log`` into ``outputs/runs`` itself, beside every other run, exit 0), or
    one with a ``.`` or ``..`` part (``..``: into ``outputs``), or only slashes (``/``: into ``outputs/runs``, as the
    run dir is ``<log dir>/runs/${run_name}``). ``ConfigError`` saying so; for ``null`` too, which Hydra's dir reads as
    the name 'None' (a run_name=null run wrote runs/None, and the next one was refused there), not the default."""
    if run_name is None:
        raise ConfigError("run_name=null names the run dir 'None' (<log dir>/runs/None, shared by every such run), "
                          "not the default: leave run_name out for the start time, or give it a name, run_name=exp1")
    if isinstance(run_name, (bool, DictConfig, ListConfig, list, dict)):  # [1,2]: trained in runs/'[1, 2]'
        shown = OmegaConf.to_container(run_name) if isinstance(run_name, (DictConfig, ListConfig)) else run_name
        raise ConfigError(f"run_name must be a name (text), got {shown!r} ({type(shown).__name__})")
    parts = str(run_name).replace("\\", "/").split("/")
    if any(part.strip() for part in parts) and not any(part in (".", "..") for part in parts):
        return
    raise ConfigError(f"run_name={str(run_name)!r} names no run dir of its own (the run would write into the runs dir "
                      "or above it, beside other runs): give it a name, run_name=exp1, or leave it out for the start "
                      "time")


def check_datamodule_arguments(cfg: DictConfig) -> None:
    """``LMDataModule``'s own argument checks (``data.batch_size=0``, a source's ``weight=inf``, ``data.cache_dir=''``,
    ``data.sampler.min_prob=2``) with the config checks: it is built here once and dropped (its ``__init__`` and its
    samplers' read no file and draw nothing; the corpus is read in ``prepare_data``). They were refused as the run
    built it, after 'Seed set to 1337'; so were a corpus path that does not exist and a cache dir below a file
    (:func:`~lit_dtrain.data._datamodule_checks.check_source_paths`). A datamodule of one's own is checked as the
    run builds it (its ``__init__`` may do anything)."""
    node = cfg.get("data")
    if isinstance(node, DictConfig) and node.get("_target_") == "lit_dtrain.data.LMDataModule":
        from hydra.utils import instantiate

        from lit_dtrain.data._datamodule_checks import check_source_paths

        check_source_paths(instantiate(node, _convert_="all"))  # the same call as train()'s
