"""Which keys a composed config may hold, and the types of their values, checked before any compute.

- :func:`check_known_keys`: a key lit_dtrain does not read, at the root or in a plain section of conf/train.yaml
  (``CONFIG_KEYS``);
- :func:`check_types`: numbers that must be numbers (and finite), flags that must be booleans, paths that must be
  text;
- :func:`check_target_arguments`: the flags and numbers of every ``_target_`` node, by its class's annotations, and
  a key its class takes no argument for (:func:`check_target_keys`).

``lit_dtrain.config_checks.check_config`` runs them; they are importable from there too.
"""

from __future__ import annotations

import math
import numbers
import os
import re

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain._config_values import _check_path, _check_value, _env_hint, _flag_or_number, as_integer
from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.args import as_flag, is_flag, is_number, is_whole_float, type_name

_NUMERIC_KEYS = {  # key -> the type it must have (an override like trainer.max_steps=abc arrives as a string)
    "optimizer.lr": float, "trainer.max_steps": int,  # trainer.val_check_interval: config_lightning's
    "trainer.accumulate_grad_batches": int, "trainer.log_every_n_steps": int, "trainer.gradient_clip_val": float,
    # model.block_size before data.block_size, its interpolation: model.block_size=abc was named as data.block_size
    "data.batch_size": int, "model.block_size": int, "data.block_size": int, "seed": int,
    "optimizer.weight_decay": float, "optimizer.eps": float, "data.val_fraction": float,
    "data.max_val_windows": int, "data.val_batch_size": int, "model.vocab_size": int, "model.n_layer": int,
    "model.n_head": int, "model.n_kv_head": int, "model.d_model": int, "model.mlp_hidden": int,
    "model.rope_theta": float, "model.norm_eps": float, "model.init_std": float, "model.dropout": float,
    # whole before check_config compares them: +trainer.min_steps=1e9 was refused as 'min_steps=1000000000.0'
    "trainer.min_steps": int, "trainer.min_epochs": int, "trainer.max_epochs": int,
    # the same: num_sanity_val_steps=-2.0 passed the bound (-2: refused) and trained with no sanity validation
    "trainer.num_sanity_val_steps": int,
}


# numbers that have no "null" meaning: model.n_layer=null (or model.dropout=abc) failed in Hydra's wrapper of
# build_llama with "TypeError: '<=' not supported between instances of 'NoneType' and 'int'", naming only the node
# (full_key: model); optimizer.eps=null was "optimizer: '<=' not supported ...", naming neither key nor fix
_NOT_NULL_KEYS = ("model.vocab_size", "model.block_size", "model.n_layer", "model.n_head", "model.n_kv_head",
                  "model.d_model", "model.rope_theta", "model.norm_eps", "model.init_std", "model.dropout",
                  "optimizer.eps", "optimizer.weight_decay")


# numbers that must be finite: lr=inf (or weight_decay=inf) made the first update inf, and the run stopped a step
# later with a NonFiniteError blaming the gradients and saying the weights were still finite; rope_theta=inf and
# init_std=inf build a model that cannot train. gradient_clip_val=inf is a valid "no clipping".
_FINITE_KEYS = ("optimizer.lr", "optimizer.weight_decay", "optimizer.eps", "model.rope_theta", "model.norm_eps",
                "model.init_std")


_BOOL_KEYS = (  # read with `if value:`, so a string (compile=off, check_finite=no) would count as true, and null
    # as false: module.check_finite=null trained with the check off, model.tie_embeddings=null untied, silently
    "module.compile", "module.check_finite", "model.tie_embeddings", "model.depth_scaled_init", "data.progress",
)


# The keys of conf/train.yaml that are no class's arguments: its config groups, its own keys, and the keys of its plain
# sections (test_configs_keys.py keeps this in step with the file). Hydra refuses an unknown key on the command
# line (struct mode), but a config file (an experiment, @package _global_) adds one without a word: `init_form:` there
# trained from scratch, `sample: {promt: ...}` or `decay_branch: {step: ...}` did nothing. A _target_ node's unknown
# key is check_target_keys' (its target takes no such argument); paths.* stays open for a user's own interpolations.
CONFIG_KEYS = {
    "": ("model", "data", "optimizer", "scheduler", "callbacks", "strategy", "trainer", "logger", "paths", "hydra",
         "experiment", "seed", "run_name", "ckpt_path", "resume", "init_from", "decay_branch", "matmul_precision",
         "module", "sample"),
    "decay_branch": ("ckpt", "steps"),
    "module": ("compile", "check_finite"),
    "sample": ("prompt", "max_new_tokens", "temperature", "top_k", "top_p"),
}


# A group's option without _target_ is read by name: strategy=auto's `name` (a Lightning strategy name) and
# `collective_timeout_s`, and logger=none holds nothing. `+strategy.nme=ddp` (or `strategy: {nme: ddp}` in an
# experiment file) trained with 'auto' and exited 0.
_PLAIN_GROUP_KEYS = {"strategy": ("name", "collective_timeout_s", "connect_timeout_s"), "logger": ()}


# Trainer arguments that train.py passes itself, each with how to set it: Hydra's instantiate lets them win over the
# trainer node's, so '+trainer.strategy=ddp' (which the unknown-key line advised for trainer.strategy=ddp) trained
# on one process and '+trainer.logger=false' still wrote TensorBoard events, both with exit status 0
TRAINER_ARGS_OF_TRAIN_PY = {
    "strategy": "choose it with 'strategy=<option of conf/strategy>' (or 'strategy.name=<Lightning's name>' under "
                "strategy=auto)",
    "callbacks": "choose them with 'callbacks=[default,<option of conf/callbacks>]'",
    "logger": "choose it with 'logger=<option of conf/logger>' (logger=none: no logger)",
    "plugins": "train.py passes its own (atomic checkpoint writes, SLURM's environment)",
}


def trainer_arg_of_train_py(key: str) -> str | None:
    """The refusal of ``trainer.<key>`` for a Trainer argument that train.py passes itself (it would be ignored), else
    None."""
    if key not in TRAINER_ARGS_OF_TRAIN_PY:
        return None
    return f"trainer.{key} is passed to the Trainer by train.py, so a value here would be ignored: " \
        f"{TRAINER_ARGS_OF_TRAIN_PY[key]}"


def check_known_keys(cfg: DictConfig) -> None:
    """:class:`ConfigError` naming a key that lit_dtrain does not read, at the root or in a plain section of
    conf/train.yaml (see ``CONFIG_KEYS``), or in a strategy or logger without ``_target_``, unless an interpolation
    reads it: a typo in a config file must not fall back silently to the default."""
    import difflib

    # a key that an interpolation reads is read: a config's own variable (`d: 256`, `model.d_model: ${d}`)
    text = OmegaConf.to_yaml(cfg, resolve=False)
    if isinstance(trainer := cfg.get("trainer"), DictConfig):
        for key in map(str, trainer.keys()):
            if refusal := trainer_arg_of_train_py(key):
                raise ConfigError(refusal)
    for section, known in {**CONFIG_KEYS, **_PLAIN_GROUP_KEYS}.items():
        node = cfg if not section else cfg.get(section)
        if not isinstance(node, DictConfig) or section in _PLAIN_GROUP_KEYS and "_target_" in node:
            continue
        for key in map(str, node.keys()):
            full = f"{section}.{key}" if section else key
            if key in known or re.search(r"\$\{\s*" + re.escape(full) + r"\s*[.}\[]", text):
                continue
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {(f'{section}.' if section else '') + close[0]!r}?" if close else ""
            where = f"{section} holds only" if section else "the top level holds only"
            holds = f"{where} {', '.join(sorted(known))}" if known else f"{section} without _target_ holds no keys"
            raise ConfigError(f"unknown config key {full!r} (set in a config file, or added with '+'): lit_dtrain "
                              f"does not read it, so it would be ignored{hint} ({holds})")


# paths, each with whether null is allowed: ckpt_path=[] or init_from=0 (falsy) trained from scratch, silently;
# data.cache_dir=0 (or null) failed in the token cache's build with "TypeError: expected str, bytes or os.PathLike
# object, not int", data.exclude_dirs=[-1] in Hydra's wrapper of the datamodule, naming only 'full_key: data'
_PATH_KEYS = {"ckpt_path": True, "init_from": True, "decay_branch.ckpt": True, "data.cache_dir": False,
              "data.exclude_dirs": True, "trainer.default_root_dir": True, "logger.save_dir": False,
              "logger.name": True}  # logger.save_dir=0: a TypeError in Hydra's wrapper; logger.name=-1 one in setup


_ABSENT = object()  # OmegaConf.select's default for a key the config does not hold (null is a value)


def check_types(cfg: DictConfig) -> None:
    """Numbers must be numbers, flags booleans and paths text: name the key and the value instead of failing later
    in a comparison, or reading 'off' as true (or a list as no checkpoint)."""
    for key in _BOOL_KEYS:
        node = OmegaConf.select(cfg, key, default=_ABSENT)
        if node is not _ABSENT and not is_flag(node):
            raise ConfigError(f"{key} must be true or false, got {node!r} ({type_name(node)})")
    for key, kind in _NUMERIC_KEYS.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is _ABSENT or value is None and key not in _NOT_NULL_KEYS:
            continue
        if kind is int and is_whole_float(value):  # 1e3 in YAML or on the command line: 1000.0, refused as 'must be
            value = as_integer(key, value)  # an integer' (check_int's rule for the Python API: a whole float)
            OmegaConf.update(cfg, key, value)
        if not is_number(value, integer=kind is int):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{key} must be {what}, got {value!r} ({type_name(value)}){_env_hint(cfg, key, value)}")
        if key in _FINITE_KEYS and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    for key, nullable in _PATH_KEYS.items():
        try:
            value = OmegaConf.select(cfg, key, default=_ABSENT)
        except Exception:  # ${lit.required:...} (experiment=cpt_replay's init_from): train() names what to give
            continue
        if value is _ABSENT or value is None and nullable:
            continue
        if key == "data.exclude_dirs":  # a list of dirs, or one dir
            if isinstance(value, ListConfig) and all(isinstance(entry, (str, os.PathLike)) for entry in value):
                continue
            what = "a list of paths (text), one path or null"
        else:
            what = "a path (text) or null" if nullable else "a path (text)"
        _check_path(key, value, what)
        if key == "logger.save_dir" and not str(value).strip():  # '' logged to ./tb or ./csv of the working dir
            raise ConfigError(f"logger.save_dir is empty ({value!r}), which puts the logs in the working dir, not "
                              "the run dir: leave it at its default, ${paths.output_dir} (the run dir), or give a "
                              "dir")


# Where a **kwargs goes that is not to the parent class's __init__: a strategy's, to the module wrapper it builds in
# setup (Lightning's DDPStrategy and FSDPStrategy); lit_dtrain's factories', to the class they build.
_KWARGS_GO_TO = {
    "lightning.pytorch.strategies.ddp.DDPStrategy": "torch.nn.parallel.DistributedDataParallel",
    "lightning.pytorch.strategies.fsdp.FSDPStrategy": "torch.distributed.fsdp.FullyShardedDataParallel",
    "lit_dtrain.strategies.make_ddp": "lightning.pytorch.strategies.DDPStrategy",
    "lit_dtrain.strategies.make_fsdp": "lightning.pytorch.strategies.FSDPStrategy",
    "lit_dtrain.models.build_llama": "lit_dtrain.models.llama.LlamaConfig",
}


# Keywords a strategy passes to that wrapper itself (lightning 2.6: DDPStrategy._setup_model and FSDPStrategy's), so not
# ones to give it: make_ddp(device_ids=[0]) (or +strategy.device_ids=[0]) passed the checks and failed in fit, after the
# ranks had started, with "DistributedDataParallel() got multiple values for keyword argument 'device_ids'"
_SET_BY_THE_STRATEGY = {
    "torch.nn.parallel.DistributedDataParallel": {"module": "the model", "device_ids": "the rank's device"},
    "torch.distributed.fsdp.FullyShardedDataParallel": {"module": "the model", "device_id": "the rank's device"},
}


def accepted_arguments(target) -> set[str] | None:
    """The keyword arguments that ``target`` (a class or a function) takes, following a ``**kwargs`` to the parent
    class's ``__init__`` or to where ``_KWARGS_GO_TO`` says it goes; None where a ``**kwargs`` goes elsewhere."""
    return _arguments(target)[0]


def _arguments(target) -> tuple[set[str] | None, dict[str, str]]:
    """:func:`accepted_arguments`, and the keywords of a wrapper that the strategy passing ``**kwargs`` to it sets
    itself (``_SET_BY_THE_STRATEGY``), each with what the strategy passes in a few words."""
    import inspect

    from hydra.utils import get_object

    accepted: set[str] = set()
    set_by_caller: dict[str, str] = {}
    skip: dict[str, str] = {}
    while target is not None:
        owner = next((c for c in target.__mro__ if "__init__" in vars(c)), object) if isinstance(target, type) else None
        fn = owner.__init__ if owner is not None else target
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: its call names a bad key itself
            return None, set_by_caller
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        wrapper = getattr(target, "__name__", "")
        set_by_caller.update((k, f"{v}, to {wrapper}") for k, v in skip.items() if k in names and k not in accepted)
        accepted |= names - set(skip)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return accepted, set_by_caller
        source = owner if owner is not None else target
        name = _KWARGS_GO_TO.get(f"{source.__module__}.{source.__qualname__}")
        skip = _SET_BY_THE_STRATEGY.get(name, {}) if name is not None else {}
        if name is not None:
            target = get_object(name)
        elif owner is not None and owner is not object:
            target = next((c for c in owner.__mro__[1:] if "__init__" in vars(c) and c is not object), None)
        else:
            target = None
    return None, set_by_caller


def _not_accepted(key: str, accepted: set[str], set_by_caller: dict[str, str], prefix: str = "") -> str:
    """The end of the error for a keyword not in ``accepted``: who sets it, or the closest accepted one."""
    import difflib

    if key in set_by_caller:
        return f"; Lightning's strategy passes {key} itself ({set_by_caller[key]}): leave it out"
    close = difflib.get_close_matches(key, sorted(accepted), n=1)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


# What a strategy factory sets on the strategy itself, and the argument that gives it: make_fsdp(timeout=...) (or
# +strategy.timeout=60 with strategy=fsdp) failed with Hydra's 'Error in call to target' block around
# "EvenEpochsFSDPStrategy() got multiple values for keyword argument 'timeout'"; make_ddp's said what to pass
TIMEOUT_INSTEAD = {"timeout": "collective_timeout_s (seconds)"}


def refuse_unknown_keywords(target, kwargs: dict, name: str, goes_to: str, instead: dict[str, str] | None = None
                            ) -> None:
    """:class:`ConfigError` for a keyword of a strategy built in Python that neither ``target`` nor where its
    ``**kwargs`` go (``goes_to``) takes, or that the strategy sets on the wrapper itself (``device_ids``): Lightning
    hands them to the module wrapper in setup, so a misspelt one (``make_ddp(find_unused_parameter=True)``) failed in
    fit, after the ranks had started, as DistributedDataParallel's TypeError. (``train.py`` refuses such a config key
    before: :func:`check_target_keys`.) ``instead``: keywords ``target`` sets itself, each with the argument to pass
    instead (:data:`TIMEOUT_INSTEAD`): a ``ValueError``, which ``train.py`` prefixes with the config node
    (``error: strategy: make_fsdp: pass collective_timeout_s (seconds) instead of timeout``)."""
    for key, argument in (instead or {}).items():
        if key in kwargs:
            raise ValueError(f"{name}: pass {argument} instead of {key}")
    accepted, set_by_caller = _arguments(target)
    for key in [] if accepted is None else [k for k in kwargs if k not in accepted]:
        what = f"an argument {name} takes" if key in set_by_caller else \
            f"an argument of {name}, nor of {goes_to} (which take its other keywords)"
        raise ConfigError(f"{name}: {key!r} is not {what}{_not_accepted(key, accepted, set_by_caller)}")


def check_target_keys(node: DictConfig, path: str, target) -> None:
    """:class:`ConfigError` naming a key of a ``_target_`` node that its target takes no argument for. Hydra
    refuses an unknown key only on the command line: one added with '+' or in a config file failed at
    instantiation in Hydra's wrapper, and a strategy's (``+strategy.compresion=int8``) only in fit, after the token
    cache was built, as DistributedDataParallel's TypeError naming neither ``strategy`` nor the key."""
    accepted, set_by_caller = _arguments(target)
    if accepted is None:  # a **kwargs that goes somewhere this cannot follow: the target names it itself
        return
    for key in map(str, node.keys()):
        if key.startswith("_") or key in accepted:
            continue
        full = f"{path}.{key}" if path else key
        hint = _not_accepted(key, accepted, set_by_caller, f"{path}." if path else "")
        raise ConfigError(f"{full} is not an argument of {node._target_}{hint}")


def check_target_arguments(cfg: DictConfig, node=None, path: str = "") -> None:
    """Flags and numbers of every ``_target_`` node (data, callbacks, sampler, strategy and codecs, Trainer): a value
    whose parameter is annotated ``bool`` must be a boolean, one annotated ``int`` an integer, one annotated as a
    number a number; null only where the annotation allows None. Constructors read flags with ``bool(value)`` or
    ``if value:``, so ``error_feedback=no``, ``check_grad=off`` or ``stages=maybe`` (strings) counted as true,
    silently; a string where a number belongs failed in a comparison that named neither key nor value. They read
    integers with ``int(value)``: ``data.seed=1.5`` trained as seed 1 and ``data.seed=true`` as 1, silently, and
    ``data.seed=null`` failed in Hydra's wrapper naming only the node (``full_key: data``)."""
    from lit_dtrain._target_import import import_target

    node = cfg if node is None else node
    if isinstance(node, ListConfig):
        for i in range(len(node)):
            child = node._get_node(i)
            if isinstance(child, (DictConfig, ListConfig)):
                check_target_arguments(cfg, child, f"{path}.{i}" if path else str(i))
        return
    if not isinstance(node, DictConfig):
        return
    hints: dict = {}
    if "_target_" in node:  # an unimportable one: one line, before the seed (Hydra's several, as it was built)
        target = import_target(node._target_, path)
        check_target_keys(node, path, target)
        hints = _argument_hints(target)
    for key in node.keys():  # a key as given: {0: 2} has the integer 0, which node._get_node('0') does not find
        if str(key).startswith("_") or OmegaConf.is_missing(node, key):
            continue
        child, full = node._get_node(key), f"{path}.{key}" if path else str(key)
        if isinstance(child, (DictConfig, ListConfig)):
            # a list for a flag or number: optimizer.fused=[] trained as fused=False, silently
            if _flag_or_number(hints.get(key)) is not None:
                _check_value(full, hints.get(key), OmegaConf.to_container(child))
            check_target_arguments(cfg, child, full)
            continue
        if _flag_or_number(hints.get(key)) is not None:  # read only then: an interpolation may refuse to resolve
            if _flag_or_number(hints.get(key))[0] == "int" and is_whole_float(node[key]):  # as check_types'
                node[key] = as_integer(full, node[key])
            _check_value(full, hints.get(key), node[key], child._value())


def check_argument_types(target, arguments, path: str) -> dict:
    """:func:`check_target_arguments`' check of flags and numbers for the keyword arguments ``arguments`` (a mapping)
    of the class or function ``target``, named ``path.<key>``: a codec given in Python as ``{"name": "topk",
    "error_feedback": "no"}`` is checked as the same mapping in a config. Returns ``arguments`` with a numpy number
    where an integer or a number is asked (``np.int64(2)``, a value read from an array) as Python's ``int`` or
    ``float``: it was refused ('must be an integer, got np.int64(2)'), and kept it would reach the object's state;
    and numpy's bool where a flag is asked as Python's (it was refused as 'got np.True_ (bool)')."""
    hints = _argument_hints(target)
    checked = dict(arguments)
    for key, value in arguments.items():
        _check_value(f"{path}.{key}", hints.get(key), value)
        if is_number(value) and not isinstance(value, (int, float)):
            checked[key] = int(value) if isinstance(value, numbers.Integral) else float(value)
        checked[key] = as_flag(checked[key])
    return checked


def _argument_hints(target) -> dict:
    """The annotations of ``target``'s arguments, and of the parent ``__init__`` its ``**kwargs`` go to: a subclass
    that passes them on (``ShardedBlockQuantizer(bits=8, **kwargs)``) left its parent's flags unchecked, so
    ``strategy=ddp_compressed/int8_rs strategy.compressor.error_feedback=abc`` trained with error feedback on."""
    import inspect
    from typing import get_type_hints

    hints: dict = {}
    while target is not None:
        fn = target.__init__ if isinstance(target, type) else target
        try:
            own = get_type_hints(fn)
            params = inspect.signature(fn).parameters.values()
        except Exception:  # unresolvable hints: nothing more to check
            return hints
        hints = {**own, **hints}  # the nearer class's annotation wins
        if not isinstance(target, type) or not any(p.kind is p.VAR_KEYWORD for p in params):
            return hints
        owner = next((c for c in target.__mro__ if "__init__" in vars(c)), object)
        target = next((c for c in owner.__mro__[1:] if "__init__" in vars(c) and c is not object), None)
    return hints


