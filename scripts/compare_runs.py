#!/usr/bin/env python
"""Compare runs from their TensorBoard event files (or ``logger=csv``'s metrics.csv): a PNG of val loss (or any
scalar) against step, and a markdown table of final and best values per metric.

    python scripts/compare_runs.py outputs/runs/a outputs/runs/b --out compare.png --table compare.md
    python scripts/compare_runs.py outputs/multiruns/2026-01-01_12-00-00      # every job of a sweep
    python scripts/compare_runs.py RUN... --metric val/loss --metric lr-AdamW/decay   # one panel per metric
    python scripts/compare_runs.py RUN... --metric train/device/items_per_sec --maximize train/device/items_per_sec

A RUN is a run dir (event files anywhere below it, e.g. ``tb/``, or a ``metrics.csv``, e.g. ``csv/``) or a sweep
dir whose job subdirs are runs. Labels come from ``--labels``, else from the Hydra overrides that differ between runs
(``overrides.yaml``, written by ``train.py`` when it trains; ``.hydra/overrides.yaml`` for older runs), else from the
dir names. The last line printed is one JSON object: ``runs`` (each with the first metric's values and ``by_metric``,
every metric's), ``best`` (by the first metric) and ``best_by_metric``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import re
import sys
from pathlib import Path

EVENT_GLOB = "events.out.tfevents.*"
CSV_NAME = "metrics.csv"  # Lightning's CSVLogger (logger=csv: ResumableCSVLogger) writes <run>/csv/metrics.csv


class CompareError(ValueError):
    """A run dir, an event file or a metric is missing; the message names it."""


def event_dirs(run: Path) -> list[Path]:
    """Dirs below ``run`` that hold TensorBoard event files or a CSV logger's metrics.csv (sorted)."""
    return sorted({p.parent for p in run.rglob(EVENT_GLOB)} | {p.parent for p in run.rglob(CSV_NAME) if p.is_file()})


def expand_runs(paths: list[str], skipped: list[str] | None = None) -> list[Path]:
    """Run dirs from the arguments: a dir with event files of its own is a run; else its job subdirs are. A dir
    that holds sweeps or run dirs deeper down (``outputs``, ``outputs/multiruns``) is expanded into each of them.

    A Hydra job dir (``.hydra/``) without event files, a sweep job that failed before logging anything, is
    skipped with a warning on stderr and appended to ``skipped``; it does not stop the comparison."""
    runs: list[Path] = []
    skipped = [] if skipped is None else skipped
    files: list[str] = []

    def skip(job: Path) -> None:
        print(f"compare_runs: skipping {job} (a Hydra job without TensorBoard event files or {CSV_NAME}: it failed "
              "before logging, or has not started)", file=sys.stderr)
        skipped.append(str(job))

    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():  # a shell glob over a sweep dir also matches Hydra's multirun.yaml
            print(f"compare_runs: skipping {raw} (a file, not a run dir)", file=sys.stderr)
            files.append(raw)
            continue
        if not path.is_dir():
            raise CompareError(f"run dir {raw!r} does not exist")
        if _holds_runs(path):
            subs = [d for d in sorted(path.iterdir(), key=_job_key)
                    if d.is_dir() and (event_dirs(d) or _hydra_below(d))]
            runs.extend(expand_runs([str(d) for d in subs], skipped))
            continue
        own = [d for d in event_dirs(path) if not _inside_job(d, path)]
        subdirs = sorted((d for d in path.iterdir() if d.is_dir()), key=_job_key)
        jobs = [d for d in subdirs if event_dirs(d)]
        if own or not jobs:
            if not event_dirs(path):
                if (path / ".hydra").is_dir():  # e.g. one job of the README's `outputs/multiruns/<time>/*` glob
                    skip(path)
                    continue
                hydra_jobs = [d for d in subdirs if (d / ".hydra").is_dir()]
                if hydra_jobs:  # a sweep none of whose jobs logged anything: all failed, or none started
                    for d in hydra_jobs:
                        skip(d)
                    continue
                raise CompareError(f"run dir {raw!r} has no TensorBoard event files ({EVENT_GLOB}) or CSV metrics "
                                   f"({CSV_NAME}) below it")
            runs.append(path)
        else:
            runs.extend(jobs)
            for d in subdirs:
                if (d / ".hydra").is_dir() and not event_dirs(d):
                    skip(d)
    if not runs and skipped:
        jobs = [
            f"{job} failed: {_cell(error)}"
            if (error := job_error(Path(job)))
            else f"{job} logged no error (not started, or stopped before logging)"
            for job in skipped
        ]
        raise CompareError(f"no run has TensorBoard event files or {CSV_NAME}: {'; '.join(jobs)}")
    if not runs and files:  # e.g. a checkpoint
        raise CompareError(
            f"no run dir among the arguments: {files[0]!r} is a file; give the run dir that holds it "
            "(e.g. outputs/runs/<run>)"
        )
    return runs


def _is_run_dir(d: Path) -> bool:
    return (d / ".hydra").is_dir() or (d / "summary.json").is_file()


def _hydra_below(d: Path) -> bool:
    return any(p.is_dir() for p in d.rglob(".hydra"))


def _holds_runs(path: Path) -> bool:
    """Whether ``path`` is no run but holds run dirs two or more levels down (sweep dirs, ``runs/``): merging their
    event files would make one run of many."""
    if _is_run_dir(path):
        return False
    return any(len(p.parent.relative_to(path).parts) >= 2 for p in path.rglob(".hydra") if p.is_dir())


def _inside_job(event_dir: Path, root: Path) -> bool:
    """Whether ``event_dir`` lies in a sweep job subdir of ``root`` (one with its own .hydra or summary)."""
    rel = event_dir.relative_to(root).parts
    return bool(rel) and ((root / rel[0] / ".hydra").is_dir() or (root / rel[0] / "summary.json").is_file())


def _job_key(path: Path):
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def read_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run: ``{tag: [(step, value), ...]}`` sorted by step.

    Several event files (a resumed run appends a new one) are merged; for a step logged twice, the
    later write wins. A ``metrics.csv`` (``logger=csv``) is read too: one column per tag, rows in logging order
    (a later row wins; ``epoch`` and ``step`` are not scalars).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, tuple[float, float]]] = {}
    for d in event_dirs(run):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            per_step = merged.setdefault(tag, {})
            for e in acc.Scalars(tag):
                if e.step not in per_step or e.wall_time >= per_step[e.step][0]:
                    per_step[e.step] = (e.wall_time, float(e.value))
        csv_file = d / CSV_NAME
        if csv_file.is_file():
            for tag, step, value in read_csv_metrics(csv_file):
                merged.setdefault(tag, {})[step] = (math.inf, value)
    return {tag: [(s, v) for s, (_, v) in sorted(steps.items())] for tag, steps in merged.items()}


def read_csv_metrics(path: Path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of every filled cell of a Lightning ``metrics.csv``, in file order."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if "step" not in (reader.fieldnames or []):
            raise CompareError(f"{path} has no 'step' column, so it is not a Lightning CSVLogger metrics file; "
                               f"its columns are {reader.fieldnames}")
        out = []
        for row in reader:
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            out += [(tag, step, float(v)) for tag, v in row.items() if tag not in ("step", "epoch") and v]
    return out


def hydra_overrides(run: Path) -> list[str] | None:
    """The run's command-line overrides: ``overrides.yaml``, written by the last start that trained it, else
    ``.hydra/overrides.yaml``, which Hydra rewrites at every start (one that failed before training included);
    None when it has neither."""
    f = next((f for f in (run / "overrides.yaml", run / ".hydra" / "overrides.yaml") if f.is_file()), None)
    if f is None:
        return None
    return [line[2:].strip() for line in f.read_text().splitlines() if line.startswith("- ")]


def make_labels(runs: list[Path], known: dict[Path, list[str]] | None = None) -> list[str]:
    """The overrides that differ between runs (``scheduler=wsd optimizer.lr=0.003``), else dir names. Labels over
    60 characters name dotted keys by their last part (``lr=0.003``) where no two differing keys share it.
    ``known``: the overrides of runs that have no dir yet (:func:`jobs_not_started`)."""
    known = known or {}
    overrides = [known[r] if r in known else hydra_overrides(r) for r in runs]
    if len(runs) > 1 and all(o is not None for o in overrides):
        common = set.intersection(*({_as_value(o) for o in ov} for ov in overrides))
        differing = [[o for o in ov if _as_value(o) not in common and not o.startswith("run_name=")]
                     for ov in overrides]
        labels = [" ".join(d) or r.name for d, r in zip(differing, runs)]  # only defaults left: its dir name
        if len(set(labels)) == len(labels):
            if max(map(len, labels)) > 60:
                keys = {o.split("=", 1)[0] for d in differing for o in d if "=" in o}
                short = {k: k.rsplit(".", 1)[-1] for k in keys}
                clash = {v for v in short.values() if list(short.values()).count(v) > 1}
                labels = [" ".join(_shorten(o, short, clash) for o in d) or r.name for d, r in zip(differing, runs)]
            return labels
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        names = [f"{r.parent.name}/{r.name}" for r in runs]
    return names


def sweep_jobs(sweep: Path) -> list[list[str]] | None:
    """Each job's overrides (job N: entry N) of the multirun whose ``multirun.yaml`` is in ``sweep``, as Hydra's basic
    sweeper makes them: the product of the swept values of ``hydra.sweeper.params`` then the command line's (as in
    ``BasicSweeper.split_arguments``). None for another sweeper, or without a readable ``multirun.yaml``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        hydra = OmegaConf.load(sweep / "multirun.yaml").hydra
        if not str(hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"):
            return None
        params = [f"{k}={v}" for k, v in (hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides(params + list(hydra.overrides.task))
    except Exception as e:  # any unreadable file: only the rows of jobs that never started depend on it
        print(
            f"compare_runs: cannot list the jobs of {sweep / 'multirun.yaml'} ({type(e).__name__}: {e}); jobs "
            "that never started have no row",
            file=sys.stderr,
        )
        return None
    values = {}
    for o in overrides:
        key = o.get_key_element()
        swept = o.is_sweep_override() and o.is_discrete_sweep()
        values[key] = (
            [f"{key}={v}" for v in o.sweep_string_iterator()] if swept else [f"{key}={o.get_value_element_as_str()}"]
        )
    return [list(job) for job in itertools.product(*values.values())]


def jobs_not_started(runs: list[Path]) -> dict[Path, list[str]]:
    """``{<sweep dir>/N: its overrides}`` of the jobs of the sweeps that ``runs`` belong to which have no dir: Hydra
    creates a job's dir when the job starts, so a sweep stopped in job 1 of 4 has no trace of jobs 2 and 3."""
    missing: dict[Path, list[str]] = {}
    for sweep in dict.fromkeys(r.parent for r in runs if (r.parent / "multirun.yaml").is_file()):
        for n, overrides in enumerate(sweep_jobs(sweep) or []):
            if not (sweep / str(n)).exists():
                missing[sweep / str(n)] = overrides
    return missing


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


def _shorten(override: str, short: dict[str, str], clash: set[str]) -> str:
    key, sep, value = override.partition("=")
    return f"{short[key]}={value}" if sep and short[key] not in clash else override


def summarize(series: list[tuple[int, float]], maximize: bool = False) -> dict:
    """Final and best (lowest, or highest with ``maximize``) value of one run's series, with their (TensorBoard)
    steps.

    Lightning logs a validation during fit at the 0-based index of the last optimizer step (``S - 1`` after
    ``S`` steps), but ``train(cfg)``'s final ``trainer.validate`` at ``S``: when ``S`` is a multiple of
    ``val_check_interval`` both measure the same weights, and the series ends with the same value twice,
    one step apart. That pair is one measurement, reported at ``S`` (the steps trained), so that the same
    value never gets a best step one before its final step. Any other point keeps its logged step.
    """
    if len(series) >= 2:
        (prev_step, prev), (last_step, last) = series[-2], series[-1]
        if last_step == prev_step + 1 and math.isclose(prev, last, rel_tol=1e-5):
            series = [*series[:-2], series[-1]]
    if not series:
        return {"final_step": None, "final": float("nan"), "best": float("nan"), "best_step": None}
    final_step, final = series[-1]
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    if not finite:  # diverged from the first point: its steps are still known
        return {"final_step": final_step, "final": final, "best": float("nan"), "best_step": None}
    best_step, best = (max if maximize else min)(finite, key=lambda sv: sv[1])
    return {"final_step": final_step, "final": final, "best": best, "best_step": best_step}


def finished(run: Path, scalars: dict[str, list[tuple[int, float]]]) -> bool | None:
    """Whether a ``train.py`` run dir (it has ``config_resolved.yaml``) ran to its end: ``train(cfg)`` writes
    ``summary.json`` last, with the steps trained. False without it (killed, preempted, still running) or when the
    run logged past those steps (resumed, then stopped). None for other dirs: nothing tells."""
    if not (run / "config_resolved.yaml").is_file():
        return None
    try:
        steps = json.loads((run / "summary.json").read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    last = max((series[-1][0] for series in scalars.values() if series), default=0)
    return isinstance(steps, int) and last <= steps


def best_row(rows: list[dict], maximize: bool = False) -> dict | None:
    """The run with the lowest (``maximize``: highest) finite final value, among the finished ones when any run is
    marked unfinished."""
    finite = [r for r in rows if math.isfinite(r["final"])]
    done = [r for r in finite if r.get("finished") is not False and not r.get("error")]
    return (max if maximize else min)(done or finite, key=lambda r: r["final"]) if finite else None


def job_log(job: Path) -> Path:
    """The log file Hydra's job logging writes in a job dir: ``<hydra.job.name>.log``, the app's script name
    (``train.log`` for the root ``train.py``, ``my_train.log`` for an app of one's own calling ``train(cfg)``), as
    ``.hydra/hydra.yaml`` names it; ``train.log`` without one."""
    from omegaconf import OmegaConf

    try:
        name = OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.job.name
    except Exception:  # no (readable) hydra.yaml: the root train.py's name
        name = None
    return job / f"{name or 'train'}.log"


def job_error(job: Path) -> str | None:
    """The error a failed sweep job logged to its Hydra job log (:func:`job_log`; ``train(cfg)`` logs
    ``job N failed: Type: message``)."""
    try:
        text = job_log(job).read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"job \d+ failed: (.*)", text)
    return match.group(1).strip() if match else None


def markdown_table(
    rows: list[dict], metric: str, skipped: list[dict] = (), maximize: bool = False, errors_in: str | None = None
) -> str:
    """One row per run: label, final step (marked when the run did not finish), final and best ``metric`` (the
    highest with ``maximize``), and the final's gap to the best run's; and one row per sweep job that logged
    nothing, with its error if any (``errors_in``: the metric whose table shows the errors, where this one is not
    it). A sweep's jobs are listed in job order (:func:`table_order`)."""

    def failed(error: str) -> str:
        return f"failed (error in the {errors_in} table)" if errors_in else f"failed: {_cell(error)}"

    best = best_row(rows, maximize)
    ref = best["final"] if best else float("nan")
    best_name = f"best (highest) {metric}" if maximize else f"best {metric}"
    header = [
        f"| run | final step | final {metric} | {best_name} (step) | vs best final |",
        "|---|---:|---:|---:|---:|",
    ]
    lines = []
    for r in rows:
        if r.get("missing"):  # the run has not logged the metric at all
            status = failed(r["error"]) if r.get("error") else "-"
            lines.append(f"| {r['label']} | {status} | - | - | - |")
            continue
        comparable = math.isfinite(r["final"]) and math.isfinite(ref) and ref
        gap = f"{(r['final'] / ref - 1) * 100:+.2f}%" if comparable else "-"
        best = f"{_number(r['best'])} ({r['best_step']})" if r["best_step"] is not None else "-"
        step = r["final_step"]
        if r.get("finished") is False or r.get("error"):
            step = f"{step} ({'failed' if r.get('error') else 'unfinished'})"
        lines.append(f"| {r['label']} | {step} | {_number(r['final'])} | {best} | {gap} |")
    for job in skipped:
        status = (
            failed(job["error"])
            if job.get("error")
            else "not started"
            if job.get("not_started")
            else "no metrics logged (not started, or stopped before logging)"
        )
        lines.append(f"| {job['label']} | {status} | - | - | - |")
    order = table_order([r["dir"] for r in rows] + [job["dir"] for job in skipped])
    return "\n".join(header + [lines[i] for i in order]) + "\n"


def table_order(dirs: list[str]) -> list[int]:
    """Indices of ``dirs`` in table order: the jobs of one sweep (numbered subdirs of one dir) by job number, from
    where the first of them is; any other run where it is. A job that failed before logging is skipped by
    :func:`expand_runs` and comes after the runs, but its row belongs between its neighbours."""
    paths = [Path(d) for d in dirs]
    first: dict[Path, int] = {}
    for i, path in enumerate(paths):
        if path.name.isdigit():
            first.setdefault(path.parent, i)
    return sorted(
        range(len(paths)),
        key=lambda i: (first[paths[i].parent], int(paths[i].name)) if paths[i].name.isdigit() else (i, -1),
    )


def _number(value: float) -> str:
    """4 decimals (losses, bytes), or 4 significant digits for a value under 0.01 (an LR: 3e-05, not 0.0000)."""
    return f"{value:.4f}" if value == 0 or not math.isfinite(value) or abs(value) >= 0.01 else f"{value:.4g}"


_SUMMARY_KEYS = ("final_step", "final", "best", "best_step", "missing")


def metric_rows(rows: list[dict], metric: str) -> list[dict]:
    """``rows`` with ``metric``'s final and best values (from ``by_metric``) in place of the first metric's."""
    return [{**{k: v for k, v in r.items() if k not in _SUMMARY_KEYS}, **r["by_metric"][metric]} for r in rows]


def _cell(text: str, limit: int = 100) -> str:
    """An error message as one table cell: no '|', at most ``limit`` characters (the JSON keeps all of it)."""
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


LINE_STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]


def plot(curves: dict[str, dict[str, list[tuple[int, float]]]], metrics: list[str], out: Path, title: str = "",
         logy: bool = False) -> None:
    """One panel per metric, one line per run; ``curves[label][metric] = [(step, value), ...]``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, (label, tags) in enumerate(curves.items()):
            series = tags.get(metric)
            if series:
                steps, values = zip(*series)
                # the colour cycle has 10 entries: runs 10-19, 20-29, ... get another line style
                ax.plot(steps, values, label=label, marker="." if len(steps) < 60 else None, linewidth=1.3,
                        color=f"C{i % 10}", linestyle=LINE_STYLES[i // 10 % len(LINE_STYLES)])
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles = {}  # every run once, also one drawn only in a later panel (it lacks the first metric)
    for ax in axes[0]:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    order = [label for label in curves if label in handles]
    axes[0][0].legend([handles[label] for label in order], order, fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def compare(
    runs: list[str],
    metrics: list[str],
    labels: list[str] | None = None,
    out: str | None = None,
    table: str | None = None,
    title: str = "",
    logy: bool = False,
    maximize: list[str] = (),
) -> dict:
    """Read the runs, write the PNG (and table file) and return the JSON-able result. A metric in ``maximize`` is
    better higher (tokens/s); the others lower."""
    for m in maximize:
        if m not in metrics:
            raise CompareError(f"--maximize {m!r} is not one of the --metric values {metrics}; give it as --metric too")
    skipped: list[str] = []
    run_dirs = expand_runs(runs, skipped)
    if labels and len(labels) != len(run_dirs):
        raise CompareError(f"--labels has {len(labels)} entries but there are {len(run_dirs)} runs: "
                           f"{[str(r) for r in run_dirs]}")
    missing = jobs_not_started(run_dirs + [Path(j) for j in skipped])
    # a failed job's (and one not started's) differing value labels it too
    all_labels = make_labels(run_dirs + [Path(j) for j in skipped] + list(missing), missing)
    labels = _unique(labels or all_labels[: len(run_dirs)])  # curves are keyed by label: no run may hide another
    skipped_jobs = [{"label": label, "dir": job, "error": job_error(Path(job))}
                    for label, job in zip(all_labels[len(run_dirs):], skipped)]
    not_started = [
        {"label": label, "dir": str(job)} for label, job in zip(all_labels[len(run_dirs) + len(skipped) :], missing)
    ]
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    rows = []
    all_scalars = [read_scalars(run) for run in run_dirs]
    for metric in metrics:  # a typo is an error; a run without the metric (died before it was logged) is not
        if not any(metric in scalars for scalars in all_scalars):
            tags = sorted(set().union(*all_scalars))
            raise CompareError(f"no scalar {metric!r} in any of the {len(run_dirs)} runs; they have {tags}")
        for run, scalars in zip(run_dirs, all_scalars):
            if metric not in scalars:
                print(f"compare_runs: run {str(run)!r} has no scalar {metric!r} (it stopped before logging it?); "
                      f"it has {sorted(scalars)}", file=sys.stderr)
    for label, run, scalars in zip(labels, run_dirs, all_scalars):
        curves[label] = {m: scalars.get(m, []) for m in metrics}
        done = finished(run, scalars)
        error = job_error(run) if done is not True else None  # a finished run's log may hold an earlier attempt's
        if done is False and error:  # its train.log says why; its row says 'failed'
            print(f"compare_runs: run {str(run)!r} failed: {error}", file=sys.stderr)
        elif done is False:
            print(f"compare_runs: run {str(run)!r} did not finish (no summary.json, or it logged past the steps "
                  "that reports): its row is marked '(unfinished)'", file=sys.stderr)
        by_metric = {
            m: {**summarize(scalars.get(m, []), m in maximize), **({"missing": True} if m not in scalars else {})}
            for m in metrics
        }
        rows.append(
            {
                "label": label,
                "dir": str(run),
                "finished": done,
                **({"error": error} if error else {}),
                **by_metric[metrics[0]],
                "by_metric": by_metric,
            }
        )
    table_jobs = skipped_jobs + [{**job, "not_started": True} for job in not_started]
    tables = [  # a failed job's error in the first table only
        markdown_table(metric_rows(rows, m), m, table_jobs, m in maximize, metrics[0] if i else None)
        for i, m in enumerate(metrics)
    ]
    text = "\n".join(tables)  # a blank line between
    if table:
        Path(table).parent.mkdir(parents=True, exist_ok=True)
        Path(table).write_text(text)
    if out:
        if not Path(out).suffix:  # matplotlib would append .png itself; report the file actually written
            out = f"{out}.png"
        plot(curves, metrics, Path(out), title=title, logy=logy)
    best_by_metric = {
        m: best["label"] if (best := best_row(metric_rows(rows, m), m in maximize)) else None for m in metrics
    }
    return {
        "metric": metrics[0],
        "runs": rows,
        "best": best_by_metric[metrics[0]],
        "png": out,
        "table": table,
        "skipped": skipped,
        "skipped_jobs": skipped_jobs,
        "not_started": not_started,
        "metrics": metrics,
        "best_by_metric": best_by_metric,
        "maximize": list(maximize),
        "markdown": text,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run dirs, or sweep dirs whose job subdirs are runs")
    parser.add_argument(
        "--metric",
        action="append",
        default=None,
        help="scalar tag to plot and tabulate (repeatable; one panel and one table each; the first one picks the "
        "JSON's 'best'). Default: val/loss",
    )
    parser.add_argument(
        "--maximize",
        action="append",
        default=[],
        metavar="METRIC",
        help="a --metric that is better higher (tokens/s, comm/compression_ratio): its best value and best run are the "
        "highest (repeatable). The others are better lower",
    )
    parser.add_argument("--labels", default=None, help="comma-separated run labels (default: differing overrides)")
    parser.add_argument("--out", default="compare_runs.png", help="PNG to write (default: compare_runs.png)")
    parser.add_argument("--table", default=None, help="also write the markdown table to this file")
    parser.add_argument("--title", default="", help="figure title")
    parser.add_argument("--logy", action="store_true", help="log-scale y axis")
    args = parser.parse_args(argv)
    try:
        result = compare(
            args.runs,
            args.metric or ["val/loss"],
            args.labels.split(",") if args.labels else None,
            args.out,
            args.table,
            args.title,
            args.logy,
            args.maximize,
        )
    except CompareError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        print(json.dumps({"error": str(e)}))
        return 2
    print(result.pop("markdown"), end="")
    print(f"wrote {result['png']}" + (f" and {result['table']}" if result["table"] else ""))
    print(json.dumps(_finite_or_none(result), allow_nan=False))  # strict JSON: NaN/inf (a diverged run) -> null
    return 0


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
