"""The names a codec or local-update rule is given by: ``strategy.compressor: int8``, ``{name: topk, ratio: 0.05}``.

:func:`build_compressor` and :func:`build_local_update` turn an instance (passed through), a name in
:data:`COMPRESSORS` / :data:`LOCAL_UPDATES`, or a mapping ``{"name": ..., **kwargs}`` into the object. Used by
:class:`~lit_dtrain.strategies.compressed_ddp.CompressedDDPStrategy`, by ``DiLoCo`` for its pseudo-gradient
compressor, and by the benchmark scripts.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig

from lit_dtrain.config_keys import accepted_arguments, check_argument_types
from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies.compressors import Compressor
from lit_dtrain.strategies.local_updates import DiLoCo, LocalSGD, LocalUpdate
from lit_dtrain.strategies.powersgd import PowerSGD
from lit_dtrain.strategies.quantize import BlockQuantizer, HalfPrecision, NoCompression
from lit_dtrain.strategies.sharded_quant import ShardedBlockQuantizer
from lit_dtrain.strategies.sparsify import ScaledSign, TopK


class Preset:
    """A registry name for ``cls`` with ``fixed`` arguments (``int8``: ``bits=8``, not to be given again) and
    ``defaults`` (``int4``: error feedback on, as its preset and docs)."""

    def __init__(self, cls: type, fixed: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> None:
        self.cls, self.fixed, self.defaults = cls, dict(fixed), dict(defaults or {})

    def __call__(self, **kwargs: Any):
        return self.cls(**{**self.defaults, **kwargs, **self.fixed})


COMPRESSORS: dict[str, Callable[..., Compressor]] = {
    "none": NoCompression,
    "fp16": Preset(HalfPrecision, {"dtype": "fp16"}),
    "bf16": Preset(HalfPrecision, {"dtype": "bf16"}),
    "int8": Preset(BlockQuantizer, {"bits": 8}),
    "int4": Preset(BlockQuantizer, {"bits": 4}, {"error_feedback": True}),
    "int8_rs": Preset(ShardedBlockQuantizer, {"bits": 8}),
    "int4_rs": Preset(ShardedBlockQuantizer, {"bits": 4}, {"error_feedback": True}),
    "powersgd": PowerSGD,
    "topk": TopK,
    "sign": ScaledSign,
}
LOCAL_UPDATES: dict[str, Callable[..., LocalUpdate]] = {
    "local_sgd": LocalSGD,
    "local_sgd_adaptive": Preset(LocalSGD, {"adaptive": True}),
    "diloco": DiLoCo,
}


def _class_and_fixed(factory: Callable) -> tuple[type, dict[str, Any]]:
    """The class a registry entry builds, and the arguments its name fixes."""
    return (factory.cls, factory.fixed) if isinstance(factory, Preset) else (factory, {})


def _did_you_mean(word: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


def _build(spec: Any, registry: Mapping[str, Callable], base: type, what: str, path: str):
    if spec is None or isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"{path} must be a {base.__name__}, a name in {sorted(registry)} or a mapping with 'name', "
                         f"got {spec!r}")
    kwargs = {str(k): v for k, v in spec.items()}
    name = kwargs.pop("name")
    if name not in registry:
        raise ValueError(f"{path}: unknown {what} {name!r}; expected one of {sorted(registry)}"
                         f"{_did_you_mean(str(name), registry)}")
    factory = registry[name]
    cls, fixed = _class_and_fixed(factory)
    accepted = accepted_arguments(cls)
    if accepted is not None:  # a key the class takes no argument for: its TypeError named neither the key's place
        # nor the right key (and under train.py it came out of Hydra's instantiate wrapper)
        for key in kwargs:
            if key in fixed:
                raise ValueError(f"{path}.{key}: the {what} {name!r} sets {key}={fixed[key]!r} itself")
            if key not in accepted:
                raise ValueError(f"{path}.{key} is not an argument of the {what} {name!r} ({cls.__name__})"
                                 f"{_did_you_mean(key, accepted, f'{path}.')}")
    # flags and numbers by the class's annotations, in Python as from a config: {"error_feedback": "no"} was true
    kwargs.update(check_argument_types(cls, {k: v for k, v in kwargs.items() if not isinstance(v, Mapping)}, path))
    if base is LocalUpdate and isinstance(kwargs.get("compressor"), (str, Mapping)):  # DiLoCo's: its errors named
        kwargs["compressor"] = build_compressor(kwargs["compressor"], f"{path}.compressor")  # 'compressor.<key>'
    return factory(**kwargs)


def build_compressor(spec: Compressor | str | Mapping | None, path: str = "compressor") -> Compressor | None:
    """A compressor from an instance, a name (``"powersgd"``) or ``{"name": ..., **kwargs}``; a ValueError names
    ``path`` (the key the spec was given as) and a close match of an unknown name or argument."""
    return _build(spec, COMPRESSORS, Compressor, "compressor", path)


def build_local_update(spec: LocalUpdate | str | Mapping | None, path: str = "local_update") -> LocalUpdate | None:
    """A local-update rule from an instance, a name (``"diloco"``) or ``{"name": ..., **kwargs}`` (errors as
    :func:`build_compressor`'s)."""
    return _build(spec, LOCAL_UPDATES, LocalUpdate, "local-update rule", path)


def check_strategy_specs(cfg: DictConfig) -> None:
    """A :class:`ConfigError` naming the key for a codec or local-update rule given by name or mapping in
    ``cfg.strategy`` (``strategy.compressor: {name: topk, ratoi: 0.01}``) that cannot be built: before, a TypeError
    of the codec's class inside Hydra's instantiate wrapper (``full_key: strategy``). ``_target_`` nodes are
    :func:`~lit_dtrain.config_keys.check_target_arguments`'; a mapping inside one (DiLoCo's ``compressor``) is here."""
    from omegaconf import OmegaConf

    from lit_dtrain.strategies.by_name import _config_timeout
    from lit_dtrain.strategies.comm import BOTH_MODES
    from lit_dtrain.strategies.compressed_ddp import CompressedDDPStrategy

    node = cfg.get("strategy")
    # the strategy (or Lightning's, for a name) is built after the seed: strategy.collective_timeout_s=-5 and a
    # compressor beside a local-update rule were refused there, after 'Seed set to 1337'
    for key in ("collective_timeout_s", "connect_timeout_s") if isinstance(node, DictConfig) else ():
        if key in node:
            _config_timeout(node[key], key)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    local = node.get("local_update")
    target = node.get("_target_")
    if local is not None and node.get("compressor") is not None and isinstance(target, str) and \
            target.rpartition(".")[2] == CompressedDDPStrategy.__name__:
        raise ConfigError(f"strategy: {BOTH_MODES}")
    checks = [("strategy.compressor", node.get("compressor"), build_compressor),
              ("strategy.local_update", local, build_local_update)]
    if isinstance(local, DictConfig):
        checks.insert(1, ("strategy.local_update.compressor", local.get("compressor"), build_compressor))
    for path, spec, build in checks:
        if isinstance(spec, DictConfig) and "_target_" in spec and "name" in spec:
            raise ConfigError(f"{path} holds the preset's _target_ ({spec._target_}) and a name ({spec.name!r}): a "
                              f"mapping added with '+' merged into the preset's node; replace the node: "
                              f"'~{path}' '+{path}={{name: {spec.name}, ...}}', or {path}={spec.name}")
        if isinstance(spec, DictConfig) and "_target_" in spec or spec is None:
            continue
        try:  # build checks the mapping's flags and numbers as check_target_arguments a _target_ node's
            build(OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else spec, path)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
