"""compare_runs.py's ``--over KEY``: runs that differ only in ``KEY`` (a seed sweep, ``-m seed=0,1,2``, crossed with
other swept keys or not) summarized as one group each, the mean and sample standard deviation of their final and
best values, and their mean curve with a band of one standard deviation."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from _compare_runs_labels import _as_value, _differing, _trained_with, group_labels, override_key
from _compare_runs_table import _number, _percent, comparable, final_only

from lit_dtrain.run_dirs import RunDirError, hydra_overrides

ALL_RUNS = "(all runs)"  # the label of the one group of a sweep over KEY alone


def make_groups(run_dirs: list[Path], over: list[str], known: dict[Path, list[str]] | None = None) -> list[str]:
    """Each run's group label (:func:`group_labels`); a :class:`RunDirError` where it cannot be told: a run without
    its overrides, or no run that typed ``over`` (a misspelled key would group nothing). ``known``: the overrides of
    jobs that have no dir yet (:func:`jobs_not_started`)."""
    known = known or {}
    overrides = [known[r] if r in known else hydra_overrides(r) for r in run_dirs]
    if unknown := [str(r) for r, o in zip(run_dirs, overrides) if o is None]:
        raise RunDirError(f"--over {' '.join(over)}: runs {unknown} have no overrides.yaml, so what they changed is "
                          "not known; group runs of train.py (its run or sweep dirs), or leave --over out")
    typed = {override_key(o) for ov in overrides for o in ov}
    if missing := [k for k in over if k not in typed]:
        raise RunDirError(f"--over {missing[0]}: no run sets {missing[0]!r} on its command line (they set "
                          f"{sorted(typed)}); give a key that differs between the runs, e.g. --over seed after "
                          "-m seed=0,1,2")
    differing = _differing(run_dirs, known) if len(run_dirs) > 1 else None
    varied = {override_key(o) for d in differing or [] for o in d}
    if differing is not None and (same := [k for k in over if k not in varied]):
        raise RunDirError(f"--over {same[0]}: every run trained with the same {same[0]!r}, so it groups no "
                          f"runs; give a key whose value differs between the runs (they differ in "
                          f"{sorted(varied)})")
    labels = group_labels(run_dirs, over, known) if len(run_dirs) > 1 else [""]
    # a job without its config (not started, or failed before training) is labelled by what it typed alone: it
    # joins the group of a run that typed the same (a job of the same sweep), not one of its own
    typed = [frozenset(_as_value(o) for o in ov if override_key(o) not in over) for ov in overrides]
    configured = [r not in known and _trained_with(r) is not None for r in run_dirs]
    for i, alike in enumerate(typed):
        if not configured[i]:
            labels[i] = next((labels[j] for j, t in enumerate(typed) if configured[j] and t == alike), labels[i])
    return [label or ALL_RUNS for label in labels]


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; NaN for one value); NaN where a value is not finite."""
    if not values:
        return math.nan, math.nan
    if not all(math.isfinite(v) for v in values):
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def summarize_groups(rows: list[dict], groups: dict[str, str], metrics: list[str],
                     not_logged: list[str] = ()) -> list[dict]:
    """One entry per group, in the order of its first run in ``rows``: its runs' labels, and per metric the mean and
    standard deviation of the finished runs' final and best values (``n``: how many; a failed or unfinished run
    stopped at another step and is left out, counted in ``left_out``). ``groups``: each run's label -> its group;
    ``not_logged``: the groups of the sweep jobs that logged nothing (failed at their start, or never started),
    counted in ``left_out`` too."""
    out: dict[str, dict] = {}
    for r in rows:
        g = out.setdefault(groups[r["label"]], {"label": groups[r["label"]], "runs": [], "by_metric": {}})
        g["runs"].append(r["label"])
    for label in not_logged:  # a setting whose every job failed at its start has a row too
        out.setdefault(label, {"label": label, "runs": [], "by_metric": {}})
    for g in out.values():
        members = [r for r in rows if groups[r["label"]] == g["label"]]
        for m in metrics:
            done = [r["by_metric"][m] for r in members if comparable(r) and not r["by_metric"][m].get("missing")]
            final_mean, final_std = _mean_std([v["final"] for v in done])
            bests = [v["best"] for v in done if v["best_step"] is not None]
            best_mean, best_std = _mean_std(bests) if len(bests) == len(done) else (math.nan, math.nan)
            left_out = len(members) - len(done) + list(not_logged).count(g["label"])
            g["by_metric"][m] = {"n": len(done), "left_out": left_out, "final_mean": final_mean,
                                 "final_std": final_std, "best_mean": best_mean, "best_std": best_std}
    return list(out.values())


def _cell(mean: float, std: float) -> str:
    if not math.isfinite(mean):
        return "-" if math.isnan(mean) else _number(mean)
    return _number(mean) if math.isnan(std) else f"{_number(mean)} ± {_number(std)}"


def best_group(groups: list[dict], metric: str, maximize: bool | None) -> str | None:
    """The group with the lowest (``maximize``: highest) finite mean final value of ``metric``."""
    if maximize is None:
        return None
    finite = [g for g in groups if math.isfinite(g["by_metric"][metric]["final_mean"])]
    pick = max if maximize else min
    return pick(finite, key=lambda g: g["by_metric"][metric]["final_mean"])["label"] if finite else None


def groups_table(groups: list[dict], metric: str, over: list[str], maximize: bool | None) -> str:
    """One row per group: its finished runs (``n``; ``+k failed, unfinished or not started``), the mean ± standard
    deviation of their final and best ``metric``, and the mean final's gap to the best group's."""
    keys = ", ".join(over)
    best = best_group(groups, metric, maximize)
    ref = next((g["by_metric"][metric]["final_mean"] for g in groups if g["label"] == best), math.nan)
    ranked = maximize is not None and not final_only(metric)
    header = [
        f"| runs (mean ± std over {keys}) | n | final {metric} | "
        f"{'best ' + metric if ranked else 'best (not ranked)'} | vs best mean |",
        "|---|---:|---:|---:|---:|",
    ]
    lines = []
    for g in groups:
        v = g["by_metric"][metric]
        n = f"{v['n']}" + (f" (+{v['left_out']} failed, unfinished or not started)" if v["left_out"] else "")
        gap_known = math.isfinite(v["final_mean"]) and math.isfinite(ref) and ref
        gap = _percent((v["final_mean"] - ref) / abs(ref) * 100) if gap_known else "-"
        best_cell = _cell(v["best_mean"], v["best_std"]) if ranked else "-"
        lines.append(f"| {g['label']} | {n} | {_cell(v['final_mean'], v['final_std'])} | {best_cell} | {gap} |")
    return "\n".join(header + lines) + "\n"


def mean_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], rows: list[dict], groups: dict[str, str],
                metrics: list[str]) -> tuple[dict, dict]:
    """Each group's mean curve per metric, at the steps every one of its finished runs measured, and the standard
    deviation there: ``(curves, spread)`` keyed by group label, as :func:`compare_runs.plot` takes them."""
    means: dict[str, dict[str, list[tuple[int, float]]]] = {}
    spread: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        g = groups[r["label"]]
        if g in means:
            continue
        members = [x["label"] for x in rows if groups[x["label"]] == g and comparable(x)]
        means[g], spread[g] = {}, {}
        for m in metrics:
            series = [dict(curves[label][m]) for label in members if curves[label][m]]
            steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
            means[g][m] = [(s, statistics.fmean(x[s] for x in series)) for s in steps]
            spread[g][m] = [statistics.stdev(x[s] for x in series) if len(series) > 1 else 0.0 for s in steps]
    return means, spread
