"""A key the composed config lacks, set on the command line (``python train.py optimizer.lrr=1e-3``,
``trainer.max_step=5``): one line naming it and the closest key there is, ``error: optimizer.lrr is not a config key;
did you mean 'optimizer.lr'?`` (else the keys its section holds). Hydra printed 'Could not override ...', 'To append
to your config use +optimizer.lrr=1e-3' (the wrong fix for a typo: AdamW then refused ``lrr``) and OmegaConf's 'Key
'lrr' is not in struct', suggesting nothing.
A config group given no option's name (``optimizer=null``) is one line too (:func:`group_value_message`).

Hydra composes before any code of the entry point runs and prints its own errors (``run_and_report``), so
:func:`run_reporting_unknown_keys` has Hydra raise them until the task function starts (Hydra's own switch,
``HYDRA_FULL_ERROR=1``, which :func:`composed` takes back as the task function starts): a key the config lacks is
reported here, any other error by Hydra's own ``run_and_report``, as before. A user's own ``HYDRA_FULL_ERROR=1`` is
left alone (Hydra's full traceback, as asked)."""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
from pathlib import Path

from lit_dtrain._missing_options import missing_option_message
from lit_dtrain._negative_index import negative_index_message
from lit_dtrain._sweep_of_nothing import remove_a_sweep_of_nothing
from lit_dtrain.utils.hydra_overrides import config_being_overridden, failed_override

_FULL_ERROR = "HYDRA_FULL_ERROR"
_set_here = False  # whether this process set HYDRA_FULL_ERROR=1 (until the task function starts)


def run_reporting_unknown_keys(main, config_dir: str | None = None) -> None:
    """Run a ``@hydra.main`` function ``main`` (no arguments: Hydra reads ``sys.argv``), reporting a key the config
    lacks in one line with exit status 1 (Hydra's was 1 too). ``config_dir``: ``main``'s config dir, whose
    ``callbacks`` options the line for a callback not chosen names (Hydra's loader is gone by then)."""
    global _set_here
    if os.environ.get(_FULL_ERROR) == "1":
        main()
        return
    os.environ[_FULL_ERROR], _set_here = "1", True
    try:
        main()
    except Exception as e:  # noqa: BLE001 - raised only before the task function ran; reported as Hydra would
        composed()
        remove_a_sweep_of_nothing()  # -m ... scheduler.decay_fraction=0.1,0.2: a sweep dir holding multirun.yaml alone
        error = e
        message = (unknown_key_message(error, config_dir) or group_value_message(error, sys.argv[1:], config_dir)
                   or list_item_delete_message(error, sys.argv[1:]) or list_key_message(error)
                   or missing_option_message(error, sys.argv[1:], config_dir)
                   or negative_index_message(error, sys.argv[1:], config_dir))
        if message is None:
            _report_as_hydra(error)
        from lit_dtrain.utils.distributed import print_once_across_ranks

        print_once_across_ranks(f"error: {message}", sys.stderr)  # under torchrun every worker reached it
        raise SystemExit(1) from None
    finally:
        composed()


def composed() -> None:
    """Called as the task function starts: Hydra reports errors from here on as it always does (a sweep's failed
    job, the run's own errors, and the processes Lightning starts, which inherit the environment)."""
    global _set_here
    if _set_here:
        os.environ.pop(_FULL_ERROR, None)
        _set_here = False


def full_error_asked() -> bool:
    """Whether the user asked for Hydra's full errors (``HYDRA_FULL_ERROR=1``), not :func:`run_reporting_unknown_keys`
    while Hydra composes: the Hydra callbacks' one-line refusals (``run_name=''``) raised instead, and Hydra, which
    only logs a callback's exception, started the run (it trained into ``outputs/runs`` itself)."""
    return os.environ.get(_FULL_ERROR) == "1" and not _set_here


def _raise(error: BaseException):
    raise error


def _report_as_hydra(error: BaseException) -> None:
    """Report ``error`` (raised before the task function started) as Hydra or Python did without HYDRA_FULL_ERROR=1,
    and exit 1. Re-raised into Hydra's ``run_and_report``, a traceback it prints whole gained this module's frames
    (``-m ... --cfg job``: 16 lines where Python's own report was 8; an unresolvable ``--cfg job --resolve``: 84 for
    68), so that one is printed here from where Hydra's (or Python's) started; Hydra's short report (a composition
    error's message, or a traceback cut at ``run_job``) is Hydra's own."""
    from hydra._internal.utils import run_and_report

    start, entry = None, error.__traceback__
    while entry is not None:  # where Hydra's run_and_report caught it (the traceback it printed started there)
        if entry.tb_frame.f_code is run_and_report.__code__:
            start = entry
        entry = entry.tb_next
    hydra_reports = start is not None  # else Python's own report, from main() (the first entry is this module's)
    start = start if hydra_reports else error.__traceback__.tb_next
    if hydra_reports and not _hydra_prints_whole(error, start):
        run_and_report(lambda: _raise(error.with_traceback(start)))  # Hydra's own short report, and exit 1
    traceback.print_exception(type(error), error, start)  # as Hydra's traceback.print_exc() there, or Python's
    raise SystemExit(1)


def _hydra_prints_whole(error: BaseException, start) -> bool:
    """Whether Hydra's ``run_and_report`` prints ``error``'s whole traceback from ``start`` (its own test): not a
    composition error (its message alone), nor one with frames past a ``run_job`` among its first 10 (cut there)."""
    from hydra.errors import CompactHydraException

    if isinstance(error, CompactHydraException):
        return False
    tb, search_max = start, 10
    while search_max > 0 and tb is not None:
        frame, tb, search_max = tb.tb_frame, tb.tb_next, search_max - 1
        if frame.f_code.co_name == "run_job":
            break
    return search_max == 0 or tb is None


def unknown_key_message(error: BaseException, config_dir: str | None = None) -> str | None:
    """The one line for Hydra's 'Could not override' error of a key its node lacks (OmegaConf's 'not in struct'), with
    the closest key of that node, else None. A key the node's ``_target_`` takes but the config does not set
    (``trainer.detect_anomaly=true``, ``callbacks.model_checkpoint.every_n_train_steps=4``) is added with '+': the
    line says so, where it named only the node's keys (Hydra's own advice, '+', was right there)."""
    from hydra.errors import ConfigCompositionException
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from lit_dtrain.config_keys import _not_accepted, trainer_arg_of_train_py  # _not_accepted: the closest key

    cause = error.__cause__
    if not isinstance(error, ConfigCompositionException) or not isinstance(
            cause, (ConfigKeyError, ConfigAttributeError)):
        return None
    parent, key, full_key = cause.parent_node, cause.key, cause.full_key
    # OmegaConf writes an item of a list 'data.sources[0]', which the override grammar refuses: 'data.sources.0'
    full_key = re.sub(r"\[(\d+)\]", r".\1", full_key) if isinstance(full_key, str) else full_key
    if not isinstance(parent, DictConfig) or not isinstance(key, str) or "not in struct" not in cause.msg:
        return None
    section = full_key[: -len(key)].rstrip(".")
    prefix = f"{section}." if section else ""
    keys = sorted(k for k in map(str, parent.keys()) if section or k != "hydra")
    target, arguments = _target_arguments(parent)
    if target is None and re.fullmatch(r"data\.sources\.\d+", section):  # a source has no _target_: its fields
        target, arguments = _source_fields()  # (data.sources.0.paths after data.sources.0.kind=files named no '+')
    added = _added_with_plus(error, full_key)  # '+trainer.detect_anomaly=true', as Hydra printed it
    if section == "trainer" and (refusal := trainer_arg_of_train_py(key)):  # (its '+' form is ignored)
        return refusal
    if key in arguments:
        return f"{full_key} is not in the config but is an argument of {target}: add it with '+', {added!r}"
    if hint := _not_accepted(key, set(keys), {}, prefix=prefix):
        return f"{full_key} is not a config key{hint}"
    if close := difflib.get_close_matches(key, sorted(arguments), n=1):
        value = added.partition("=")[2]
        return (f"{full_key} is not a config key; did you mean '+{prefix}{close[0]}={value}'? ({target} takes "
                f"{close[0]}, which the config does not set: '+' adds it)")
    where = f"{section} holds" if section else "the top level holds"
    holds = f"({where} {', '.join(keys)})" if keys else f"({section} holds no keys: add one with '+', {added!r})"
    if section == "callbacks":  # callbacks.loss_spike.z=3 without choosing loss_spike (conf/callbacks, a list)
        holds = f"({where} {', '.join(keys)}; {choose_callback_first(key, config_dir)})"
    return f"{full_key} is not a config key {holds}"


def group_value_message(error: BaseException, args: list[str], config_dir: str | None) -> str | None:
    """The one line for a config group given a value that names no option on the command line ``args``
    (``optimizer=null``, ``logger=null``, ``model=1``), else None. Hydra raised 'ValueError: Config group override
    must be a string or a list. Got NoneType' in a 25-line traceback, naming neither the group nor a fix. The line
    lists the group's options (``config_dir``/<group>) and the fix: a group lit_dtrain needs takes an option, one with
    a ``none`` option is switched off with it, another top-level group is left out with ``~<group>``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lit_dtrain._removed_keys import _SECTIONS

    # a list with a value that is no name ('callbacks=[default,null]'): 'TypeError: argument of type 'NoneType' is
    # not iterable' in Hydra's traceback
    in_a_list = isinstance(error, TypeError) and re.fullmatch(r"argument of type '\w+' is not iterable", str(error))
    if config_dir is None or not (in_a_list or isinstance(error, ValueError)
                                  and str(error).startswith("Config group override must be a string or a list")):
        return None
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # noqa: BLE001 - not an override (a value of --cfg, -cn): Hydra reports those itself
            continue
        group = override.key_or_group
        if override.is_delete() or not Path(config_dir, group).is_dir():
            continue
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        values += [v for value in values if isinstance(value, list) for v in value]
        bad = next((v for v in values if not isinstance(v, (str, list))), _NO_VALUE)
        if bad is _NO_VALUE:
            continue
        options = group_options_in(config_dir, group)
        if group in _SECTIONS or group == "hydra":  # 'choose an option instead (optimizer=adamw)', as for '~optimizer'
            # ('~hydra' runs under Hydra's own settings: run dirs in ./outputs, none of lit_dtrain's launch checks)
            fix = _SECTIONS.get(group, "") if _SECTIONS.get(group, "").startswith("choose") else \
                f"choose one ({group}={options[0]})"
        elif "none" in options:
            fix = f"choose one ('{group}=none' for none)"
        else:
            fix = f"choose one, or leave the group out with '~{group}'" if "/" not in group else "choose one"
        shown = "null" if bad is None else str(bad).lower() if isinstance(bad, bool) else str(bad)
        return (f"{override.input_line}: config group '{group}' takes the name of one of its options, not {shown} "
                f"(options: {', '.join(options) or 'none'}); {fix}")
    return None


_NO_VALUE = object()


def list_item_delete_message(error: BaseException, args: list[str]) -> str | None:
    """The one line for a ``~`` override of a list item on the command line ``args`` (``'~data.sources.1'``, to drop
    ``data=mixture``'s second source), else None. Hydra 1.3 passes the index on as a string, and the list refuses it:
    'TypeError: list indices must be integers or slices, not str' in a 25-line traceback naming neither the override
    nor a fix (hydra#2477, fixed by hydra#3146 after 1.3.8). The fix is the list set whole."""
    if not (isinstance(error, TypeError) and str(error).startswith("list indices must be integers")):
        return None
    failed = failed_override(error)  # the one Hydra was applying: a digit key of a dict, also '~'d, deletes fine
    for arg in args if failed is None else [failed]:
        key = arg[1:].partition("=")[0]
        parent, _, index = key.rpartition(".")
        if arg.startswith("~") and parent and index.isdigit():
            return (f"'{arg}': Hydra cannot delete an item of a list (it takes the index {index} for a key; "
                    f"hydra#2477): set the list whole without it instead, '{parent}=[...]'")
    return None


def list_key_message(error: BaseException) -> str | None:
    """The one line for an override whose key passes through a list by a key that is no index of it
    (``data.sources.name=x``: the sources are a list, set by index, ``data.sources.0.name=x``) or by an index past
    its end (``data.sources.5.name=x``), else None. OmegaConf raised "ValueError: invalid literal for int() with base
    10: 'name'" (or "Index 'name' (str) is not an int" for a key below it, a '+' or a '~') in Hydra's 25-line
    traceback, or Hydra's 'Error merging override' lines ('list index out of range'), neither naming a fix."""
    from omegaconf import DictConfig, ListConfig

    line, cfg = failed_override(error), config_being_overridden(error)
    if line is None or not isinstance(cfg, DictConfig):
        return None
    prefix = line[: len(line) - len(line.lstrip("+~"))]
    key = line[len(prefix):].partition("=")[0]
    parts, node = key.split("."), cfg
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig):
            where, n = ".".join(parts[:i]), len(node)
            items = f"{n} item{'s' if n != 1 else ''}" + (f" (indices 0 to {n - 1})" if n > 1 else "")
            if n == 0:  # no index to suggest: 'data.sources.0.paths.0=x' of an empty paths list fails too
                return f"'{line}': {where} is an empty list, with no item to set; set the list whole ('{where}=[...]')"
            if not part.isdigit():  # the index left out before a key of an item (or a key in place of an index)
                whole = f"the list whole ('{where}=[...]')"
                keyed = n > 0 and isinstance(node._get_node(0), DictConfig)
                if not keyed and "~" in prefix:  # an item itself: Hydra 1.3 cannot delete one (hydra#2477)
                    return f"'{line}': {where} is a list of {items}; set {whole} without the item instead"
                fixed = ".".join([*parts[:i], "0", *parts[i + (0 if keyed else 1):]])
                return (f"'{line}': {where} is a list of {items}, whose items are set by index ('{prefix}{fixed}"
                        f"{line[len(prefix) + len(key):]}'), or {whole}")
            if int(part) >= n:
                return (f"'{line}': {where} is a list of {items}, with no item {part} to set; to add one, set the "
                        f"list whole ('{where}=[...]')")
            node = node._get_node(int(part))
        elif isinstance(node, DictConfig) and part in node:
            node = node._get_node(part)
        else:
            return None
    return None


def group_options_in(config_dir: str, group: str) -> list[str]:
    """The options of config group ``group`` in ``config_dir`` (its ``<group>/*.yaml`` files), sorted."""
    return sorted(p.stem for p in Path(config_dir, group).glob("*.yaml"))


def choose_callback_first(name: str, config_dir: str | None = None) -> str:
    """The advice for a key of the callback ``name`` that is not chosen (``callbacks.loss_spike.z=3``, or with '+',
    which added a node without its ``_target_``): choose its conf/callbacks option first, where there is one (each
    option's node is named as the option). The advice named ``callbacks=[default,<name>]`` for any name, also one that
    is no option (``callbacks.early_stop.patience=3``: 'callbacks=[default,early_stop]', which Hydra then refused);
    such a name gets the closest option or the list, and how to add a callback of one's own."""
    options = callback_options(config_dir)
    if options is None:  # outside a Hydra app: nothing lists them
        return (f"a conf/callbacks option is chosen first ('callbacks=[default,<option>]'), or callbacks.{name} given "
                "a _target_")
    if name in options:
        return f"one of conf/callbacks is chosen first, 'callbacks=[default,{name}]'"
    if (option := _option_adding(name)) is not None and option[0] in options:  # a node named otherwise
        return (f"the callbacks option '{option[0]}' ({option[1]}) adds it, chosen first: "
                f"'callbacks=[default,{option[0]}]'")
    close = difflib.get_close_matches(name, options, n=1)
    which = f"did you mean {close[0]}?" if close else f"its options: {', '.join(options) or 'none'}"
    return (f"conf/callbacks has no option '{name}' ({which}); a callback of one's own is added with "
            f"'+callbacks.{name}._target_=<its class>'")


def _option_adding(name: str) -> tuple[str, str] | None:
    """The ``callbacks`` option whose file adds the node ``callbacks.<name>``, and that file, where the option is
    named otherwise (``callbacks/early.yaml`` of a ``hydra.searchpath`` dir holding ``early_stopping:``, which was
    called no option while its option was listed): read in this run's file config sources (Hydra's runtime config),
    as the options' nodes are put in ``callbacks`` (a file with another ``# @package`` is skipped); None outside
    Hydra or where no file adds it."""
    from omegaconf import DictConfig

    for config_dir in file_config_dirs():
        for path in sorted(Path(config_dir, "callbacks").glob("*.yaml")):
            node, package = read_config_file(path)
            if package in (None, "_group_", "callbacks") and isinstance(node, DictConfig) and name in node:
                return path.stem, str(path)
    return None


def file_config_dirs() -> list[str]:
    """The dirs of this run's file config sources (Hydra's runtime ``config_sources``: the app's conf and any
    ``hydra.searchpath`` dir), in Hydra's order; [] outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [source.path for source in HydraConfig.get().runtime.config_sources if source.schema == "file"]


def read_config_file(path: Path) -> tuple[object, str | None]:
    """``(node, package)`` of a config file: its content, and the ``# @package`` of its header, where Hydra reads it
    (None when it gives none); ``(None, None)`` where it cannot be read (Hydra names it if used). Hydra's header is
    the leading ``# @...`` lines and blank lines, up to the first other line: a ``# @package`` below a plain comment
    is no header (Hydra puts the file's node in its group), and was read as one here."""
    from omegaconf import OmegaConf

    try:
        text = path.read_text()
        node = OmegaConf.create(text)
    except Exception:  # noqa: BLE001 - unreadable or not YAML here
        return None, None
    header = []  # as Hydra's _get_header_dict, in the first 512 characters (one past them was read here)
    for line in (line.strip() for line in text[:512].splitlines()):
        if line and not re.match(r"#\s*@", line):
            break
        header.append(line)
    package = re.search(r"#\s*@package\s+(\S+)", "\n".join(header))
    return node, package.group(1) if package else None


def callback_options(config_dir: str | None = None) -> list[str] | None:
    """The options of the config group ``callbacks`` that each add one callback (not ``default``, ``none``), as
    Hydra's config loader of this app lists them, else those in ``config_dir``/callbacks (Hydra clears its loader
    when composing fails); None with neither (``train(cfg)`` called outside a Hydra app)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if GlobalHydra.instance().is_initialized():
        # with the run's hydra.searchpath: the loader alone lists only the app's and --config-dir's options, so an
        # option of a searchpath dir (callbacks=[default,mycb] works) was 'no option' and left out of the list
        hydra = HydraConfig.get() if HydraConfig.initialized() else None
        options = GlobalHydra.instance().config_loader().get_group_options(
            "callbacks", config_name=hydra.job.config_name if hydra else None,
            overrides=list(hydra.overrides.hydra) if hydra else [])
    elif config_dir is not None and not _other_config_dirs(sys.argv[1:]):
        options = group_options_in(config_dir, "callbacks")
    else:
        return None
    return [o for o in options if o not in ("default", "none")]


def _other_config_dirs(argv: list[str]) -> bool:
    """Whether a command line adds config dirs beside the app's (``--config-dir``/``-cd``, ``hydra.searchpath``),
    whose options a listing of the app's conf dir would miss."""
    return any(a in ("--config-dir", "-cd") or a.startswith(("--config-dir=", "-cd=")) or
               a.lstrip("+~").startswith("hydra.searchpath") for a in argv)


def _target_arguments(node) -> tuple[str | None, set[str]]:
    """``node``'s ``_target_`` as written and the keyword arguments it takes (``config_keys.accepted_arguments``),
    ``(None, set())`` for a node without one or a target that cannot be imported or followed."""
    from hydra.utils import get_object

    from lit_dtrain.config_keys import accepted_arguments

    target = node._get_node("_target_") if "_target_" in node else None
    target = target._value() if target is not None else None
    if not isinstance(target, str) or "${" in target:
        return None, set()
    try:
        arguments = accepted_arguments(get_object(target))
    except Exception:  # noqa: BLE001 - not importable here: its instantiation names it
        return None, set()
    return target, {a for a in arguments or () if not a.startswith("_")}


def _source_fields() -> tuple[str, set[str]]:
    """What a ``data.sources.<i>`` entry takes: the fields of :class:`~lit_dtrain.data.CorpusSource`."""
    import dataclasses

    from lit_dtrain.data import CorpusSource

    return "lit_dtrain.data.CorpusSource", {f.name for f in dataclasses.fields(CorpusSource)}


def _added_with_plus(error: BaseException, full_key: str) -> str:
    """The override with a '+', from Hydra's 'To append to your config use +<override>' line."""
    for line in str(error).splitlines():
        if line.startswith("To append to your config use "):
            return line[len("To append to your config use "):].strip()
    return f"+{full_key}=<value>"
