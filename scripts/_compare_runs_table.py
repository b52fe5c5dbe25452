"""compare_runs.py's summary of runs: each run's final and best value of a metric, the best run, and the markdown
table of them, its rows in the order of the run and sweep dirs given."""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from pathlib import Path

from lit_dtrain.run_dirs import NO_LOGGER, finished_without_metrics, table_cell


def at_steps_trained(series: list[tuple[int, float]], steps_trained: int | None = None,
                     train_run: bool = False) -> list[tuple[int, float]]:
    """``series`` with each point at the optimizer steps trained when it was measured, the count checkpoint names
    (``step000010-...ckpt`` after 10 steps) and ``summary.json``'s ``steps`` use. Lightning logs during fit at the
    step's 0-based index ``s``: a validation there measured the weights after ``s + 1`` steps, a ``train/loss`` there
    is the ``s + 1``-th step's. ``train(cfg)``'s final validate is logged at the steps trained already: the last
    point where it is ``steps_trained`` (a finished run's, merged with an equal value one step before it,
    :func:`one_point_per_validation`). A ``train_run`` (a ``train.py`` run dir) without ``steps_trained`` has not
    finished: no final validate (``compare_runs`` gives an unfinished run its ``trainer.max_steps``, where a point of a
    run killed after its final validate can only be that validate's, :func:`configured_max_steps`). Only where
    nothing tells (another dir) is a final equal pair taken for one. A table
    that gave the logged steps named a validation after 10 steps 'step 9', beside 'step 10' for the same run's final
    validate and a checkpoint 'step000010'; a constant tag logged every step (an LR of scheduler=constant) is no
    final validate either (its last point read one step below the run's others)."""
    if steps_trained is None and not train_run:
        merged = one_point_per_validation(series)
        final = len(merged) < len(series)  # the last point is the final validate's
    else:
        final = bool(series) and series[-1][0] == steps_trained
        merged = one_point_per_validation(series) if final else series
    return [(s if final and i == len(merged) - 1 else s + 1, v) for i, (s, v) in enumerate(merged)]


def configured_max_steps(run: Path) -> int | None:
    """``trainer.max_steps`` of a ``train.py`` run dir (its ``config_resolved.yaml``), None where it is not a positive
    int. A fit logs at most at ``max_steps - 1``: a point logged at ``max_steps`` is the final validate's, also in a run
    without ``summary.json`` (killed in its sample), whose final ``val/loss`` read as one step more than it trained."""
    from omegaconf import OmegaConf

    try:
        steps = OmegaConf.load(run / "config_resolved.yaml").trainer.get("max_steps")
    except Exception:  # noqa: BLE001 - no (readable) config
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def logged_at_step_start(tag: str) -> bool:
    """Whether ``tag`` is logged at the start of an optimizer step, before it trains: LearningRateMonitor's ``lr-*``
    (in ``on_train_batch_start``; its point at logged step ``s`` is the LR of the ``s + 1``-th step). Its
    ``-effective`` LRs are logged at the step's end, once the update used them, as every other tag is."""
    return tag.startswith("lr-") and not tag.endswith("-effective")


def without_the_step_not_trained(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """A run that did not finish, its start-of-step tags (:func:`logged_at_step_start`) without their points at the
    step it failed or was killed in: the last step they logged, where no other tag logged that step or a later one
    (the step's own rows, written at its end at the same cadence). A failed 2nd step's LR, logged as it began, made
    the run's LR table say '2 (failed)' steps trained, and drew an LR at 2 steps' tokens, of a run that trained 1."""
    started = max((s[-1][0] for tag, s in scalars.items() if s and logged_at_step_start(tag)), default=None)
    ended = max((s[-1][0] for tag, s in scalars.items() if s and not logged_at_step_start(tag)), default=-1)
    if started is None or ended >= started:
        return scalars
    return {tag: [(s, v) for s, v in series if s < started] if logged_at_step_start(tag) else series
            for tag, series in scalars.items()}


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


# The better direction of every scalar tag a lit_dtrain run logs: True (higher), False (lower) or None (no better
# value: a setting, a diagnostic, a count of progress; its table shows no best and best_by_metric is null). fnmatch
# patterns, the first match wins. tests/e2e/test_scalar_axes.py checks every tag of a run with every callback against
# it (tests/unit/test_compare_runs_directions.py the comm/* tags, which need DDP), so a new tag cannot go unlisted.
# A tag no pattern matches (one's own metric) is ranked lower-is-better, as a loss.
TAG_DIRECTIONS: tuple[tuple[str, bool | None], ...] = (
    ("lr-*", None),  # LearningRateMonitor's lr-<optimizer>/<group> and its -effective, -momentum, -weight_decay
    ("epoch", None),
    ("train/loss", False),
    ("val/loss", False),
    ("val/ppl", False),
    ("val/*/loss", False),  # each source of a mixture
    ("*_per_sec", True),  # ThroughputMonitor's rates (per device and, with several ranks, global)
    ("*/mfu", True),
    ("train/time", None),  # time since the fit started: grows with the steps, no run is better for a higher or lower
    ("validate/time", False),  # that validation's wall time
    ("train/batches", None),  # progress counters
    ("train/samples", None),
    ("train/lengths", None),
    ("train/tokens", None),
    ("validate/batches", None),
    ("validate/samples", None),
    ("validate/lengths", None),
    ("train/grad_norm", None),  # diagnostics of the step: neither value is better
    ("data/share/*", None),  # a mixture's share of the windows drawn from each source: set by the weights
    ("grad_clip/*", None),  # AdaptiveGradClip: the norm, whether it clipped, the threshold, the clips so far
    ("optim/*", None),  # OptimizerDiagnostics: update/param RMS, grad RMS, the share of eps-dominated updates
    ("spike/count", False),  # LossSpikeMonitor: the spikes so far
    ("spike/loss_z", None),
    ("spike/lr_multiplier", None),
    ("fourier/lr_mult", None),  # FourierSampler: its stage settings and its sampling distribution
    ("fourier/bands", None),
    ("fourier/mix", None),
    ("fourier/prob_entropy", None),
    ("fourier/prob_max_ratio", None),
    ("fourier/prob_min_ratio", None),
    ("fourier/top_band_energy", None),
    ("fourier/comm_bytes_per_step", False),
    ("fourier/nonfinite_skipped", False),  # non-finite losses it left out so far
    ("comm/compression_ratio", True),  # compressed DDP: dense bytes / bytes sent
    ("comm/bytes_per_step", False),
    ("comm/bytes_per_step_avg", False),
    ("comm/time_ms", False),
    ("comm/time_ms_avg", False),
    ("comm/hook_calls", None),  # buckets seen by the hook so far
    ("ckpt/*", None),  # SelectiveCheckpointing: its plan's blocks per mode and the budget probe's figures of it
    ("memory/*", False),  # MemoryMonitor: RSS, peak RSS, CUDA allocated/reserved/window peak (MiB); less is better
)


# Tags that count or average since the run started: their first point (0 at step 1: no spike yet, nothing sent yet by
# local SGD) is no run's best, and a run is ranked by its final value alone; their table has no best value.
# comm/compression_ratio is one (all dense bytes so far / all bytes sent so far): under local SGD it climbs between
# syncs (4, 5, 6, 7 at H=4) and falls back at each, so its highest point was a 'best' ratio the run never had overall.
# A memory figure is ranked by its final value too: its lowest point is the first row (before the optimizer state
# exists, or the peak since the start has grown), no run's best; the final is the run's peak RSS (non-decreasing) or
# its memory in the steady state at its end.
CUMULATIVE_TAGS: tuple[str, ...] = ("spike/count", "fourier/nonfinite_skipped", "comm/bytes_per_step_avg",
                                     "comm/time_ms_avg", "comm/compression_ratio", "memory/*")


# Tags of the last step's collectives: 0 on a step that sent nothing, which under local updates (sync every H steps) is
# most steps; such a point measures no sync, so a run's final and best are its logged syncs' (a local-SGD run whose
# last logged step did not sync was the best run, at 0 bytes and 0 ms). comm/bytes_per_step_avg ranks the savings.
PER_SYNC_TAGS: tuple[str, ...] = ("comm/bytes_per_step", "comm/time_ms")


def measured(metric: str, series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``series`` without the points of steps that sent nothing, for a per-sync tag (:data:`PER_SYNC_TAGS`)."""
    if metric not in PER_SYNC_TAGS:
        return series
    return [(step, value) for step, value in series if value != 0]


def final_only(metric: str) -> bool:
    """Whether ``metric`` is cumulative (:data:`CUMULATIVE_TAGS`): ranked by its final value, with no best value."""
    return any(fnmatchcase(metric, pattern) for pattern in CUMULATIVE_TAGS)


def listed_direction(metric: str) -> tuple[bool, bool | None]:
    """``(whether TAG_DIRECTIONS lists the tag, its direction)``; an unlisted tag is ranked lower-is-better."""
    for pattern, better in TAG_DIRECTIONS:
        if fnmatchcase(metric, pattern):
            return True, better
    return False, False


def direction(metric: str, maximize: list[str] = ()) -> bool | None:
    """``True`` (better higher: a ``--maximize`` metric, a throughput, the compression ratio), ``False`` (better lower:
    losses, bytes, a step's or a validation's time, spikes) or ``None`` (no direction: an LR, a multiplier, a
    diagnostic, a counter, the epoch, unless ``--maximize`` names it); :data:`TAG_DIRECTIONS`."""
    return True if metric in maximize else listed_direction(metric)[1]


def summarize(series: list[tuple[int, float]], maximize: bool | None = False, cumulative: bool = False) -> dict:
    """Final and best (lowest, or highest with ``maximize``; none with ``maximize=None``, a metric without a
    direction, or ``cumulative``, one ranked by its final value alone) value of one run's series, with their
    steps (of ``series``: the steps trained, :func:`at_steps_trained`)."""
    if not series:
        return {"final_step": None, "final": float("nan"), "best": float("nan"), "best_step": None}
    final_step, final = series[-1]
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    if not finite or maximize is None or cumulative:  # diverged from the first point, unranked, or final only
        return {"final_step": final_step, "final": final, "best": float("nan"), "best_step": None}
    best_step, best = (max if maximize else min)(finite, key=lambda sv: sv[1])
    return {"final_step": final_step, "final": final, "best": best, "best_step": best_step}


def comparable(row: dict) -> bool:
    """Whether a run's final value can be set beside other runs': a finished run's (or one whose end is not known);
    a failed or unfinished run stopped at another step."""
    return row.get("finished") is not False and not row.get("error")


def best_row(rows: list[dict], maximize: bool | None = False) -> dict | None:
    """The run with the lowest (``maximize``: highest) finite final value, among the finished ones when any run is
    marked unfinished; ``None`` for a metric without a direction (``maximize=None``)."""
    if maximize is None:
        return None
    finite = [r for r in rows if math.isfinite(r["final"])]
    done = [r for r in finite if comparable(r)]
    return (max if maximize else min)(done or finite, key=lambda r: r["final"]) if finite else None


def markdown_table(
    rows: list[dict],
    metric: str,
    skipped: list[dict] = (),
    maximize: bool | None = False,
    errors_in: str | None = None,
    given: list[str] = (),
) -> str:
    """One row per run: label, final step (marked when the run did not finish), final and best ``metric`` (the
    highest with ``maximize``; ``-`` with ``maximize=None``, a metric without a direction, and for a cumulative one,
    :func:`final_only`), and the final's gap to the best run's (``-`` for a failed or unfinished run, stopped at
    another step, unless the best run is one too: no run finished); and one row per sweep job that logged
    nothing, with its error if any (``errors_in``: the metric whose table shows the errors, where this one is not
    it). Rows are in the order of the run and sweep dirs ``given`` (:func:`table_order`)."""

    def failed(error: str) -> str:
        return f"failed (error in the {errors_in} table)" if errors_in else f"failed: {table_cell(error)}"

    best = best_row(rows, maximize)
    ref = best["final"] if best else float("nan")
    best_name = {True: f"best (highest) {metric} (steps trained)", False: f"best {metric} (steps trained)",
                 None: "best (not ranked)"}
    best_header = "best (cumulative: ranked by final)" if final_only(metric) and maximize is not None else None
    header = [
        f"| run | steps trained | final {metric} | {best_header or best_name[maximize]} | vs best final |",
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
        if r["final_step"] is None:  # logged, but only steps that sent nothing (:func:`measured`)
            lines.append(f"| {r['label']} | no sync logged | - | - | - |")
            continue
        # a failed or unfinished run's final is at another step than the finished runs': no gap beside theirs
        same_end = comparable(r) or (best is not None and not comparable(best))
        gap_known = same_end and math.isfinite(r["final"]) and math.isfinite(ref) and ref
        # relative to |best|: a worse run is + (lower is better) or - (--maximize) also where the best is negative
        gap = _percent((r["final"] - ref) / abs(ref) * 100) if gap_known else "-"
        best_cell = f"{_number(r['best'])} ({r['best_step']})" if r["best_step"] is not None else "-"
        step = r["final_step"]
        if r.get("finished") is False or r.get("error"):
            step = f"{step} ({'failed' if r.get('error') else 'unfinished'})"
        elif r.get("diverged") or r.get("stopped"):  # finished, as summary.json says: its final NaN (diverged,
            # module.check_finite=false, since when), or stopped before max_steps (early_stopping, max_time, ...)
            since = r.get("first_nonfinite_step")
            diverged = f"diverged{f' from step {since}' if since is not None else ''}" if r.get("diverged") else None
            step = f"{step} ({', '.join(m for m in (diverged, r.get('stopped')) if m)})"
        lines.append(f"| {r['label']} | {step} | {_number(r['final'])} | {best_cell} | {gap} |")
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
    """4 decimals (losses, bytes), or 4 significant digits for a value under 0.01 (an LR: 3e-05, not 0.0000) and in
    exponent form from 1e6 (a diverged run's perplexity: 4.937e+29, not a 30-digit number; FLOP/s: 8.860e+08)."""
    if value == 0 or not math.isfinite(value) or 0.01 <= abs(value) < 1e6:
        return f"{value:.4f}"
    return f"{value:.4g}" if abs(value) < 0.01 else f"{value:.3e}"


def _percent(value: float) -> str:
    """A gap in percent, signed: 2 decimals (``+4.00%``), in exponent form from 1e6 % as :func:`_number`."""
    return f"{value:+.2f}%" if abs(value) < 1e6 else f"{value:+.3e}%"


_SUMMARY_KEYS = ("final_step", "final", "best", "best_step", "missing")


def metric_rows(rows: list[dict], metric: str) -> list[dict]:
    """``rows`` with ``metric``'s final and best values (from ``by_metric``) in place of the first metric's."""
    return [{**{k: v for k, v in r.items() if k not in _SUMMARY_KEYS}, **r["by_metric"][metric]} for r in rows]
