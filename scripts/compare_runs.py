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
dir names. Table rows follow the RUNs in the order given; below one RUN, the run dirs by path, a sweep's jobs by
job number; a job that failed, did not finish or never started keeps its place among them and its row says so.
The last line printed is one JSON object: ``runs`` (each with the first metric's values and ``by_metric``,
every metric's), ``best`` (by the first metric) and ``best_by_metric``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# reading run and sweep dirs (what train(cfg) writes there) is lit_dtrain.run_dirs; this script compares them
from lit_dtrain.run_dirs import (
    EVENT_GLOB,
    NO_LOGGER,
    RunDirError,
    expand_runs,
    finished,
    finished_without_metrics,
    hydra_overrides,
    job_error,
    jobs_not_started,
    read_scalars,
    table_cell,
)
from lit_dtrain.utils.args import ScriptArgumentParser, report_error
from lit_dtrain.utils.plots import OutputPathError, output_path, write_atomically

CompareError = RunDirError  # a run dir, an event file or a metric is missing; the message names it


def _warn(message: str) -> None:
    print(f"compare_runs: {message}", file=sys.stderr)


def read_event_file(path: Path) -> tuple[list, int, str | None]:
    """The TensorBoard events of one event file, in order, the bytes they take, and why reading stopped before the
    file's end (None: it did not). A file cut mid-record (its writer killed, a full disk) or damaged further on
    yields the events before that point; TensorBoard's own reader stops there silently (``EventFileLoader`` logs
    it at debug level only), so a run read as one that had logged less."""
    from tensorboard.backend.event_processing.event_file_loader import _make_tf_record_iterator
    from tensorboard.compat import tf
    from tensorboard.compat.proto import event_pb2

    events: list = []
    size = 0
    try:
        for record in _make_tf_record_iterator(str(path)):
            events.append(event_pb2.Event.FromString(record))
            size += len(record) + 16  # a record: its length (8 bytes), its crc, the event, the event's crc
    except tf.errors.DataLossError as e:  # its message names the file (as bytes): say what it means instead
        cut = "truncated" in str(e)
        return events, size, ("it ends in a partial record: its writer was killed mid-record, or the disk was full"
                              if cut else "a record fails its crc check: the file is damaged there")
    except Exception as e:  # noqa: BLE001 - any other failure to read a record ends what can be read too
        return events, size, f"{type(e).__name__}: {e}"
    return events, size, None


def check_event_files(run_dirs: list[Path], all_scalars: list[dict]) -> None:
    """A run whose event files are all unreadable, holding no TensorBoard event at all (garbage, truncated to
    nothing, or empty: a file TensorBoard's writer made holds at least its ``file_version`` event), and that has no
    metrics.csv scalars is an error naming them; TensorBoard's reader skips such files silently, so the run read as
    a run with no scalars. An unreadable file beside readable ones is a warning naming it, and so is a file that
    cannot be read to its end (what could be read of it is used: the warning says how much)."""
    for run, scalars in zip(run_dirs, all_scalars):
        bad = []
        for path in sorted(run.rglob(EVENT_GLOB)):
            events, size, stopped = read_event_file(path)
            if not events:
                bad.append(path)
            elif stopped:
                _warn(f"run {str(run)!r}: event file {str(path)!r} cannot be read to its end ({stopped}); using its "
                      f"first {len(events)} events, up to step {max(e.step for e in events)} ({size} of its "
                      f"{path.stat().st_size} bytes)")
        if not bad:
            continue
        names = ", ".join(repr(str(p)) for p in bad)
        if not scalars:
            raise CompareError(f"run {str(run)!r}: its event file(s) {names} hold no TensorBoard events (unreadable, "
                               "not an event file, or empty)")
        _warn(f"run {str(run)!r}: skipping event file(s) {names}: no TensorBoard events (unreadable or empty)")


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
    differing = [[o for o in ov if _as_value(o) not in common and not o.startswith("run_name=")] for ov in overrides]
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


def one_point_per_validation(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``series`` with its final validation once, at the steps trained.

    Lightning logs a validation during fit at the 0-based index of the last optimizer step (``S - 1`` after
    ``S`` steps), but ``train(cfg)``'s final ``trainer.validate`` at ``S``: when ``S`` is a multiple of
    ``val_check_interval`` both measure the same weights, and the series ends with the same value twice,
    one step apart. That pair is one measurement, kept at ``S`` (the steps trained). Any other point keeps its
    logged step."""
    if len(series) >= 2:
        (prev_step, prev), (last_step, last) = series[-2], series[-1]
        if last_step == prev_step + 1 and math.isclose(prev, last, rel_tol=1e-5):
            return [*series[:-2], series[-1]]
    return series


def summarize(series: list[tuple[int, float]], maximize: bool = False) -> dict:
    """Final and best (lowest, or highest with ``maximize``) value of one run's series, with their (TensorBoard)
    steps; the final validation counts once (:func:`one_point_per_validation`), so that one value never gets a
    best step one before its final step."""
    series = one_point_per_validation(series)
    if not series:
        return {"final_step": None, "final": float("nan"), "best": float("nan"), "best_step": None}
    final_step, final = series[-1]
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    if not finite:  # diverged from the first point: its steps are still known
        return {"final_step": final_step, "final": final, "best": float("nan"), "best_step": None}
    best_step, best = (max if maximize else min)(finite, key=lambda sv: sv[1])
    return {"final_step": final_step, "final": final, "best": best, "best_step": best_step}


def best_row(rows: list[dict], maximize: bool = False) -> dict | None:
    """The run with the lowest (``maximize``: highest) finite final value, among the finished ones when any run is
    marked unfinished."""
    finite = [r for r in rows if math.isfinite(r["final"])]
    done = [r for r in finite if r.get("finished") is not False and not r.get("error")]
    return (max if maximize else min)(done or finite, key=lambda r: r["final"]) if finite else None


def markdown_table(
    rows: list[dict],
    metric: str,
    skipped: list[dict] = (),
    maximize: bool = False,
    errors_in: str | None = None,
    given: list[str] = (),
) -> str:
    """One row per run: label, final step (marked when the run did not finish), final and best ``metric`` (the
    highest with ``maximize``), and the final's gap to the best run's; and one row per sweep job that logged
    nothing, with its error if any (``errors_in``: the metric whose table shows the errors, where this one is not
    it). Rows are in the order of the run and sweep dirs ``given`` (:func:`table_order`)."""

    def failed(error: str) -> str:
        return f"failed (error in the {errors_in} table)" if errors_in else f"failed: {table_cell(error)}"

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
            status = (
                failed(r["error"])
                if r.get("error")
                else f"unfinished (no {metric} logged)"
                if r.get("finished") is False
                else "-"
            )
            lines.append(f"| {r['label']} | {status} | - | - | - |")
            continue
        comparable = math.isfinite(r["final"]) and math.isfinite(ref) and ref
        # relative to |best|: a worse run is + (lower is better) or - (--maximize) also where the best is negative
        gap = f"{(r['final'] - ref) / abs(ref) * 100:+.2f}%" if comparable else "-"
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
            else NO_LOGGER
            if finished_without_metrics(Path(job["dir"]))
            else "no metrics logged (not started, or stopped before logging)"
        )
        lines.append(f"| {job['label']} | {status} | - | - | - |")
    order = table_order([r["dir"] for r in rows] + [job["dir"] for job in skipped], given)
    return "\n".join(header + [lines[i] for i in order]) + "\n"


def table_order(dirs: list[str], given: list[str] = ()) -> list[int]:
    """Indices of ``dirs`` in table order: the order of the arguments ``given`` (run dirs, sweep dirs, ``outputs``)
    that hold them; below one argument, by path, a sweep's job dirs (numbered subdirs of one dir) by job number.
    The jobs of one sweep stay together, where its first job's argument is (the README's ``<sweep>/*`` glob gives
    each job as an argument). Whether a run logged, failed or never started does not move its row: rows of jobs
    that logged nothing come after the others in ``dirs``, but belong between their neighbours. Without ``given``,
    the order of ``dirs``."""
    paths = [Path(d) for d in dirs]
    roots = [Path(g).expanduser() for g in given]

    def argument(i: int) -> int:
        if not roots:
            return i
        return next((n for n, root in enumerate(roots) if root == paths[i] or root in paths[i].parents), len(roots))

    groups = [p.parent if p.name.isdigit() else p for p in paths]
    position: dict[Path, int] = {}
    for i, group in enumerate(groups):
        position[group] = min(position.get(group, argument(i)), argument(i))

    def path_key(path: Path) -> tuple:
        return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts)

    return sorted(range(len(paths)), key=lambda i: (position[groups[i]], path_key(paths[i]), i))


def _number(value: float) -> str:
    """4 decimals (losses, bytes), or 4 significant digits for a value under 0.01 (an LR: 3e-05, not 0.0000)."""
    return f"{value:.4f}" if value == 0 or not math.isfinite(value) or abs(value) >= 0.01 else f"{value:.4g}"


_SUMMARY_KEYS = ("final_step", "final", "best", "best_step", "missing")


def metric_rows(rows: list[dict], metric: str) -> list[dict]:
    """``rows`` with ``metric``'s final and best values (from ``by_metric``) in place of the first metric's."""
    return [{**{k: v for k, v in r.items() if k not in _SUMMARY_KEYS}, **r["by_metric"][metric]} for r in rows]


LINE_STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]


def plot(curves: dict[str, dict[str, list[tuple[int, float]]]], metrics: list[str], out: Path, title: str = "",
         logy: bool = False) -> None:
    """One panel per metric, one line per run; ``curves[label][metric] = [(step, value), ...]``. A run's final
    validation is drawn once, at the steps trained (:func:`one_point_per_validation`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, (label, tags) in enumerate(curves.items()):
            series = one_point_per_validation(tags.get(metric) or [])
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # below the panels, not inside one: a sweep's labels can be wider than a panel and would hide its curves;
    # bbox_inches="tight" grows the PNG to hold all of it
    axes[0][0].legend([handles[label] for label in order], order, fontsize=7, loc="upper left",
                      bbox_to_anchor=(0, -0.16), borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))
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
    better higher (train/device/items_per_sec); the others lower."""
    for m in maximize:
        if m not in metrics:
            raise CompareError(f"--maximize {m!r} is not one of the --metric values {metrics}; give it as --metric too")
    try:  # before reading the runs: an unwritable --out or --table used to be a traceback after it
        out = str(output_path(out, "--out", image=True)) if out else out
        table = str(output_path(table, "--table")) if table else table
    except OutputPathError as e:
        raise CompareError(str(e)) from e
    skipped: list[str] = []
    run_dirs = expand_runs(runs, skipped, _warn)
    if labels and len(labels) != len(run_dirs):
        raise CompareError(f"--labels has {len(labels)} entries but there are {len(run_dirs)} runs: "
                           f"{[str(r) for r in run_dirs]}")
    missing = jobs_not_started(run_dirs + [Path(j) for j in skipped], _warn)
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
    check_event_files(run_dirs, all_scalars)
    for metric in metrics:  # a typo is an error; a run without the metric (died before it was logged) is not
        if not any(metric in scalars for scalars in all_scalars):
            tags = sorted(set().union(*all_scalars))
            have = f"they have {tags}" if tags else "they have no scalars at all (stopped before logging any?)"
            raise CompareError(f"no scalar {metric!r} in any of the {len(run_dirs)} runs; {have}")
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
        markdown_table(metric_rows(rows, m), m, table_jobs, m in maximize, metrics[0] if i else None, runs)
        for i, m in enumerate(metrics)
    ]
    text = "\n".join(tables)  # a blank line between
    if table:
        write_atomically(Path(table), lambda tmp: Path(tmp).write_text(text))
    if out:
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
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        help="a --metric that is better higher (train/device/items_per_sec, comm/compression_ratio): its best value "
        "and best run are the highest (repeatable). The others are better lower",
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
        report_error(str(e), "compare_runs")
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
