"""compare_runs.py's labels of runs: the Hydra overrides that differ between them (``scheduler=wsd
optimizer.lr=0.003``), else their dir names; a number typed two ways is shown one way, and no two runs share a
label."""

from __future__ import annotations

from pathlib import Path

from lit_dtrain.run_dirs import hydra_overrides


def make_labels(runs: list[Path], known: dict[Path, list[str]] | None = None) -> list[str]:
    """The overrides that differ between runs (``scheduler=wsd optimizer.lr=0.003``), else dir names. Labels over
    60 characters name dotted keys by their last part (``lr=0.003``) where no two differing keys share it. Runs
    whose labels would be equal (the same overrides) get their dir name added, ``optimizer.lr=0.003 (job 1)``;
    the other runs keep theirs. A number spelled two ways among the runs (``3e-3`` typed for a run, ``0.003`` as
    Hydra's sweeper writes it for a job) is shown in one form (:func:`_one_spelling_per_number`). ``known``: the
    overrides of runs that have no dir yet (:func:`jobs_not_started`)."""
    differing = _differing(runs, known)
    if differing is None:
        return _dir_names(runs)
    labels = _joined(differing)
    labels = [label or r.name for label, r in zip(labels, runs)]  # only defaults left: its dir name
    for label in dict.fromkeys(label for label in labels if labels.count(label) > 1):
        same = [i for i, other in enumerate(labels) if other == label]
        for i, name in zip(same, _dir_names([runs[i] for i in same])):
            if differing[i]:
                labels[i] = f"{label} ({'job ' + name if name.isdigit() else name})"
            else:  # labelled by its dir name already
                labels[i] = name
    return labels


def group_labels(runs: list[Path], over: list[str], known: dict[Path, list[str]] | None = None) -> list[str] | None:
    """Each run's label without the keys ``over`` (``--over seed``): the overrides other than those that differ
    between runs, so that runs which differ only in a seed share one label (``optimizer.lr=0.003``; ``""`` where
    nothing else differs). Runs with equal labels are not told apart here: they are one group. None where a run's
    overrides are not known (no ``overrides.yaml``; ``known``: those of jobs without a dir)."""
    differing = _differing(runs, known, tuple(over))
    return None if differing is None else _joined(differing)


def _joined(differing: list[list[str]]) -> list[str]:
    """Each run's differing overrides as one label; where one is over 60 characters, dotted keys by their last part
    (``lr=0.003``) where no two differing keys share it."""
    labels = [" ".join(d) for d in differing]
    if max(map(len, labels)) > 60:
        keys = {o.split("=", 1)[0] for d in differing for o in d if "=" in o}
        short = {k: k.rsplit(".", 1)[-1] for k in keys}
        clash = {v for v in short.values() if list(short.values()).count(v) > 1}
        labels = [" ".join(_shorten(o, short, clash) for o in d) for d in differing]
    return labels


def override_key(override: str) -> str:
    """The key an override sets, without Hydra's ``+``, ``++`` or ``~`` prefix: ``seed`` of ``+seed=3``."""
    return override.partition("=")[0].lstrip("+~")


def _differing(runs: list[Path], known: dict[Path, list[str]] | None = None,
               leave_out: tuple[str, ...] = ()) -> list[list[str]] | None:
    """Each run's overrides that differ between the runs, checked against what each trained with
    (:func:`_with_defaults`), numbers in one spelling; the keys ``leave_out`` are not looked at. None for fewer
    than two runs or a run whose overrides are not known."""
    known = known or {}
    overrides = [known[r] if r in known else hydra_overrides(r) for r in runs]
    if len(runs) < 2 or any(o is None for o in overrides):
        return None
    overrides = [[o for o in ov if override_key(o) not in leave_out] for ov in overrides]
    overrides = _one_spelling_per_number([[_flag_in_lower_case(o) for o in ov] for ov in overrides])
    common = set.intersection(*({_as_value(o) for o in ov} for ov in overrides))
    differing = [[o for o in ov if _as_value(o) not in common and not o.startswith(_NOT_TRAINING)] for ov in overrides]
    return _one_spelling_per_number(_with_defaults(runs, differing))  # a default beside a typed 3e-3: 0.003


# where a run trains, and that it continued its own run dir: not what it trained ('resume=auto' labelled a resumed
# sweep's jobs against a run that was never interrupted, which trained the same)
_NOT_TRAINING = ("run_name=", "resume=")


def _with_defaults(runs: list[Path], differing: list[list[str]]) -> list[list[str]]:
    """``differing`` checked against what each run trained with (its ``config_resolved.yaml``, its config groups'
    choices in ``.hydra/hydra.yaml``): a key every run trained with the same value of is left out (``scheduler=wsd``
    typed for one run, the default for the other, labelled the first as if its schedule differed), and a run that
    left a differing key at its default gets that value (``optimizer.lr=0.003`` beside ``optimizer.lr=0.01``, where
    it had only its dir name). A run whose config is not known (no dir yet, no ``config_resolved.yaml``) keeps the
    typed overrides alone."""
    configs = [_trained_with(r) for r in runs]
    keys = list(dict.fromkeys(o.partition("=")[0] for d in differing for o in d if "=" in o))
    values = {k: [_value(c, ov, k) for c, ov in zip(configs, differing)] for k in keys}
    for i, run in enumerate(runs):  # a sweep's job that never started: what its started siblings all trained with
        if configs[i] is None and not run.exists() and (run.parent / "multirun.yaml").is_file():
            for k, vs in values.items():
                vs[i] = _siblings_value(runs, configs, i, k) if vs[i] is _UNKNOWN else vs[i]
    out = []
    for i, ov in enumerate(differing):
        same = {k for k, vs in values.items() if _UNKNOWN not in vs and len({_as_value(f"{k}={v}") for v in vs}) == 1}
        kept = [o for o in ov if o.partition("=")[0] not in same]
        have = {o.partition("=")[0] for o in ov}
        kept += [f"{k}={vs[i]}" for k, vs in values.items() if k not in same | have and vs[i] is not _UNKNOWN]
        out.append(kept)
    return out


_UNKNOWN = object()  # a run's value of a key that its config does not tell


def _trained_with(run: Path):
    """``(config_resolved.yaml, the config groups' choices)`` of a run dir, ``None`` without them."""
    from omegaconf import OmegaConf

    try:
        choices = OmegaConf.load(run / ".hydra" / "hydra.yaml").hydra.runtime.choices
        return OmegaConf.load(run / "config_resolved.yaml"), choices
    except Exception:  # noqa: BLE001 - any unreadable or missing file: only the typed overrides label it
        return None


def _siblings_value(runs: list[Path], configs: list, i: int, key: str):
    """The value of ``key`` every started job of the sweep of ``runs[i]`` (a job that never started, so without a
    config) trained with, where it cannot depend on what the sweep varies: not a key under a swept one (nor a swept
    ``experiment``, which may set any), and not an interpolation in their ``.hydra/config.yaml`` (a default derived
    from a swept key, such as the warmup from ``trainer.max_steps``). :data:`_UNKNOWN` otherwise. Its label showed
    ``scheduler=constant`` beside its started siblings' ``scheduler=wsd optimizer.lr=0.003``."""
    from omegaconf import OmegaConf

    from lit_dtrain.run_dirs import sweep_jobs

    sweep, jobs = runs[i].parent, sweep_jobs(runs[i].parent, lambda _: None) or []
    swept = {override_key(o) for job in jobs for o in job if any(o not in other for other in jobs)}
    if key.startswith(("+", "~")) or "experiment" in swept or any(key.startswith(f"{s}.") for s in swept):
        return _UNKNOWN
    seen = set()
    for run, config in zip(runs, configs):
        if run.parent != sweep or config is None:
            continue
        if key not in config[1]:  # a value, not a config group's choice: not derived from another key
            parent, _, leaf = f".{key}".rpartition(".")
            try:
                node = OmegaConf.select(OmegaConf.load(run / ".hydra" / "config.yaml"), parent[1:] or "", default=None)
                if node is None or OmegaConf.is_interpolation(node, leaf):
                    return _UNKNOWN
            except Exception:  # noqa: BLE001 - an unreadable file: the typed overrides alone label it
                return _UNKNOWN
        seen.add(_value(config, [], key))
    return seen.pop() if len(seen) == 1 and _UNKNOWN not in seen else _UNKNOWN


def _value(config, typed: list[str], key: str):
    """The value of ``key`` that a run trained with, as a label writes it: typed, else its config group's choice or
    its config's scalar; :data:`_UNKNOWN` where neither tells (an appended ``+key``, a dict, no config)."""
    for o in typed:
        if o.partition("=")[0] == key:
            return o.partition("=")[2]
    if config is None or key.startswith(("+", "~")):
        return _UNKNOWN
    from omegaconf import OmegaConf

    cfg, choices = config
    if key in choices:  # a multi-select group ('callbacks=[default,loss_spike]') as typed
        choice = choices[key]  # none chosen ('experiment: null') is typed 'experiment=null'
        return f"[{','.join(map(str, choice))}]" if OmegaConf.is_list(choice) else "null" if choice is None else choice
    value = OmegaConf.select(cfg, key, default=_UNKNOWN)
    if value is _UNKNOWN or OmegaConf.is_config(value):
        return _UNKNOWN
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _dir_names(runs: list[Path]) -> list[str]:
    """The runs' dir names, with as many parent dirs as it takes to tell them apart (``m1/sweep/0``,
    ``m2/sweep/0``)."""
    depth = 1
    while True:
        names = ["/".join(r.parts[-depth:]) for r in runs]
        if len(set(names)) == len(names) or all(depth >= len(r.parts) for r in runs):
            return names
        depth += 1


def _unique(labels: list[str]) -> list[str]:
    """``labels`` with a repeated one numbered: ``x``, ``x (2)``, ..."""
    out: list[str] = []
    for label in labels:
        new, n = label, 1
        while new in out:
            n += 1
            new = f"{label} ({n})"
        out.append(new)
    return out


def _as_value(override: str) -> tuple[str, object]:
    """``key=value`` as (key, value) compared by value: Hydra's sweeper writes a job's ``1e-3`` as ``0.001`` and
    ``false`` as ``False``; a single run keeps them as typed."""
    key, sep, value = override.partition("=")
    if not sep:
        return key, None
    low = value.strip().lower()
    if low in ("true", "false"):
        return key, low == "true"
    if low in ("null", "none", "~"):
        return key, None
    try:
        return key, float(value)
    except ValueError:
        return key, value.strip().strip("'\"")


def _flag_in_lower_case(override: str) -> str:
    """``key=False`` as ``key=false``: Hydra reads ``true``/``false`` in any case (its sweeper writes a job's ``false``
    as ``False``), and a label showed them as typed, ``module.check_finite=False`` beside ``module.check_finite=true``;
    a default taken from a run's config is written in lower case too (:func:`_value`). A quoted one is a string."""
    key, sep, value = override.partition("=")
    return f"{key}={value.strip().lower()}" if sep and value.strip().lower() in ("true", "false") else override


def _one_spelling_per_number(overrides: list[list[str]]) -> list[list[str]]:
    """``overrides`` with every number of a key written in Python's shortest form (``0.003``, ``1e-05``, ``20``)
    where the runs write one value of that key in two ways (``3e-3``, ``0.003``), so that equal values read
    equal; other keys and non-numbers are kept as written."""
    spellings: dict[str, dict[float, set[str]]] = {}
    for ov in overrides:
        for o in ov:
            key, value = _as_value(o)
            if isinstance(value, float):
                spellings.setdefault(key, {}).setdefault(value, set()).add(o.partition("=")[2])
    mixed = {key for key, by_value in spellings.items() if any(len(s) > 1 for s in by_value.values())}

    def canonical(override: str) -> str:
        key, value = _as_value(override)
        if key not in mixed or not isinstance(value, float):
            return override
        text = repr(value)
        return f"{key}={text[:-2] if text.endswith('.0') else text}"

    return [[canonical(o) for o in ov] for ov in overrides]


def _shorten(override: str, short: dict[str, str], clash: set[str]) -> str:
    key, sep, value = override.partition("=")
    return f"{short[key]}={value}" if sep and short[key] not in clash else override
