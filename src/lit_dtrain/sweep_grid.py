"""A multirun's grid as Hydra's basic sweeper expanded it (this start's ``multirun.yaml``), checked in each job by
``lit_dtrain.sweeps.sweep_checks``: a value listed twice, an experiment's grid that was never swept, and one
``paths.checkpoint_dir`` for all jobs."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.sweeps")  # the sweep checks' logger, as before the split


def warn_if_the_grid_repeats_a_point(hc) -> None:
    """Warn when two jobs of this multirun train the same configuration, as Hydra's basic sweeper expands its grid
    (:func:`basic_sweep_jobs`): ``optimizer.lr=1e-3,1e-3`` (a typo for 3e-3) trained the same run twice without a
    word, and ``compare_runs.py`` labelled the rows by job number alone, since no value differs between them. Judged
    by each job's final value of a key (1e-3 and 0.001 are one value; a later override of a key replaces it), as
    Hydra composes the job: counted by hand (each swept key's values alone), ``optimizer.lr=1e-3,2e-3
    ++optimizer.lr=3e-3,4e-3`` (4 jobs, 2 distinct) passed, and ``optimizer.lr=1e-3,1e-3 optimizer.lr=3e-3`` (1 job)
    was warned of."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept_jobs = basic_sweep_jobs(hc)
    if swept_jobs is None:
        return
    overrides, jobs = swept_jobs
    swept = {o.key_or_group for o in overrides if o.is_sweep_override()}
    parser = OverridesParser.create()
    finals = []  # each job's key -> (its final value, the line that set it)
    for job in jobs:
        final = {}
        for line, o in zip(job, parser.parse_overrides(job)):
            final[_node(o)] = ("~" if o.is_delete() else repr(o.value()), line)
        finals.append(final)
    points = [repr(sorted((key, value) for key, (value, _) in final.items())) for final in finals]
    first_of = {point: points.index(point) for point in points}
    num = next((num for num, point in enumerate(points) if first_of[point] != num), None)
    if num is None:
        return
    first, final = first_of[points[num]], finals[num]
    trained = " ".join(line for key, (_, line) in final.items() if key in swept) or " ".join(jobs[num])
    differ = [(a, b) for a, b in zip(jobs[first], jobs[num]) if a != b]
    if not differ:
        why = "a swept value is listed twice"
    else:
        a, b = differ[0]
        line = final[_node(parser.parse_overrides([a])[0])][1]
        why = (f"'{a}' and '{b}' are one value" if line == b
               else f"'{line}' replaces job {first}'s '{a}' and job {num}'s '{b}'")
    # rank 0's: Lightning's launcher starts rank 1 with the same -m, which ran job 0's checks again and said it twice
    log_once(log, logging.WARNING, "job %d of this multirun trains the same configuration as job %d (%s): %s; its %d "
             "jobs train %d distinct configurations", num, first, trained, why, len(jobs), len(first_of))


def _node(override) -> str:
    """The node an override sets: its key, or its group at its package (``+model@teacher=nano`` is not ``model``: keyed
    by group alone it replaced the swept ``model=nano,small``, and two jobs of two models were warned of as one)."""
    return override.key_or_group if override.package is None else f"{override.key_or_group}@{override.package}"


def basic_sweep_jobs(hc) -> tuple[list, list[list[str]]] | None:
    """The jobs of this multirun as Hydra's basic sweeper expands them (its ``split_arguments``; each job a list of
    override lines) with the parsed overrides they came from: the grid it expanded (``multirun.yaml``'s
    ``hydra.sweeper.params``, else this job's) and the command line's overrides, from this start's
    ``multirun.yaml``. None for another sweeper (a sampling sweeper draws its values) or where the sweep cannot be
    read. The file and the grid given are read once (the count, by :func:`sweep_job_count`, at each job's end)."""
    multirun = _multirun_file(hc)
    if not _is_basic(hc, "sweeper") or multirun is None:
        return None
    try:  # read once per sweep: a 2-rank gloo sweep's late-signal agreement paid 0.6-0.9 s a job on each rank here
        text = multirun.read_bytes()
    except OSError:
        return None
    key = (str(multirun), text, tuple(grid_lines(hc.sweeper)))
    if key not in _sweep_jobs_read:
        _sweep_jobs_read.clear()  # one sweep at a time: its file's text is the key
        _sweep_jobs_read[key] = _read_basic_sweep_jobs(hc, text)
    return _sweep_jobs_read[key]


_sweep_jobs_read: dict[tuple, tuple[list, list[list[str]]] | None] = {}  # (multirun.yaml, its text, grid) -> jobs


def _read_basic_sweep_jobs(hc, text: bytes) -> tuple[list, list[list[str]]] | None:
    """:func:`basic_sweep_jobs` of ``multirun.yaml``'s ``text``, the bytes its cache is keyed by: the file loaded
    again here (twice) could hold another start's sweep, whose count was then kept under this text's key."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    try:  # the parser given the loader lists a glob's options
        multirun = OmegaConf.create(text.decode())
        swept = OmegaConf.select(multirun, "hydra.sweeper")  # the grid the sweeper expanded
        lines = grid_lines(swept if swept is not None else hc.sweeper) + unresolved(multirun.hydra.overrides.task)
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(lines)
        return overrides, BasicSweeper.split_arguments(overrides, None)[0]
    except Exception:  # noqa: BLE001 - interval(...), a bad override: the sweeper reports it itself
        return None


def _is_basic(hc, node: str) -> bool:
    """Whether this multirun's ``hydra.<node>`` (sweeper, launcher) is Hydra's basic one."""
    return str(OmegaConf.select(hc, f"{node}._target_", default="")).endswith(f".Basic{node.title()}")


def sweep_task(hc) -> list[str]:
    """The command line's overrides of this start's multirun (``-m`` lists unexpanded), from its ``multirun.yaml``."""
    multirun = _multirun_file(hc)
    return unresolved(OmegaConf.load(multirun).hydra.overrides.task) if multirun is not None else []


def sweep_job_count(hc) -> int | None:
    """How many jobs this multirun runs, where Hydra's basic sweeper and launcher run them one after another: the
    sweeper's own count (:func:`basic_sweep_jobs`); None for another sweeper or launcher (a sampling sweeper, a
    parallel launcher: no job is known to be the last), or where the sweep cannot be read. Counted by hand (swept
    keys only, by key without its prefix), a single value on the command line did not replace the grid's key
    (``-m experiment=wsd_vs_cosine scheduler=wsd optimizer.lr=1e-3``, 1 job, counted 6) and
    ``++optimizer.lr=3e-3,4e-3`` replaced ``optimizer.lr=1e-3,2e-3`` (4 jobs, counted 2: job 1's SIGTERM was taken
    for one after the last job, and jobs 2 and 3 ran on)."""
    swept_jobs = basic_sweep_jobs(hc) if _is_basic(hc, "launcher") else None
    return None if swept_jobs is None else len(swept_jobs[1])


def unresolved(lines) -> list[str]:
    """A list of override lines from a Hydra config (``hydra.overrides.task``) as typed: reading its entries resolved
    ``paths.checkpoint_dir=/x/${run_name}`` to the multirun's own ``run_name`` (and ``${hydra:job.num}`` to the
    reading job's number), and raised for ``${oc.env:UNSET}``."""
    return [str(line) for line in OmegaConf.to_container(lines, resolve=False)] if lines is not None else []


def grid_lines(sweeper) -> list[str]:
    """An experiment's grid (``hydra.sweeper.params``) as override lines, unresolved, to parse before the command
    line's (whose value of a key replaces the grid's)."""
    params = sweeper.get("params")
    grid = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    return [f"{key}={value}" for key, value in grid.items()]


def _multirun_file(hc) -> Path | None:
    """This start's ``multirun.yaml`` (its sweep, as Hydra saved it, in the sweep dir); None where there is none."""
    multirun = sweep_dir_of(hc) / "multirun.yaml"
    return multirun if multirun.is_file() else None


def sweep_dir_of(hc=None) -> Path:
    """The sweep dir of this multirun job (``hc``: its Hydra config, by default Hydra's): its run dir less the parts
    of ``hydra.sweep.subdir``. The run dir's parent was taken for it, which under a subdir of several parts
    ('lr/${optimizer.lr}', or '${hydra:job.override_dirname}' over 'strategy=ddp_compressed/int4') is a dir inside
    the sweep: its ``multirun.yaml`` was not found, so a 1-job sweep signalled in its sample exited 143 'the sweep's
    later jobs do not start', advising 'hydra.sweep.dir=<sweep dir>/lr', which resumes nothing. A subdir of ``.``
    is the run dir itself; under an absolute one (or one with ``..``) Hydra's ``hydra.sweep.dir``, resolved as it
    joined it (its parent was taken: rank 1 of a DDP sweep ran its jobs in the sweep dir's parent)."""
    if hc is None:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:  # Hydra's run dir: os.path.abspath(os.path.join(sweep.dir, sweep.subdir))
        subdir = Path(os.path.normpath(str(hc.sweep.subdir)))
    except Exception:  # noqa: BLE001 - a subdir that does not resolve here: the parent, as before
        return run_dir.parent
    depth = len(subdir.parts)
    if str(subdir) == ".":  # every job in the sweep dir itself: its parent was taken, outside the sweep
        return run_dir
    if subdir.is_absolute() or not 0 < depth < len(run_dir.parts) or run_dir.parts[-depth:] != subdir.parts:
        # an absolute subdir (the run dir is that path alone) or one with '..': Hydra's own sweep dir, as it joined it
        try:
            return Path(os.path.abspath(str(hc.sweep.dir)))
        except Exception:  # noqa: BLE001 - a sweep dir that does not resolve here: the parent, as before
            return run_dir.parent
    return run_dir.parents[depth - 1]


def warn_if_an_experiment_grid_was_not_swept(hc) -> None:
    """Warn when this job's config has a grid (``hydra.sweeper.params``, from its experiment) that the sweep did not
    expand: Hydra reads the grid of the config it composes before sweeping, which has no experiment where the
    experiment itself is swept (``-m experiment=wsd_vs_cosine,compression_sweep``, ``experiment=glob(*)``). Such a
    job trained one point of its experiment's comparison (its defaults: ``scheduler=wsd`` at the default LR for
    ``wsd_vs_cosine``'s six) without a word."""
    grid = hc.sweeper.get("params")
    multirun = _multirun_file(hc)
    if not grid or multirun is None:
        return
    sweeper = OmegaConf.select(OmegaConf.load(multirun), "hydra.sweeper")
    if sweeper is None:  # not Hydra's file: nothing tells what it swept
        return
    expanded = sweeper.get("params") or {}
    if not_swept := [f"{key}={value}" for key, value in grid.items() if key not in expanded]:
        experiment = hc.runtime.choices.get("experiment")
        log_once(
            log, logging.WARNING,
            "experiment=%s sweeps %s (its hydra.sweeper.params), but this multirun did not expand that grid: Hydra "
            "sweeps an experiment's grid only where the experiment is not swept itself, so this job trains one "
            "point of it. Run each such experiment in a -m of its own: python train.py -m experiment=%s",
            experiment, " ".join(not_swept), experiment,
        )


def unknown_group_option(overrides, config_name: str | None, hydra_overrides: list[str]) -> str | None:
    """The message for the first value of a config group in ``overrides`` (parsed sweep overrides) that names no
    option of it (``-m model=nano,doesnotexist``), else None. Hydra finds out only when it composes that job, after
    it has made the sweep dir and its ``multirun.yaml``: a sweep that never ran left that dir behind, with a
    multi-line "In 'train': Could not find 'model/doesnotexist'" and the option list. Needs Hydra's global config
    loader (a ``train.py`` start); without one nothing is checked."""
    import functools

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.types import Glob

    if not GlobalHydra.instance().is_initialized():
        return None
    loader = GlobalHydra.instance().config_loader()

    @functools.cache
    def options(group: str) -> tuple[str, ...]:  # with the command line's hydra.searchpath, as Hydra composes
        return tuple(loader.get_group_options(group, config_name=config_name, overrides=hydra_overrides))

    for o in overrides:
        group = o.key_or_group
        if o.is_delete() or isinstance(o.value(), Glob) or not (options(group) or loader.list_groups(group)):
            continue  # a config key, not a group (a glob picks among the group's options)
        for value in (o.sweep_iterator() if o.is_sweep_override() else [o.value()]):
            if isinstance(value, dict):  # '++scheduler={warmup_steps:1}': Hydra sets the node's keys, picks no option
                continue
            for name in (value if isinstance(value, list) else [value]):  # callbacks=[default,loss_spike]
                if name is None:
                    continue
                parent, _, leaf = f"{group}/{name}".rpartition("/")  # strategy=ddp_compressed/int8_rs
                if leaf not in options(parent):
                    return (f"{o.input_line}: config group '{parent}' has no option '{leaf}' (options: "
                            f"{', '.join(options(parent)) or 'none'}); nothing was run")
    return None


def shared_checkpoint_dir_error(checkpoint_dir, overrides, job_dirs: dict[str, list[int]] | None = None) -> str | None:
    """The message for a multirun of which several jobs would save in one ``paths.checkpoint_dir``, else None. Job 0
    trained into that dir and every later job was refused, since it then held job 0's checkpoints (a 2-job sweep
    spent its whole first job before the error). ``checkpoint_dir`` is the key's unresolved value, ``overrides`` the
    sweep's parsed overrides (the command line's and an experiment's grid), ``job_dirs`` each resolved dir's jobs
    (:func:`job_checkpoint_dirs`), where they were knowable: ``/x/${run_name}`` is one dir for every job unless
    ``run_name`` is swept, ``/x/${hydra:job.num}`` one per job. Without ``job_dirs`` a literal dir of a sweep of
    several jobs is refused, and an interpolated or swept one not judged."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    if job_dirs is not None:
        shared = next(((d, jobs) for d, jobs in job_dirs.items() if len(jobs) > 1), None)
        if shared is None:
            return None
        where, jobs = shared
        resolved = "" if where == checkpoint_dir else f" ({where})"
        if len(job_dirs) == 1:  # no swept key changes it
            return _shared_dir_message(checkpoint_dir, f"{resolved} for every job", 0, "each later one")
        return _shared_dir_message(checkpoint_dir, f"{resolved} for jobs {jobs[0]} and {jobs[1]}", jobs[0],
                                   f"job {jobs[1]}")
    if not isinstance(checkpoint_dir, str) or "${" in checkpoint_dir:
        return None
    axes = {}  # key -> its number of values (the command line's value of a key replaces the experiment's)
    for o in overrides:
        sweep = o.is_sweep_override()
        listed = isinstance(o.value(), (ChoiceSweep, RangeSweep))  # glob(...), interval(...): not enumerable here
        axes[o.key_or_group] = (len(list(o.sweep_iterator())) if listed else 2) if sweep else 1
        if sweep and o.key_or_group in ("paths", "paths.checkpoint_dir"):
            return None  # a value per job
    if math.prod(axes.values()) < 2:  # (a glob or a sampling sweeper's interval counts as 2)
        return None
    return _shared_dir_message(checkpoint_dir, " for every job", 0, "each later one")


def _shared_dir_message(checkpoint_dir, which: str, first: int, later: str) -> str:
    per_job = f"{str(checkpoint_dir).rstrip('/')}/${{hydra:job.num}}"
    return (f"paths.checkpoint_dir={checkpoint_dir!r} is one dir{which} of this multirun: job {first} would train "
            f"into it and {later} be refused (the dir then holds job {first}'s checkpoints); leave it out (job N "
            f"saves in <sweep dir>/N/checkpoints) or give each job its own, 'paths.checkpoint_dir={per_job}'; "
            "nothing was run")


# an interpolation that differs per job (the default: ${paths.output_dir}/checkpoints, in the job's dir)
# (not ${hydra:job.override_dirname}: its exclude_keys can leave the swept keys out, so it is composed and judged)
_PER_JOB = ("${hydra:job.num}", "${hydra:job.id}", "${hydra:runtime.output_dir}")
_RUN_DIRS = ("${lit.run_dir:}", "${hydra:runtime.output_dir}")  # paths.output_dir's per-job values


def job_checkpoint_dirs(master, sweep: list[str], cache_from=None) -> dict[str, list[int]] | None:
    """The absolute ``paths.checkpoint_dir`` that jobs of the multirun ``sweep`` (its override lines, an experiment's
    grid first) resolve to, each with the numbers of the jobs judged that resolve to it; None where that is not
    knowable before they run: no Hydra config loader (``train(cfg)`` from Python), a sweeper other than Hydra's basic
    one (a sampling sweeper draws its values). Judged are job 0 and, for each swept key, the first job that differs
    from job 0 in that key alone (the basic sweeper's grid is a product): two of them with one dir show a key the dir
    does not follow, so two jobs that share it; one dir for all of them is one dir for every job. Each is composed as
    Hydra's sweeper and launcher compose it (its own composing of every job costs about 0.1 s a job): ``master`` is
    the multirun's config with its ``hydra`` node, ``cache_from`` a config whose resolver cache (``${now:...}``) the
    jobs share (``master`` by default). A dir that names the job (``${hydra:job.num}``, the default's
    ``${paths.output_dir}``) is not composed; a job whose dir cannot be resolved yet is left out."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    own = master if cache_from is None else cache_from  # (in a job, master is Hydra's node alone)
    raw, paths = raw_checkpoint_dir(own), own.get("paths")
    output_dir = paths._get_node("output_dir") if isinstance(paths, DictConfig) else None
    if isinstance(raw, str) and (any(per_job in raw for per_job in _PER_JOB) or "${paths.output_dir}" in raw
                                 and output_dir is not None and output_dir._value() in _RUN_DIRS):
        return {}
    if not GlobalHydra.instance().is_initialized() or not str(
            OmegaConf.select(master, "hydra.sweeper._target_", default="")).endswith(".BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    loader = GlobalHydra.instance().config_loader()
    try:  # the parser given the loader lists a glob's options (glob(*) of one option is one job)
        jobs = BasicSweeper.split_arguments(OverridesParser.create(config_loader=loader).parse_overrides(sweep),
                                            None)[0]
    except Exception:  # noqa: BLE001 - interval(...), a bad override: the sweeper reports it itself
        return None
    axes = [len({job[i] for job in jobs}) for i in range(len(jobs[0]))] if jobs else []
    judged = sorted({0, *(math.prod(axes[i + 1:]) for i, n in enumerate(axes) if n > 1)} & set(range(len(jobs))))
    try:
        return _resolved_dirs(loader, master, {num: list(jobs[num]) for num in judged}, cache_from)
    except Exception:  # noqa: BLE001 - a config Hydra's launcher could not compose either: it says why itself
        return None


def _resolved_dirs(loader, master, jobs: dict[int, list[str]], cache_from) -> dict[str, list[int]]:
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.instance().cfg  # (a job's own, set back after)
    # relative dirs are read against the command's dir (lit_dtrain._chdir_paths; Hydra's, without chdir)
    cwd = OmegaConf.select(hydra_config, "hydra.runtime.cwd", default=None) if hydra_config else None
    cwd = str(cwd or os.getcwd())
    job_dirs: dict[str, list[int]] = {}
    try:
        for num, job in jobs.items():
            config = loader.load_sweep_config(master, job)
            if cache_from is not None:
                OmegaConf.copy_cache(from_config=cache_from, to_config=config)
            with open_dict(config):  # as Hydra's launcher and run_job set them
                config.hydra.job.id = config.hydra.job.num = num
            HydraConfig.instance().set_config(config)
            with read_write(config.hydra.runtime):
                config.hydra.runtime.output_dir = os.path.join(cwd, str(config.hydra.sweep.dir),
                                                               str(config.hydra.sweep.subdir))
            HydraConfig.instance().set_config(config)
            try:
                where = str(OmegaConf.select(config, "paths.checkpoint_dir"))
            except Exception:  # noqa: BLE001 - not resolvable before the job runs: not judged
                continue
            job_dirs.setdefault(os.path.normpath(os.path.join(cwd, os.path.expanduser(where))), []).append(num)
    finally:
        HydraConfig.instance().cfg = hydra_config
    return job_dirs


def raw_checkpoint_dir(cfg: DictConfig):
    """``paths.checkpoint_dir`` as given, its interpolations unresolved (None where there is none)."""
    paths = cfg.get("paths")
    node = paths._get_node("checkpoint_dir") if isinstance(paths, DictConfig) else None
    return None if node is None else node._value()


_judged: dict[tuple, str | None] = {}  # a sweep -> its shared-dir message (each job of a sweep would compose all)


def check_shared_checkpoint_dir(cfg: DictConfig, hc) -> None:
    """Refuse every job of a multirun of which several jobs would save in one ``paths.checkpoint_dir``
    (:func:`~lit_dtrain.sweep_grid.shared_checkpoint_dir_error`), also under a Hydra entry point of one's own: job 0
    trained and job 1 was refused; a job that fails here writes nothing there, so none may train. The jobs' dirs
    are judged once per sweep in this process (:func:`job_checkpoint_dirs`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = grid_lines(hc.sweeper) + sweep_task(hc)
    sweep = (str(sweep_dir_of(hc)), tuple(lines), raw_checkpoint_dir(cfg))
    if sweep not in _judged:
        try:
            overrides = OverridesParser.create().parse_overrides(lines)
        except Exception:  # noqa: BLE001 - Hydra parsed them already; nothing to judge here
            return
        job_dirs = job_checkpoint_dirs(HydraConfig.instance().cfg, lines, cache_from=cfg)
        _judged[sweep] = shared_checkpoint_dir_error(raw_checkpoint_dir(cfg), overrides, job_dirs)
    if _judged[sweep]:
        raise ConfigError(_judged[sweep])
