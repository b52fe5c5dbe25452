"""Read back what ``train(cfg)`` and a Hydra sweep leave in run dirs (``scripts/compare_runs.py`` compares them).

- which dirs are runs: a run dir, a sweep dir's job subdirs, or every run below ``outputs/`` (:func:`expand_runs`);
- each run's scalars, from TensorBoard event files or ``logger=csv``'s ``metrics.csv`` (:func:`read_scalars`);
- its overrides (:func:`hydra_overrides`), whether it finished (``summary.json``, :func:`finished`), the error a
  failed sweep job logged (:func:`job_error`, the line :func:`lit_dtrain.sweeps.logs_a_failed_job` writes), and a
  stopped sweep's jobs that never started (:func:`jobs_not_started`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

from lit_dtrain.utils.args import is_number

log = logging.getLogger(__name__)
Warn = Callable[[str], None]  # where a skipped dir or an unreadable multirun.yaml is reported

EVENT_GLOB = "events.out.tfevents.*"
CSV_NAME = "metrics.csv"  # Lightning's CSVLogger (logger=csv: ResumableCSVLogger) writes <run>/csv/metrics.csv
# the line each start of train(cfg) that passed its checks logs to its job log (lit_dtrain.sweeps.log_training_start)
TRAINING_STARTS = "training starts: config_resolved.yaml written"
# the start of the line train(cfg) prints and logs to its job log last, beside summary.json
# (lit_dtrain._run_report._report)
SUMMARY_LINE = "summary: val_loss="


class RunDirError(ValueError):
    """A run dir, an event file or a metric is missing; the message names it."""


def event_dirs(run: Path) -> list[Path]:
    """Dirs below ``run`` that hold TensorBoard event files or a CSV logger's metrics.csv (sorted)."""
    return sorted({p.parent for p in run.rglob(EVENT_GLOB)} | {p.parent for p in run.rglob(CSV_NAME) if p.is_file()})


def expand_runs(paths: list[str], skipped: list[str] | None = None, warn: Warn = log.warning) -> list[Path]:
    """Run dirs from the arguments: a dir with event files of its own is a run; else its job subdirs are. A dir
    that holds sweeps or run dirs deeper down (``outputs``, ``outputs/multiruns``) is expanded into each of them.

    A Hydra job dir (``.hydra/``) without event files, a sweep job that failed before logging anything, is
    skipped with a warning (``warn``) and appended to ``skipped``; it does not stop the comparison."""
    runs: list[Path] = []
    skipped = [] if skipped is None else skipped
    files: list[str] = []

    def skip(job: Path) -> None:
        why = NO_LOGGER if finished_without_metrics(job) else "it failed before logging, or has not started"
        warn(f"skipping {job} (a Hydra job without TensorBoard event files or {CSV_NAME}: {why})")
        skipped.append(str(job))

    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():  # a shell glob over a sweep dir also matches Hydra's multirun.yaml
            warn(f"skipping {raw} (a file, not a run dir)")
            files.append(raw)
            continue
        if not path.is_dir():
            raise RunDirError(f"run dir {raw!r} does not exist")
        if _holds_runs(path):
            subs = [
                d for d in sorted(path.iterdir(), key=_job_key) if d.is_dir() and (event_dirs(d) or _hydra_below(d))
            ]
            runs.extend(expand_runs([str(d) for d in subs], skipped, warn))
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
                raise RunDirError(
                    f"run dir {raw!r} has no TensorBoard event files ({EVENT_GLOB}) or CSV metrics "
                    f"({CSV_NAME}) below it"
                )
            runs.append(path)
        else:
            runs.extend(jobs)
            for d in subdirs:
                if (d / ".hydra").is_dir() and not event_dirs(d):
                    skip(d)
    if not runs and skipped:
        jobs = [
            f"{job} failed: {table_cell(error)}"
            if (error := job_error(Path(job)))
            else f"{job} {NO_LOGGER}"
            if finished_without_metrics(Path(job))
            else f"{job} logged no error (not started, or stopped before logging)"
            for job in skipped
        ]
        raise RunDirError(f"no run has TensorBoard event files or {CSV_NAME}: {'; '.join(jobs)}")
    if not runs and files:  # e.g. a checkpoint
        raise RunDirError(
            f"no run dir among the arguments: {files[0]!r} is a file; give the run dir that holds it "
            "(e.g. outputs/runs/<run>)"
        )
    return runs


NO_LOGGER = "finished, but logged no metrics (logger=none: its values are in summary.json only)"


def finished_without_metrics(job: Path) -> bool:
    """Whether a run dir without event files or metrics.csv ran to its end: ``train(cfg)`` wrote its summary.json
    (``logger=none``), so it neither failed nor is still to start."""
    return (job / "summary.json").is_file()


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
        with _quiet_tensorboard():
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


@contextlib.contextmanager
def _quiet_tensorboard():
    """Hide TensorBoard's 'Detected out of order event.step likely caused by a TensorFlow restart. Purging expired
    events ...' warning while reading: a resumed run writes it by design (``purge_step``: the points the interrupted
    run logged past its checkpoint are dropped, as TensorBoard's own view drops them), so it told the user nothing
    they could act on."""
    logger = logging.getLogger("tensorboard")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def without_cut_line(text: str) -> tuple[str, str]:
    """``text`` up to its last line end, and what follows it: a last line cut short ('' when there is none). One
    ending in ``\r`` is whole (csv rows end in ``\r\n``, after the last cell): its ``\n`` is added."""
    if text.endswith("\r"):
        return text + "\n", ""
    cut = text[text.rfind("\n") + 1 :]
    return text[: len(text) - len(cut)], cut


def read_csv_metrics(path: Path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of every filled cell of a Lightning ``metrics.csv``, in file order. A last line without
    its line end is a row cut short (the run killed while Lightning's CSVLogger appended or rewrote the file, a full
    disk): it is left out with a warning; ``0,5,3.`` cut from ``0,5,3.9713`` was read as val/loss 3.0. A file with no
    whole line (empty, or cut in its header) holds no metrics, with a warning (it was "not a Lightning CSVLogger
    metrics file; its columns are None", an error that stopped the whole comparison). A cell that is
    no number is :class:`RunDirError` naming the file, line and column (it was a ValueError traceback)."""
    with path.open(newline="", errors="replace") as f:
        text, cut = without_cut_line(f.read())
    if cut:
        log.warning("%s: its last line %r has no line end (the run was killed while writing it?); left out", path,
                    cut[:80])
    if not text:  # empty, or cut in its header: a run killed as its first rows were written has none to read
        log.warning("%s has no whole line (the run was killed while writing it?); it holds no metrics", path)
        return []
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if "step" not in (reader.fieldnames or []):
        raise RunDirError(
            f"{path} has no 'step' column, so it is not a Lightning CSVLogger metrics file; "
            f"its columns are {reader.fieldnames}"
        )
    out = []
    for row in reader:
        if not row.get("step"):
            continue
        try:
            step = int(float(row["step"]))
            out += [(tag, step, float(v)) for tag, v in row.items() if tag not in ("step", "epoch") and v]
        except (TypeError, ValueError) as e:  # TypeError: a row with more cells than the header (key None)
            raise RunDirError(f"{path}, line {reader.line_num}: a cell is not a number ({e}); the file is damaged "
                              "there: repair or remove that line") from e
    return out


def hydra_overrides(run: Path) -> list[str] | None:
    """The run's command-line overrides: ``overrides.yaml``, written by the last start that trained it, else
    ``.hydra/overrides.yaml``, which Hydra rewrites at every start (one that failed before training included);
    None when it has neither."""
    f = next((f for f in (run / "overrides.yaml", run / ".hydra" / "overrides.yaml") if f.is_file()), None)
    if f is None:
        return None
    import yaml

    try:  # YAML, not its lines: an override YAML quotes ('+a={k: v}') or folds over lines keeps its text
        items = yaml.safe_load(f.read_text())
    except yaml.YAMLError:
        return None
    return [str(o) for o in items] if isinstance(items, list) else None


_JOB_NUM = ("${hydra.job.num}", "${hydra:job.num}")  # Hydra's default hydra.sweep.subdir, and conf/hydra's


def sweep_jobs(sweep: Path, warn: Warn = log.warning) -> list[list[str]] | None:
    """Each job's overrides (job N: entry N) of the multirun whose ``multirun.yaml`` is in ``sweep``, as Hydra's basic
    sweeper makes them: the product of the swept values of ``hydra.sweeper.params`` then the command line's (as in
    ``BasicSweeper.split_arguments``). None for another sweeper, for job dirs not named by the job number (a
    ``hydra.sweep.subdir`` of one's own: ``${hydra.job.override_dirname}``), or without a readable
    ``multirun.yaml``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        hydra = OmegaConf.load(sweep / "multirun.yaml").hydra
        if not str(hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"):
            return None
        subdir = OmegaConf.to_container(hydra, resolve=False).get("sweep", {}).get("subdir", _JOB_NUM[0])
        if str(subdir).replace(" ", "") not in _JOB_NUM:  # job N's dir is not <sweep>/N
            return None
        # the overrides as typed: 'paths.checkpoint_dir=/ck/${hydra:job.num}' is text to parse, not to resolve
        # (resolving it here failed, Unsupported interpolation type hydra, and the not-started rows were lost)
        raw = OmegaConf.to_container(hydra, resolve=False)
        params = [f"{k}={v}" for k, v in (raw["sweeper"].get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides(params + list(raw["overrides"]["task"]))
    except Exception as e:  # any unreadable file: only the rows of jobs that never started depend on it
        warn(
            f"cannot list the jobs of {sweep / 'multirun.yaml'} ({type(e).__name__}: {e}); jobs that never started "
            "have no row"
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


def jobs_not_started(runs: list[Path], warn: Warn = log.warning,
                     given: list[str] | None = None) -> dict[Path, list[str]]:
    """``{<sweep dir>/N: its overrides}`` of the jobs of the sweeps that ``runs`` belong to which have no dir: Hydra
    creates a job's dir when the job starts, so a sweep stopped in job 1 of 4 has no trace of jobs 2 and 3. With
    ``given`` (the paths the runs were named by), only the sweeps given whole count: the sweep dir or a dir above it,
    or its ``multirun.yaml`` (which ``<sweep>/*`` matches); one job dir given alone was listed with its sweep's
    never-started jobs, rows of runs nobody asked for."""
    whole = None if given is None else [Path(g).expanduser().resolve() for g in given]

    def given_whole(sweep: Path) -> bool:
        where = sweep.resolve()
        return whole is None or any(g == where or g in where.parents or g == where / "multirun.yaml" for g in whole)

    missing: dict[Path, list[str]] = {}
    for sweep in dict.fromkeys(r.parent for r in runs if (r.parent / "multirun.yaml").is_file()):
        if not given_whole(sweep):
            continue
        for n, overrides in enumerate(sweep_jobs(sweep, warn) or []):
            if not (sweep / str(n)).exists():
                missing[sweep / str(n)] = overrides
    return missing


def finished(run: Path, scalars: dict[str, list[tuple[int, float]]]) -> bool | None:
    """Whether a ``train.py`` run dir (it has ``config_resolved.yaml``) ran to its end: ``train(cfg)`` writes
    ``summary.json`` last, with the steps trained. False without it (killed, preempted, still running), when the
    run logged past those steps (resumed, then stopped), or when its job log's latest start came after its last
    summary line (:func:`started_since_its_summary`). None for other dirs: nothing tells."""
    if not (run / "config_resolved.yaml").is_file():
        return None
    steps = summary_steps(run)
    last = max((series[-1][0] for series in scalars.values() if series), default=0)
    return steps is not None and last <= steps and not started_since_its_summary(run)


def started_since_its_summary(run: Path) -> bool:
    """Whether the run's job log holds a start (:data:`TRAINING_STARTS`) after its last summary line: a start that
    failed or was killed before it logged a step of its own, whose ``summary.json`` is the earlier start's. An
    extension of a finished run (``resume=auto trainer.max_steps=4``) that failed at its first step was shown
    finished, with the old summary. False for a log with no summary line (written before it was logged)."""
    try:
        text = job_log(run).read_text(errors="replace")
    except OSError:
        return False
    summary = text.rfind(SUMMARY_LINE)
    return summary >= 0 and text.rfind(TRAINING_STARTS) > summary


def summary_steps(run: Path) -> int | None:
    """The optimizer steps a run trained by its ``summary.json`` (``train(cfg)`` writes it last), or None without
    a readable one."""
    try:
        steps = json.loads((run / "summary.json").read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return steps if is_number(steps, integer=True) else None


def summary_marks(run: Path) -> dict:
    """What a finished ``train.py`` run's ``summary.json`` says of its end beside its steps, for compare_runs.py's
    rows: ``{"diverged": True, "first_nonfinite_step": N or None}`` where it diverged (its final values are NaN:
    ``module.check_finite=false``), ``{"stopped": reason}`` where its fit ended otherwise than at its last step
    (``early_stopping``, ``max_time``, ``should_stop``: a run EarlyStopping stopped at step 4 of 20 looked finished);
    ``{}`` else."""
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(summary, dict):
        return {}
    marks = {}
    if summary.get("diverged") is True:
        step = summary.get("first_nonfinite_step")
        marks = {"diverged": True, "first_nonfinite_step": step if isinstance(step, int) else None}
    if isinstance(stopped := summary.get("stopped"), str) and stopped not in ("max_steps", "max_epochs"):
        marks["stopped"] = stopped
    return marks


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
    """The error a failed sweep job or single run logged to its Hydra job log (:func:`job_log`; ``train(cfg)``
    logs ``job N failed: Type: message``, or ``run failed: ...``): the last one, since Hydra appends to the log of a
    run re-run into its dir (``resume=auto``), and only one logged after the latest :data:`TRAINING_STARTS` line: a
    later start that trained and was then killed logged none, and its run is unfinished, not failed."""
    try:
        text = job_log(job).read_text(errors="replace")
    except OSError:
        return None
    text = text[max(text.rfind(TRAINING_STARTS), 0):]
    errors = re.findall(r"\b(?:job \d+|run) failed: (.*)", text)
    return errors[-1].strip() if errors else None


def table_cell(text: str, limit: int = 100) -> str:
    """An error message as one table cell: no '|', at most ``limit`` characters (the JSON keeps all of it)."""
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."
