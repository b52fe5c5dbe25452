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
    known = known or {}
    overrides = [known[r] if r in known else hydra_overrides(r) for r in runs]
    if len(runs) < 2 or any(o is None for o in overrides):
        return _dir_names(runs)
    overrides = _one_spelling_per_number(overrides)
    common = set.intersection(*({_as_value(o) for o in ov} for ov in overrides))
    differing = [[o for o in ov if _as_value(o) not in common and not o.startswith(_NOT_TRAINING)] for ov in overrides]
    labels = [" ".join(d) for d in differing]
    if max(map(len, labels)) > 60:
        keys = {o.split("=", 1)[0] for d in differing for o in d if "=" in o}
        short = {k: k.rsplit(".", 1)[-1] for k in keys}
        clash = {v for v in short.values() if list(short.values()).count(v) > 1}
        labels = [" ".join(_shorten(o, short, clash) for o in d) for d in differing]
    labels = [label or r.name for label, r in zip(labels, runs)]  # only defaults left: its dir name
    for label in dict.fromkeys(label for label in labels if labels.count(label) > 1):
        same = [i for i, other in enumerate(labels) if other == label]
        for i, name in zip(same, _dir_names([runs[i] for i in same])):
            if differing[i]:
                labels[i] = f"{label} ({'job ' + name if name.isdigit() else name})"
            else:  # labelled by its dir name already
                labels[i] = name
    return labels


# where a run trains, and that it continued its own run dir: not what it trained ('resume=auto' labelled a resumed
# sweep's jobs against a run that was never interrupted, which trained the same)
_NOT_TRAINING = ("run_name=", "resume=")


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
