"""compare_runs.py's tokens axis (``--x tokens``): a sweep over the batch size (or the number of ranks, or the
gradient accumulation) compared at equal optimizer steps compares runs that have seen different amounts of data; at
equal tokens it does not. A run that logged ``train/tokens`` (the throughput callback's count of the tokens trained,
all ranks together, which a resume goes on from) is drawn against it, step by step (:func:`tokens_trained`): a run
resumed on another number of ranks or with another ``data.batch_size`` changes its tokens per step mid-run, and
one rate drew it off (+20 % at the end of a 2 -> 1 -> 2 rank run, -14 % for batches of 8, 4, then 16).

A run without it (written before ``train/tokens`` existed) gets one rate, today's rule, and a note under the tables
(:data:`ONE_RATE_NOTE`). Its tokens per optimizer step come from what it logged: ``train/lengths``, the tokens
this rank trained on so far (``ThroughputMonitor``, every micro-batch counted), times the number of ranks: the
ratio of the global ``train/items_per_sec`` to this rank's ``train/device/items_per_sec`` (logged with several ranks
once ``callbacks.throughput.window_size`` steps were timed), else ``trainer.devices * trainer.num_nodes`` of its
``config_resolved.yaml``, else one.

A point is drawn at the tokens trained when it was measured: the steps trained then
(``_compare_runs_table.at_steps_trained``: Lightning logs during fit at the optimizer step's 0-based index, so a
validation logged at ``s`` measured the weights after ``s + 1`` steps; drawn at ``s`` x tokens per step, it sat one
batch early, a larger batch's run further back than a smaller one's) x tokens per step."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable
from pathlib import Path

from lit_dtrain.run_dirs import RunDirError

LENGTHS = "train/lengths"
TOKENS = "train/tokens"  # lit_dtrain.callbacks.throughput.TOKENS
ONE_RATE_NOTE = (f"--x tokens: run(s) {{runs}} logged no {TOKENS!r} (written before the throughput callback logged "
                 "it, or stopped before its first logged step): drawn at one tokens-per-step rate (train/lengths' "
                 "median step x the ranks, else summary.json's stepped tokens, else its config), which is off where "
                 "a resume changed the number of ranks or data.batch_size")

UNEVEN_NOTE = ("--x {x}: these runs trained different tokens per optimizer step ({rates}; the ranks, data.batch_size, "
               "data.block_size or the accumulation differ, or an epoch's short last steps): at equal steps the ones "
               "with more have seen more data; {advice}")
UNEVEN_ADVICE = {"step": "compare them at equal tokens with --x tokens",
                 "tokens": "the PNG draws them at equal tokens, but the tables' final and best values are at each "
                           "run's own steps"}


def uneven_tokens_note(labels: list[str], runs: list, all_scalars: list[dict], x: str = "step") -> str | None:
    """A note naming each run's tokens per optimizer step (:func:`tokens_trained`) where they differ by more than
    1 %, else None: the tables compare each run's values at its own steps whatever the PNG's axis ``x``. A 1-rank
    baseline beside a 2-rank ``experiment=compression_sweep`` saw half the tokens at each step, and the table set its
    val/loss 1.88 % behind theirs without a word. A run whose tokens are not known (it logged nothing) is left
    out."""
    rates = {}
    for label, run, scalars in zip(labels, runs, all_scalars):
        if not scalars:
            continue
        try:
            rates[label] = tokens_trained(str(run), scalars)[1]["tokens_per_step"]
        except RunDirError:
            continue
    if len(rates) < 2 or max(rates.values()) <= 1.01 * min(rates.values()):
        return None
    by_rate: dict[str, list[str]] = {}
    for label, rate in rates.items():
        by_rate.setdefault(f"{rate:.0f}", []).append(repr(label))
    rates_text = "; ".join(f"{rate}: {', '.join(names)}" for rate, names in by_rate.items())
    return UNEVEN_NOTE.format(x=x, advice=UNEVEN_ADVICE[x], rates=rates_text)


def tokens_trained(run: str, scalars: dict[str, list[tuple[int, float]]]) -> tuple[Callable[[float], float], dict]:
    """A function from the steps trained to the tokens trained then, all ranks together, and what the JSON says of
    it: ``tokens_per_step`` (the mean over the steps ``train/tokens`` covers; else the one rate) and ``tokens_from``
    (``train/tokens``, or ``rate``). ``train/tokens`` logged during fit at step ``s`` (0-based) counts ``s + 1``
    steps; between its points the tokens go linearly (the steps of one logging interval train alike, but a resume's
    first), past its last point at its last interval's rate (a final validate after the last logged step)."""
    points = [(s + 1, v) for s, v in scalars.get(TOKENS, [])]
    if not points:
        rate = tokens_per_step(run, scalars)
        return _without_dropped(run, lambda steps: steps * rate), {"tokens_per_step": rate, "tokens_from": "rate"}
    points = [(0, 0.0), *points]
    steps, tokens = zip(*points)

    def at(step: float) -> float:
        i = min(max(bisect.bisect_left(steps, step), 1), len(steps) - 1)  # the interval [i - 1, i] holding step
        (s0, t0), (s1, t1) = points[i - 1], points[i]
        return t0 + (step - s0) * (t1 - t0) / (s1 - s0) if s1 > s0 else t1

    return _without_dropped(run, at), {"tokens_per_step": tokens[-1] / steps[-1], "tokens_from": TOKENS}


def _without_dropped(run: str, at: Callable[[float], float]) -> Callable[[float], float]:
    """``at`` less the tokens of the steps whose update a loss spike had dropped by then (:func:`dropped_steps`):
    ``train/tokens`` counts every step's (a skipped one's too, 24,576 for 12 steps with one skipped)."""
    events = dropped_steps(run)
    if not events:
        return at

    def trained(step: float) -> float:
        dropped = set().union(*(steps for at_step, steps in events if at_step < step))  # the events by then
        return at(step) - sum(at(s + 1) - at(s) for s in dropped)

    return trained


def tokens_per_step(run: str, scalars: dict[str, list[tuple[int, float]]]) -> float:
    """The tokens of one optimizer step of a run, all ranks together. ``train/lengths`` after step ``s`` (0-based)
    holds ``s + 1`` steps' tokens. A resume goes on from its checkpoint's count, but one from a checkpoint written
    before the running totals were checkpointed restarts it at 0, so the increments between its points give the
    rate (their median), the first point where it has one point. A run that did not log ``train/lengths`` (the
    throughput callback off, or fewer steps than ``trainer.log_every_n_steps``: a sweep job that failed before its
    first logged step, after a validation, stopped the whole ``--x tokens`` comparison) is read from its
    ``summary.json`` (the micro-batches stepped, :func:`_summary_tokens_per_step`), else its ``config_resolved.yaml``
    (full steps, :func:`_configured_tokens_per_step`); an error naming the run without either."""
    lengths = [(s, v) for s, v in scalars.get(LENGTHS, []) if v > 0]
    if not lengths and (stepped := _summary_tokens_per_step(run)) is not None:
        return stepped
    if not lengths and (configured := _configured_tokens_per_step(run, scalars)) is not None:
        return configured
    if not lengths:
        raise RunDirError(
            f"--x tokens: run {run!r} has no {LENGTHS!r} (logged every trainer.log_every_n_steps steps by the "
            "throughput callback, callbacks.throughput: it was off, or the run stopped before its first logged step), "
            "so its tokens per step are not known; compare it by step (--x step)"
        )
    rates = [(v1 - v0) / (s1 - s0) for (s0, v0), (s1, v1) in zip(lengths, lengths[1:]) if s1 > s0 and v1 > v0]
    per_rank = statistics.median(rates) if rates else lengths[0][1] / (lengths[0][0] + 1)
    return per_rank * _ranks(run, scalars)


def _summary_tokens_per_step(run: str) -> float | None:
    """The tokens per optimizer step that the run's last start trained, all ranks together, from ``summary.json``'s
    ``tokens`` over its steps (``steps - start_step``), or None (no such keys: an unfinished run, or one from before
    them). It counts the micro-batches stepped: with ``limit_train_batches=5`` and 2 a step, the configured rate
    (a full step's) drew a run with no throughput callback 20 % ahead of the tokens it trained."""
    import json

    try:
        summary = json.loads((Path(run) / "summary.json").read_text())
        tokens, steps = summary["tokens"], summary["steps"] - summary["start_step"]
    except Exception:  # noqa: BLE001 - none, unreadable, or without these keys
        return None
    ok = isinstance(tokens, int) and tokens > 0 and isinstance(steps, int) and steps > 0
    return tokens / steps if ok else None


def _configured_tokens_per_step(run: str, scalars: dict[str, list[tuple[int, float]]]) -> float | None:
    """``data.batch_size`` x ``data.block_size`` x ``trainer.accumulate_grad_batches`` x the ranks, from the run's
    ``config_resolved.yaml`` (what ``train(cfg)`` trains a step on), or None where it is not there."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(Path(run) / "config_resolved.yaml")
        sizes = (cfg.data.batch_size, cfg.data.block_size, cfg.trainer.get("accumulate_grad_batches") or 1)
    except Exception:  # noqa: BLE001 - no (readable) config, or not a train.py one
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        return None
    return float(sizes[0] * sizes[1] * sizes[2] * _ranks(run, scalars))


def _ranks(run: str, scalars: dict[str, list[tuple[int, float]]]) -> int:
    device = dict(scalars.get("train/device/items_per_sec", []))
    ratios = [v / device[s] for s, v in scalars.get("train/items_per_sec", []) if device.get(s)]
    if ratios:
        return max(1, round(statistics.median(ratios)))
    from omegaconf import OmegaConf

    try:  # a run shorter than the throughput window logged no rates
        trainer = OmegaConf.load(Path(run) / "config_resolved.yaml").trainer
        devices, nodes = trainer.devices, trainer.get("num_nodes", 1)
    except Exception:  # noqa: BLE001 - no (readable) config: one rank
        return 1
    ints = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (devices, nodes))
    return devices * nodes if ints else 1



COST_HEADER = ["| run | steps trained | tokens trained | wall time |", "|---|---:|---:|---:|"]


def dropped_steps(run: str) -> list[tuple[int, range]]:
    """The optimizer steps (0-based) whose update is not in the run's weights, per event: ``(step, steps)``, where
    ``LossSpikeMonitor`` dropped them at ``step``, as its ``spikes.jsonl`` in the run dir records (``skip``: the
    spike's step; ``rollback`` to the snapshot of step ``r``: steps ``r`` to the spike's, applied then undone;
    ``global_step`` counts them all). Empty without the file (no monitor, no spike, or its ``path`` set elsewhere);
    an unreadable line is passed over."""
    import json

    events: list[tuple[int, range]] = []
    try:
        lines = (Path(run) / "spikes.jsonl").read_text().splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            record = json.loads(line)
            step, actions, back_to = record["step"], record.get("actions") or [], record.get("rolled_back_to")
        except (ValueError, TypeError, KeyError):
            continue
        if not isinstance(step, int) or not {"skip", "rollback"} & set(actions):
            continue  # a level shift, or a spike only logged or cooled down: its update was applied
        first = back_to if isinstance(back_to, int) and back_to <= step else step
        events.append((step, range(first, step + 1)))
    return events


def run_cost(run: str, scalars: dict[str, list[tuple[int, float]]]) -> dict:
    """What a finished run cost, from its ``summary.json``: ``steps``, ``steps_dropped`` (of those, the steps whose
    update a loss spike dropped or a rollback undid, :func:`dropped_steps`), ``tokens_trained`` (all ranks, all
    starts, the dropped steps' left out: the tokens at its last step, :func:`tokens_trained`, ``summary.json``'s own
    count for a run trained in one start) and ``wall_seconds`` with ``wall_since_step`` (the last start's seconds and
    the step it began at: a resumed run's earlier starts are not in its ``summary.json``); ``{}`` for a run without
    one (unfinished, failed)."""
    import json

    try:
        summary = json.loads((Path(run) / "summary.json").read_text())
        steps, start = summary["steps"], summary.get("start_step") or 0
    except Exception:  # noqa: BLE001 - none, unreadable, or without these keys
        return {}
    if not isinstance(steps, int) or not isinstance(start, int):
        return {}
    dropped = set().union(*(range_ for step, range_ in dropped_steps(run) if step < steps))
    tokens = summary.get("tokens")
    if start == 0 and isinstance(tokens, int):  # one start: its steps trained alike
        tokens = round(tokens * (steps - len(dropped)) / steps) if steps else tokens
    else:  # a resumed run: its earlier starts' tokens too (the dropped steps' left out)
        try:
            tokens = round(tokens_trained(run, scalars)[0](steps))
        except RunDirError:
            tokens = None
    wall = summary.get("wall_seconds")
    wall = float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None
    return {"steps": steps, "steps_dropped": len(dropped), "tokens_trained": tokens, "wall_seconds": wall,
            "wall_since_step": start}


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d} min"


def cost_table(rows: list[dict]) -> str | None:
    """A markdown table of each finished run's steps, tokens and wall time (:func:`run_cost`), in the rows' order;
    None where no run finished. A resumed run's wall time is its last start's, marked with the step it began at.
    A row without a cost has its status in the steps column, as the metric tables have: ``failed`` (a row or job
    with an ``error``), ``not started``, ``unfinished``, else ``-``."""
    if not any(r.get("cost") for r in rows):
        return None
    lines = []
    for r in rows:
        cost = r.get("cost") or {}
        if not cost:
            status = ("failed" if r.get("error") else "not started" if r.get("not_started")
                      else "unfinished" if r.get("finished") is False else "-")
            lines.append(f"| {r['label']} | {status} | - | - |")
            continue
        tokens = "-" if cost["tokens_trained"] is None else f"{cost['tokens_trained']:,}"
        wall = "-" if cost["wall_seconds"] is None else _duration(cost["wall_seconds"])
        if cost["wall_seconds"] is not None and cost["wall_since_step"]:
            wall += f" (since step {cost['wall_since_step']})"
        steps = f"{cost['steps']} ({cost['steps_dropped']} dropped)" if cost.get("steps_dropped") else cost["steps"]
        lines.append(f"| {r['label']} | {steps} | {tokens} | {wall} |")
    return "\n".join(COST_HEADER + lines) + "\n"
