#!/usr/bin/env python
"""Compare runs from their TensorBoard event files (or ``logger=csv``'s metrics.csv): a PNG of val loss (or any
scalar) against the steps trained, and a markdown table of final and best values per metric, at the steps trained
when each was measured (as checkpoint names count them; Lightning logs during fit at the 0-based step, one lower).

    python scripts/compare_runs.py outputs/runs/a outputs/runs/b --out compare.png --table compare.md
    python scripts/compare_runs.py outputs/multiruns/2026-01-01_12-00-00.123456   # every job of a sweep
    python scripts/compare_runs.py RUN... --metric val/loss --metric lr-AdamW/decay   # one panel per metric
    python scripts/compare_runs.py RUN... --metric train/device/items_per_sec --maximize train/device/items_per_sec

A RUN is a run dir (event files anywhere below it, e.g. ``tb/``, or a ``metrics.csv``, e.g. ``csv/``) or a sweep
dir whose job subdirs are runs. Labels come from ``--labels``, else from the Hydra overrides that differ between runs
(but ``run_name`` and ``resume``, which do not change what a run trains; ``overrides.yaml``, written by ``train.py``
when it trains; ``.hydra/overrides.yaml`` for older runs), checked against what each run trained with (its
``config_resolved.yaml``: a default typed for one run is no difference, and a run that kept the default of a key
another run changed is labelled with that default), else from the dir names. Table rows follow the RUNs in
the order given; below one RUN, the run dirs by path, a sweep's jobs by job number; a job that failed, did not
finish or never started keeps its place among them and its row says so.
A last table gives each finished run's steps, tokens trained (all ranks; a step a loss spike dropped is named, and
its tokens left out) and wall time (a resumed run's: its last start's, from the step it names), from its summary.json;
the other runs and jobs have their status there.
The last line printed is one JSON object: ``runs`` (in the table's order, each with the first metric's values,
``by_metric``, every metric's, and ``cost``, the last table's), ``best`` (by the first metric) and ``best_by_metric``.
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
    RunDirError,
    expand_runs,
    finished,
    job_error,
    jobs_not_started,
    read_scalars,
    summary_marks,
    summary_steps,
    table_cell,  # noqa: F401 - compare_runs.table_cell: the markdown table's cells (_compare_runs_table)
)
from lit_dtrain.utils.args import ScriptArgumentParser, quiet_when_the_reader_goes, report_error
from lit_dtrain.utils.atomic import AtomicWriteError
from lit_dtrain.utils.plots import OutputPathError, output_path, write_atomically
from lit_dtrain.utils.scripts import import_beside

import_beside(__file__)  # this script's modules beside it, scripts/_compare_runs_*.py, also where a test loads it
from _compare_runs_groups import best_group, groups_table, make_groups, mean_curves, summarize_groups  # noqa: E402
from _compare_runs_labels import _unique, make_labels  # noqa: E402 - labels of runs
from _compare_runs_plot import LINE_STYLES, plot  # noqa: E402, F401 - the PNG (compare_runs.plot: bench_wsd.py's too)
from _compare_runs_table import (  # noqa: E402 - final and best values, the markdown table
    at_steps_trained,
    best_row,
    configured_max_steps,
    direction,
    final_only,
    listed_direction,  # noqa: F401 - compare_runs.listed_direction: whether TAG_DIRECTIONS lists a tag
    markdown_table,
    measured,
    metric_rows,
    summarize,
    table_order,
    without_the_step_not_trained,
)
from _compare_runs_tokens import (  # noqa: E402 - --x tokens, and each run's tokens and wall time
    ONE_RATE_NOTE,
    cost_table,
    run_cost,
    tokens_trained,
    uneven_tokens_note,
)

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


def _once(dirs: list[Path], what: str) -> list[Path]:
    """``dirs`` with a dir reached again (given twice, or as a sweep and as one of its jobs) left out, with a warning:
    it was compared with itself, two rows and two curves of the same values, as if a rerun had reproduced it."""
    seen: dict[Path, Path] = {}
    for d in dirs:
        key = d.resolve()
        if key in seen:
            _warn(f"{what} dir {str(d)!r} is given more than once (as {str(seen[key])!r}); comparing it once")
        else:
            seen[key] = d
    return list(seen.values())


def steps_trained_of(run: Path, scalars: dict[str, list[tuple[int, float]]]):
    """A function that puts a series of ``run``'s (logged steps) at the steps trained when each point was measured
    (:func:`at_steps_trained`), its final validate where ``train(cfg)`` ran one: the x of the PNG and the tables."""
    done = finished(run, scalars)
    # its final validate's step; an unfinished run's, if it got there, at trainer.max_steps (fit logs below it)
    end = summary_steps(run) if done is True else configured_max_steps(run) if done is False else None

    def trained(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
        return at_steps_trained(series, end, train_run=done is not None)

    return trained


def compare(
    runs: list[str],
    metrics: list[str],
    labels: list[str] | None = None,
    out: str | None = None,
    table: str | None = None,
    title: str = "",
    logy: bool = False,
    maximize: list[str] = (),
    x: str = "step",
    over: list[str] = (),
) -> dict:
    """Read the runs, write the PNG (and table file) and return the JSON-able result. A metric in ``maximize`` is
    better higher; every other tag lit_dtrain logs has its direction in ``TAG_DIRECTIONS`` (:func:`direction`: a
    throughput or the compression ratio higher, losses, bytes and times lower, an LR, multiplier, diagnostic or
    counter none); a tag it does not list is better lower. ``over``: keys (``seed``) whose runs are summarized as one
    group each, mean ± standard deviation (:mod:`_compare_runs_groups`); the PNG draws the groups' mean curves."""
    for m in maximize:
        if m not in metrics:
            raise CompareError(f"--maximize {m!r} is not one of the --metric values {metrics}; give it as --metric too")
    try:  # before reading the runs: an unwritable --out or --table used to be a traceback after it
        out = str(output_path(out, "--out", image=True)) if out else out
        table = str(output_path(table, "--table")) if table else table
    except OutputPathError as e:
        raise CompareError(str(e)) from e
    ranks = {m: direction(m, maximize) for m in metrics}
    skipped: list[str] = []
    run_dirs = _once(expand_runs(runs, skipped, _warn), "run")
    skipped[:] = map(str, _once([Path(j) for j in skipped], "job"))
    if labels and len(labels) != len(run_dirs):
        raise CompareError(f"--labels has {len(labels)} entries but there are {len(run_dirs)} runs: "
                           f"{[str(r) for r in run_dirs]}")
    missing = jobs_not_started(run_dirs + [Path(j) for j in skipped], _warn, given=runs)  # of sweeps given whole
    # a failed job's (and one not started's) differing value labels it too
    all_labels = make_labels(run_dirs + [Path(j) for j in skipped] + list(missing), missing)
    # each run's group, and those of the jobs that logged nothing (counted beside their group's runs)
    all_groups = make_groups(run_dirs + [Path(j) for j in skipped] + list(missing), list(over), missing) if over else []
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
    # a run that did not finish: no LR of the step it failed or was killed in, a step it never trained
    all_scalars = [without_the_step_not_trained(s) if finished(r, s) is False else s
                   for r, s in zip(run_dirs, all_scalars)]
    # a run that logged none of the metrics (a job failed at its start) is not drawn: its tokens are not asked for
    per_step = [tokens_trained(str(r), s) if any(m in s for m in metrics) else (None, {})
                for r, s in zip(run_dirs, all_scalars)] if x == "tokens" else None
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
        done = finished(run, scalars)
        trained = steps_trained_of(run, scalars)
        curves[label] = {m: trained(scalars.get(m, [])) for m in metrics}
        error = job_error(run) if done is not True else None  # a finished run's log may hold an earlier attempt's
        if done is False and error:  # its train.log says why; its row says 'failed'
            print(f"compare_runs: run {str(run)!r} failed: {error}", file=sys.stderr)
        elif done is False and (run / "summary.json").is_file() and summary_steps(run) is None:
            print(f"compare_runs: run {str(run)!r}: its summary.json cannot be read (cut short or edited; train.py "
                  "writes it whole at the run's end): its row is marked '(unfinished)'", file=sys.stderr)
        elif done is False:
            print(f"compare_runs: run {str(run)!r} did not finish (no summary.json, it logged past the steps "
                  "that reports, or it started again since): its row is marked '(unfinished)'", file=sys.stderr)
        by_metric = {
            m: {
                **summarize(trained(measured(m, scalars.get(m, []))), ranks[m], final_only(m)),
                # none logged, or every point dropped (TensorBoard's purge at a later start's first step)
                **({"missing": True} if not scalars.get(m) else {}),
            }
            for m in metrics
        }
        rows.append(
            {
                "label": label,
                "dir": str(run),
                "finished": done,
                **({"error": error} if error else {}),
                **summary_marks(run),
                **by_metric[metrics[0]],
                "by_metric": by_metric,
                "cost": run_cost(str(run), scalars) if done is True else {},
                **(per_step[len(rows)][1] if per_step else {}),
            }
        )
    rows = [rows[i] for i in table_order([r["dir"] for r in rows], runs)]  # the JSON's runs in the table's order
    table_jobs = skipped_jobs + [{**job, "not_started": True} for job in not_started]
    tables = [  # a failed job's error in the first table only
        markdown_table(metric_rows(rows, m), m, table_jobs, ranks[m], metrics[0] if i else None, runs)
        for i, m in enumerate(metrics)
    ]
    text = "\n".join(tables)  # a blank line between
    groups, best_group_by_metric = [], {}
    if over:
        group_of = dict(zip(labels, all_groups))
        groups = summarize_groups(rows, group_of, metrics, all_groups[len(run_dirs):])
        text += "".join("\n" + groups_table(groups, m, list(over), ranks[m]) for m in metrics)
        best_group_by_metric = {m: best_group(groups, m, ranks[m]) for m in metrics}
    if one_rate := [r["label"] for r in rows if r.get("tokens_from") == "rate"]:
        text += "\n" + ONE_RATE_NOTE.format(runs=", ".join(map(repr, one_rate))) + "\n"
    if uneven := uneven_tokens_note(labels, run_dirs, all_scalars, x):
        text += "\n" + uneven + "\n"
    # what each run took (steps, tokens, wall time; printed after the notes), with a row for every job the tables
    # list: a failed or never-started job's status (a job that finished without logging metrics has its cost)
    cost_rows = rows + [{**job, "cost": run_cost(job["dir"], {})} for job in table_jobs]
    cost = cost_table([cost_rows[i] for i in table_order([r["dir"] for r in cost_rows], runs)])
    if table:
        write_atomically(Path(table), lambda tmp: Path(tmp).write_text(text + ("\n" + cost if cost else "")))
    if out:
        tokens = {label: at for label, (at, _) in zip(labels, per_step) if at} if per_step else None
        spread = None
        if over:  # a group's mean curve, drawn at its first run's tokens
            curves, spread = mean_curves(curves, rows, group_of, metrics)
            if tokens:  # reversed: the group's first run is put last, and stays
                tokens = {g: tokens[label] for label, g in reversed(group_of.items()) if label in tokens}
        plot(curves, metrics, Path(out), title=title, logy=logy, tokens=tokens, spread=spread)
    best_by_metric = {
        m: best["label"] if (best := best_row(metric_rows(rows, m), ranks[m])) else None for m in metrics
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
        "x": x,
        **({"over": list(over), "groups": groups, "best_group_by_metric": best_group_by_metric} if over else {}),
        "markdown": text,
        "cost_markdown": cost,
    }


@quiet_when_the_reader_goes  # `... | head`: ends as cat does
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
        help="a --metric that is better higher (one of your own): its best value and best run are the highest "
        "(repeatable). Without it, lit_dtrain's tags go their own way: a *_per_sec or */mfu throughput and "
        "comm/compression_ratio higher; the lr-* tags, LR multipliers, diagnostics (train/grad_norm, grad_clip/*, "
        "optim/*, spike/loss_z, fourier/prob_entropy, ...), progress counters, train/time and the epoch have no best "
        "(a '-'); losses, bytes, times and the others lower",
    )
    parser.add_argument("--labels", default=None, help="comma-separated run labels (default: differing overrides)")
    parser.add_argument("--out", default="compare_runs.png", help="PNG to write (default: compare_runs.png)")
    parser.add_argument("--table", default=None, help="also write the markdown table to this file")
    parser.add_argument("--title", default="", help="figure title")
    parser.add_argument("--logy", action="store_true", help="log-scale y axis")
    parser.add_argument(
        "--x",
        choices=("step", "tokens"),
        default="step",
        help="the PNG's x axis: the optimizer step (default), or the tokens trained when each point was measured "
        "(the run's logged train/tokens, step by step, also across a resume on other ranks or batch sizes; a run "
        "without it: the steps trained x its tokens per step, from its train/lengths and its number of ranks, with a "
        "note): runs of other batch sizes, ranks or accumulation compared at equal data. Steps are the steps "
        "trained when a value was measured, as in checkpoint names (TensorBoard's axis, Lightning's 0-based step, "
        "is one lower during fit); the JSON gives each run's tokens_per_step and tokens_from",
    )
    parser.add_argument(
        "--over",
        action="append",
        default=[],
        metavar="KEY",
        help="a swept key whose runs are repeats (repeatable): runs that differ only in it are one group, tabulated "
        "as the mean ± sample standard deviation of their finished runs' final and best values, and drawn as their "
        "mean curve with a band of one standard deviation; e.g. --over seed after -m seed=0,1,2 optimizer.lr=1e-3,3e-3",
    )
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
            args.x,
            args.over,
        )
    except (CompareError, AtomicWriteError) as e:  # AtomicWriteError: the PNG or table failed to write (a full disk)
        report_error(str(e), "compare_runs")
        return 2
    print(result.pop("markdown"), end="")
    if cost := result.pop("cost_markdown"):
        print("\n" + cost, end="")
    if written := [path for path in (result["png"], result["table"]) if path]:  # --out '': 'wrote ' named nothing
        print("wrote " + " and ".join(written))
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
