"""``~key`` on the command line (Hydra's deletion) of a key lit_dtrain needs: one line naming it and the fix.

A removed section failed later with OmegaConf's ``Key 'optimizer' is not in struct`` traceback; a removed value of a
section that is instantiated (``~optimizer.lr``, ``~data.batch_size``, ``~model.n_layer``, ``~data.sources``,
``~scheduler.warmup_steps``, a callback's ``~callbacks.model_checkpoint.monitor``, ``~data.sampler.<x>``,
``~strategy.<x>``, ``~strategy.compressor.<x>``) trained silently with the class's own default instead (AdamW's lr
1e-3 for the config's 3e-3: val loss 5.5324 for 5.4665 after one tiny step; ``~data.sources`` of ``data=textfiles``
trained on the stdlib corpus; no warmup, step 0 at the peak LR 3e-3 for the config's 1.5e-3 of 20 steps; the newest
checkpoint kept as the 'best'; ``strategy=ddp_compressed/int4 '~strategy.compressor.bits'`` trained with
``BlockQuantizer(bits=8)``), and ``~trainer.max_steps`` was refused as ``got -1``, Lightning's default. Removing
what is meant to be optional stays allowed: ``~scheduler``, ``~sample``, ``~logger``, ``~callbacks.<name>``,
``~strategy.compressor`` and ``~strategy.local_update`` (re-added with ``+``) and ``_target_``-style keys. A primary
config without a section lit_dtrain needs (``--config-name experiment/wsd_vs_cosine``, a partial config: OmegaConf's
``Key 'optimizer' is not in struct`` traceback) is refused in one line too.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_dtrain._compose_errors import file_config_dirs, group_options_in, read_config_file
from lit_dtrain.errors import ConfigError
from lit_dtrain.sweep_grid import sweep_task, unresolved

_SECTIONS = {"model": "choose an option instead (model=nano)", "data": "choose an option instead (data=stdlib)",
             "optimizer": "choose an option instead (optimizer=adamw)",
             "trainer": "choose an option instead (trainer=default)",
             "paths": "leave it in and set its keys (LIT_DTRAIN_OUTPUT, LIT_DTRAIN_CACHE)",
             "module": "leave it in and set its keys (module.compile=true)", "seed": "set it instead (seed=1337)"}
_LEAVES_OF = ("model", "data", "optimizer", "trainer")
_ABSENT = object()
_PATHS = {"log_dir": "the root of run dirs", "output_dir": "the run dir", "checkpoint_dir": "where checkpoints go",
          "cache_dir": "the token caches"}
# removed to be re-added in another form ('~strategy.compressor' '+strategy.compressor={name: topk, ...}')
_SWAPPED = ("strategy.compressor", "strategy.local_update")


def _removed(override: str) -> str | None:
    if not override.startswith("~"):
        return None
    return override[1:].split("=", 1)[0].strip()


def added_with_plus(key: str) -> str | None:
    """This start's command-line override that added ``key`` with ``+`` or ``++`` (``'++scheduler.decay_fraction=0.2'``,
    as typed), else None (also outside Hydra): the fix for such a key the config cannot take is to remove that
    override, not '~key' (Hydra refuses to delete a key the config itself does not hold). In a multirun, the line of
    the ``-m`` arguments (``multirun.yaml``): a job's own, '++scheduler.decay_fraction=0.1' of
    '++scheduler.decay_fraction=0.1,0.2', was not on the command line."""
    from hydra.core.hydra_config import HydraConfig

    from lit_dtrain.sweeps import in_multirun

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    for lines in ([sweep_task(hc)] if in_multirun() else []) + [unresolved(hc.overrides.task)]:
        added = [o for o in lines if (o.startswith("+") and _plus_key(o) == key) or _in_its_mapping(o, key)]
        if added:
            return added[-1]
    return None


def _plus_key(override: str) -> str:
    return override.lstrip("+").split("=", 1)[0].strip()


def _in_its_mapping(override: str, key: str) -> bool:
    """Whether ``override`` adds ``key`` inside the mapping it gives a node above it with '+' or '++'
    (``'++scheduler={decay_fraction:0.2}'`` adds ``scheduler.decay_fraction``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parent = _plus_key(override)
    if not override.startswith("+") or not key.startswith(parent + "."):
        return False
    try:  # a sweep's mappings, each a job's ('++scheduler={decay_fraction:0.1},{decay_fraction:0.2}' of a -m)
        parsed = OverridesParser.create().parse_override(override)
        values = list(parsed.sweep_iterator()) if parsed.is_sweep_override() else [parsed.value()]
    except (HydraException, ValueError, TypeError):
        return False
    return any(_holds(value, key[len(parent) + 1:].split(".")) for value in values)


def _holds(value, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def _experiment_setting(key: str) -> str | None:
    """``experiment=<name>`` where this run's experiment file (``@package _global_``, in a file config source) sets
    ``key`` as well as a '+' override: removing the override alone left the experiment's value, refused at the next
    start (``experiment=cpt_replay scheduler=cosine ++scheduler.decay_fraction=0.3`` took two starts to fix)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or not (name := HydraConfig.get().runtime.choices.get("experiment")):
        return None
    for config_dir in file_config_dirs():
        path = Path(config_dir, "experiment", f"{name}.yaml")
        if not path.is_file():
            continue
        node, package = read_config_file(path)
        if node is not None and package == "_global_" and OmegaConf.select(node, key, default=None) is not None:
            return f"experiment={name}"
        return None
    return None


def removal_fixes(node_key: str, args: list[str]) -> tuple[list[str], bool]:
    """How to take the keys ``args`` of ``node_key`` out of this start's config, and whether one came from a config
    file: '~<key>' for a config file's (an experiment's); for one added with '+' or '++', removing that override as
    typed (Hydra refuses to delete a key the config itself does not hold), or the key from the mapping such an override
    gives a node ('++scheduler={decay_fraction:0.2}', which was told '~scheduler.decay_fraction' and taken for an
    experiment's setting)."""
    drops, typed, inside, fixes_first = [], [], {}, []
    for arg in args:
        line = added_with_plus(f"{node_key}.{arg}")
        if line is None:
            drops.append(f"'~{node_key}.{arg}'")
        elif (experiment := _experiment_setting(f"{node_key}.{arg}")) and _plus_key(line) != f"{node_key}.{arg}":
            # a mapping's key: replacing the whole line dropped its other keys ('{decay_fraction:0.3,warmup_steps:1}')
            fixes_first.append(f"remove {arg} from {line!r} and add '~{node_key}.{arg}' ({experiment} sets it too)")
        elif experiment:  # removing the override alone: a 2nd error
            fixes_first.append(f"replace {line!r} with '~{node_key}.{arg}' ({experiment} sets it too)")
        elif _plus_key(line) == f"{node_key}.{arg}":
            typed.append(repr(line))
        else:
            inside.setdefault(line, []).append(arg)
    fixes = fixes_first + ([f"drop {'it' if len(drops) == 1 else 'them'} with {' '.join(drops)}"] if drops else [])
    fixes += [f"remove {' '.join(typed)} from the command line"] if typed else []
    fixes += [f"remove {' and '.join(keys)} from {line!r} on the command line" for line, keys in inside.items()]
    return fixes, bool(drops)


def _an_argument_of_its_target(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` (``scheduler.<x>``, ``callbacks.<name>.<x>``, ``data.sampler.<x>``, ``strategy.<x>``,
    ``strategy.compressor.<x>``: any node with a ``_target_``; ``data.sources.<i>.<x>``) names an argument of its
    node's ``_target_`` (a source's: of ``CorpusSource``): one the class or function then takes at its default.
    Another key is not refused: ``scheduler=cosine '~scheduler.decay_fraction'`` removes experiment=cpt_replay's WSD
    key, which cosine does not take (docs/wsd.md)."""
    import inspect

    from hydra.utils import get_object

    parent, _, name = key.rpartition(".")
    if re.fullmatch(r"data\.sources\.\d+", parent):  # a source's key: CorpusSource's own default
        from lit_dtrain.data.corpus import CorpusSource  # (~data.sources.0.weight of data=mixture: 1.0 for 0.5)

        return name in CorpusSource.__dataclass_fields__
    if key in _SWAPPED:
        return False
    try:
        node = OmegaConf.select(cfg, parent, default=None, throw_on_resolution_failure=False)
        return name in inspect.signature(get_object(node._target_)).parameters
    except Exception:  # no node, no target, or one that cannot be imported: build_callbacks names it
        return False


def _or_null(key: str) -> str:
    """What ``key=null`` means where that is the value its removal was likely after: a source's name from its paths."""
    return ", or null to name the source from its paths" if re.fullmatch(r"data\.sources\.\d+\.name", key) else ""


def _removed_needed(key: str) -> str:
    """The refusal of ``~key`` for a section lit_dtrain needs, or a path of ``paths`` (read by train.py itself: it
    failed on OmegaConf's traceback)."""
    section, _, leaf = key.partition(".")
    if not leaf:
        return f"~{key} removes the '{key}' config, which lit_dtrain needs: {_SECTIONS[section]}"
    return f"~{key} removes a path lit_dtrain needs ({_PATHS[leaf]}); set it instead ({key}=<dir>)"


def check_run_dir_keys(config: DictConfig, run_name: bool) -> None:
    """Before Hydra makes the run or sweep dir (``sweeps.OutputDirCheck``, with Hydra's node in ``config``): refuse
    ``~paths.log_dir`` or ``~paths``, as :func:`check_removed_keys` does, which comes too late for them. Hydra's run
    and sweep dirs are interpolated from ``paths.log_dir``: such a run failed in Hydra's own traceback
    ('InterpolationKeyError: Interpolation key 'paths.log_dir' not found', then 'An error occurred during Hydra's
    exception formatting'). With ``run_name`` (a single run's dir), a ``run_name`` that names no dir of its own too."""
    from lit_dtrain._config_values import check_run_name

    # as text: iterating the list resolved each override, and 'seed=${hydra:job.num}' raised 'HydraConfig was not
    # set' here (Hydra sets it per job, later), so Hydra warned and skipped this check and the sweep dir's
    overrides = unresolved(OmegaConf.select(config, "hydra.overrides.task", default=None))
    for key in filter(None, map(_removed, overrides)):
        if key in ("paths", "paths.log_dir") and OmegaConf.select(config, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(_removed_needed(key))
    if run_name:
        try:
            check_run_name(config.get("run_name"))
        except ConfigError as error:  # run_name=${hydra:job.num}: null in a single run (no job number)
            raw = config._get_node("run_name")._value() if "run_name" in config else None
            if isinstance(raw, str) and "${" in raw:
                raise ConfigError(f"run_name={raw!r} resolves to {config.get('run_name')!r}: {error}") from None
            raise


def check_removed_keys(cfg: DictConfig) -> None:
    """Refuse a ``~key`` override (this start's Hydra overrides) of a key lit_dtrain needs that is still missing
    from ``cfg`` (not re-added with ``+key=...``); a no-op outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    overrides = unresolved(HydraConfig.get().overrides.task)  # '${oc.env:X}' kept as text
    for key in filter(None, map(_removed, overrides)):
        try:
            if OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False) is not _ABSENT:
                continue  # re-added
        except Exception:
            continue
        section, _, leaf = key.partition(".")
        if not leaf and section in _SECTIONS or section == "paths" and leaf in _PATHS:
            raise ConfigError(_removed_needed(key))
        if leaf.split(".")[-1].startswith("_"):
            continue
        if section in _LEAVES_OF and leaf and "." not in leaf or _an_argument_of_its_target(cfg, key):
            raise ConfigError(f"~{key} removes a value the config sets: {key} would silently take the class's own "
                              f"default; set it instead ({key}=<value>{_or_null(key)})")
    missing = [section for section in _SECTIONS if section not in cfg]
    for override in overrides:  # 'optimizer=[]' chose no option: it was told to drop --config-name
        group, _, value = override.partition("=")
        if group.strip() in missing and re.fullmatch(r"\[\s*\]", value.strip()):  # 'optimizer=[ ]' as well
            raise ConfigError(f"{override}: config group '{group.strip()}' takes the name of one of its options, not "
                              f"an empty list{_options_of(group.strip())}; {_SECTIONS[group.strip()]}")
    if missing:  # `--config-name experiment/wsd_vs_cosine`: a partial config as the primary one
        name = HydraConfig.get().job.config_name
        raise ConfigError(f"the config {name!r} has no {', '.join(missing)}: it is not a whole config (lit_dtrain's "
                          f"is 'train'); apply an experiment with experiment=<name>, not --config-name, or start a "
                          f"config of your own with 'defaults: [train, _self_]'")


def _options_of(group: str) -> str:
    """`` (options: adamw, adamw8bit)`` for config group ``group``: its options in this run's config dirs (the app's
    and a searchpath's), or '' where none is listed."""
    options = {option for config_dir in file_config_dirs() for option in group_options_in(config_dir, group)}
    return f" (options: {', '.join(sorted(options))})" if options else ""
