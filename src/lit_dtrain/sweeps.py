"""Hydra sweep checks that ``train(cfg)`` runs itself (:func:`sweep_checks`, :func:`logs_a_failed_job`, and
:func:`pin_sweep_dir` for a multirun under DDP), so that any Hydra entry point calling it gets them, not only the root
``train.py``. They read Hydra's runtime config and are no-ops without one (``train(cfg)`` called from plain Python).
:func:`reports_user_errors` is for an entry point itself (the root ``train.py``): it reports a bad input in one line
instead of a traceback."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import traceback
from pathlib import Path

from hydra.errors import CompactHydraException, InstantiationException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lit_dtrain._compose_errors import full_error_asked
from lit_dtrain._job_failure_once import (
    failed_in_its_own_run,
    job_starts,
    note_job,
    ran_before_this_rank,
    rank_0_reports,
    reported_by_rank_0,
)
from lit_dtrain._resumed_job import check_resumed_job
from lit_dtrain._sweep_of_nothing import note_sweep_dir
from lit_dtrain.errors import ConfigError, unset_env_var
from lit_dtrain.sweep_grid import (
    check_shared_checkpoint_dir,
    grid_lines,
    job_checkpoint_dirs,
    raw_checkpoint_dir,
    shared_checkpoint_dir_error,
    sweep_dir_of,
    unknown_group_option,
    unresolved,
    warn_if_an_experiment_grid_was_not_swept,
    warn_if_the_grid_repeats_a_point,
)
from lit_dtrain.utils.distributed import print_once_across_ranks
from lit_dtrain.utils.job_log import log_to_handlers
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger(__name__)


def sweep_checks(cfg: DictConfig) -> None:
    """Warn when this config sweeps only with ``-m`` and runs without it, and when a multirun is given a ``run_name``
    (which names a single run's dir only); refuse a multirun's ``resume=auto`` into a job dir trained with other
    swept values (:func:`check_resumed_job`). A no-op outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    grid = hc.sweeper.get("params") if hc.mode != RunMode.MULTIRUN else None
    if grid:  # e.g. `python train.py experiment=wsd_vs_cosine`: Hydra ignores the experiment's grid without -m
        log_once(  # rank 0's: Lightning's launcher starts rank 1 with the same arguments, which said it again
            log, logging.WARNING, "this config sweeps %s (hydra.sweeper.params) only with -m; without it this is one "
            "run",
            " ".join(f"{k}={v}" for k, v in grid.items()),
        )
    # as typed: iterating the overrides resolved each, and 'data.val_batch_size=${.batch_size}' (relative, valid in
    # the config) resolved in Hydra's list raised 'Index 'batch_size' (str) is not an int' in a traceback
    named = [o for o in unresolved(hc.overrides.task) if o.lstrip("+~").split("=", 1)[0] == "run_name"]
    if named and hc.mode == RunMode.MULTIRUN and hc.job.num == 0:  # once a sweep
        # `-m run_name=lr_sweep optimizer.lr=...`: the jobs went to multiruns/<time>/N, and outputs/runs/lr_sweep,
        # where the user then looked for them, did not exist
        log_once(
            log, logging.WARNING, "%s does not name a multirun's dirs: job N trains in %s/N; name a sweep with "
            "'hydra.sweep.dir=${paths.log_dir}/multiruns/<name>'",
            named[0], sweep_dir_of(hc),
        )
    if hc.mode == RunMode.MULTIRUN and hc.job.num == 0:
        warn_if_the_grid_repeats_a_point(hc)
    if hc.mode == RunMode.MULTIRUN:
        warn_if_an_experiment_grid_was_not_swept(hc)
        check_shared_checkpoint_dir(cfg, hc)
    check_resumed_job(cfg)


def in_multirun() -> bool:
    """Whether this is a job of a Hydra multirun (False outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def another_run_dir() -> str:
    """The advice to train in another run dir: ``choose another run_name``; in a multirun, whose job N trains in
    ``<sweep dir>/N`` whatever ``run_name`` says, ``choose another hydra.sweep.dir``."""
    if in_multirun():
        return "choose another hydra.sweep.dir (job N of a multirun trains in <sweep dir>/N; run_name is not used)"
    return "choose another run_name"


def pin_sweep_dir() -> None:
    """Multirun with DDP: Lightning re-launches rank 1 with the same ``-m`` arguments (a sweep in lockstep with rank
    0's): rank 0's sweep dir in ``LIT_DTRAIN_SWEEP_DIR`` (read by ``conf/hydra``) puts its jobs in rank 0's job dirs."""
    if in_multirun():
        from hydra.core.hydra_config import HydraConfig
        from lightning.pytorch.utilities import rank_zero_only

        os.environ["LIT_DTRAIN_SWEEP_DIR"] = str(sweep_dir_of())
        if not rank_zero_only.rank:  # the job that starts rank 1: the jobs before it were rank 0's alone
            note_job(HydraConfig.get().job.num)


_sweep_world: dict[str, tuple[int, int]] = {}  # sweep dir -> (job, processes) of its first job with a Trainer


def check_sweep_world_size(world_size: int, trainer_cfg: DictConfig) -> None:
    """Refuse a multirun job whose number of processes (``trainer.world_size``) differs from an earlier job's of the
    same sweep in this process, before its fit starts any. Lightning starts the other ranks once, in the first job
    of several processes, each re-running the whole ``-m`` sweep: ``trainer.devices=2,1`` failed job 1 with
    'IndexError: list index out of range' on rank 1 and a closed gloo connection on rank 0 (the 2-rank group of
    job 0 is kept for the later jobs), and ``trainer.devices=1,2`` trained only because rank 1's run of job 0 was
    refused (that dir already held checkpoints). A no-op outside a multirun."""
    from hydra.core.hydra_config import HydraConfig

    if not in_multirun():
        return
    hc = HydraConfig.get()
    sweep = str(sweep_dir_of(hc))
    first_job, first_world = _sweep_world.setdefault(sweep, (hc.job.num, world_size))
    if world_size != first_world:
        raise ConfigError(
            f"job {hc.job.num} runs on {world_size} process(es) (trainer.devices={trainer_cfg.get('devices')}, "
            f"trainer.num_nodes={trainer_cfg.get('num_nodes', 1)}) and job {first_job} of this multirun on "
            f"{first_world}: Lightning starts a sweep's other ranks once, each re-running the whole -m sweep, so every "
            "job of one multirun must run on the same number of processes; sweep each device count in its own -m run, "
            "and compare the sweeps with scripts/compare_runs.py SWEEP_DIR1 SWEEP_DIR2"
        )


def logs_a_failed_job(train_fn):
    """Wrap ``train_fn(cfg)`` so that under Hydra a run that raises logs why (``job N failed: Type: message`` in a
    multirun, ``run failed: ...`` in a single run; a bad input, :func:`user_error`, without its traceback) into the
    run's ``<job name>.log`` (read by ``scripts/compare_runs.py``) and, in a multirun, on the console, once for a DDP
    job's ranks (:mod:`lit_dtrain._job_failure_once`; Hydra reports only the first failed job). A start refused in an
    earlier (or running) run's dir, whose ``config_resolved.yaml`` it did not replace, logs on the console only."""
    job_log = logging.getLogger(train_fn.__module__)

    @functools.wraps(train_fn)
    def wrapper(cfg: DictConfig):
        from hydra.core.hydra_config import HydraConfig

        earlier_run = job_starts(cfg)
        try:
            return train_fn(cfg)
        except Exception as e:
            error = user_error(e)  # a bad input: its own type and message, no traceback
            shown = error or e
            # a start refused in the dir of an earlier or running run, which did not fail: not in its log files
            # (compare_runs showed an unfinished job of a re-run sweep as failed with the refusal of the re-run)
            files = failed_in_its_own_run(cfg, earlier_run)
            if in_multirun():  # a DDP job refused alike on every rank: on the console once, rank 0's
                num = HydraConfig.get().job.num
                line = f"job {num} failed: {type(shown).__name__}: {shown}"
                log_to_handlers(job_log, line, logging.ERROR, traceback=error is None, files=files,
                                console=error is None or not (ran_before_this_rank(e, num) or
                                                              rank_0_reports(e, num, line)))
            elif HydraConfig.initialized() and files:
                log_to_handlers(job_log, f"run failed: {type(shown).__name__}: {shown}", logging.ERROR,
                                traceback=error is None)
            raise

    return wrapper


def log_training_start(logger: logging.Logger) -> None:
    """Log :data:`lit_dtrain.run_dirs.TRAINING_STARTS` to Hydra's job log (files only), for a start that passed its
    checks and trains: :func:`lit_dtrain.run_dirs.job_error` reads only the errors logged after the latest one, so a
    run whose later start was killed (which logs no error) is not shown as failed with an earlier start's error."""
    from lit_dtrain.run_dirs import TRAINING_STARTS

    log_to_handlers(logger, TRAINING_STARTS)


def user_error(e: BaseException) -> BaseException | None:
    """The lit_dtrain error behind ``e`` that says the user's input is wrong, or None: a ``ConfigError``, a
    ``CorpusError`` (also when Hydra's ``instantiate`` wrapped it: ``Error in call to target ... full_key: data``), a
    plain ``ValueError`` or Lightning's ``MisconfigurationException`` that a constructor raised inside ``instantiate``
    (an argument check: reported as a ``ConfigError`` prefixed with Hydra's ``full_key``, ``callbacks.loss_spike:
    LossSpikeMonitor: method must be ...``; Hydra showed no traceback for it either), a ``CheckpointError`` but one
    from writing a checkpoint that is not an OS error (a full disk is one; an object torch cannot pickle is a bug)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lit_dtrain.checkpoint import CheckpointError, _os_error
    from lit_dtrain.data.corpus import CorpusError

    if isinstance(e, InstantiationException) and e.__cause__ is not None:
        # a constructor's own argument check (check_arg, LlamaConfig, ...; Lightning's: ModelCheckpoint's save_top_k)
        if type(e.__cause__) is ValueError or isinstance(e.__cause__, MisconfigurationException):
            # Hydra's message is "Error in call to target '<class>':\n<repr of the error>\nfull_key: <node>"
            node = next((line[len("full_key: "):] for line in str(e).splitlines() if line.startswith("full_key: ")),
                        None)
            return ConfigError(f"{node}: {e.__cause__}" if node else str(e.__cause__))
        e = e.__cause__
    if isinstance(e, (ConfigError, CorpusError)):
        return e
    if (unset := unset_env_var(e)) is not None:
        return unset
    if isinstance(e, CheckpointError):
        writing = str(e).startswith("could not write checkpoint")
        return e if not writing or _os_error(e.__cause__) is not None else None
    return None


def stopped_on_purpose(e: BaseException) -> BaseException | None:
    """``e`` where it is a check that stopped the run and says why in its message, or None: a ``NonFiniteError`` (the
    step and the tensors), ``LossSpikeMonitor``'s ``raise`` (``LossSpikeError``: the steps and the events file), a
    ``FirstConnectionError`` (how many ranks connected, the key to raise) or a ``CollectiveError`` (a peer died or
    hung: the step, the timeout key, ``resume=auto``). Reported in one line as a bad input is
    (:func:`reports_user_errors`); its traceback stays in the run's log (:func:`logs_a_failed_job`)."""
    from lit_dtrain.callbacks.loss_spike import LossSpikeError
    from lit_dtrain.module import NonFiniteError
    from lit_dtrain.train import CollectiveError
    from lit_dtrain.utils.distributed import FirstConnectionError

    return e if isinstance(e, (NonFiniteError, LossSpikeError, FirstConnectionError, CollectiveError)) else None


class UserInputError(CompactHydraException):
    """A bad input, which Hydra reports as its message alone (no traceback) at the end of a multirun."""


def reports_user_errors(task_fn):
    """Wrap a Hydra task function so that a bad input (:func:`user_error`) or a check that stopped the run
    (:func:`stopped_on_purpose`) is reported in one line, ``error: <message>`` on stderr, with exit status 1 (Hydra
    printed its shortened traceback: a ``NonFiniteError`` under 78 lines of Lightning's). A single run exits there. In
    a multirun the job fails (``job N failed: ...``), the next jobs run, and Hydra reports the first failed job's line
    after the sweep (a DDP job's rank 0 alone where every rank gave it), but a first connection that timed out or a
    failed collective ends the sweep there. Others keep their traceback (all do: HYDRA_FULL_ERROR=1)."""

    @functools.wraps(task_fn)
    def wrapper(cfg: DictConfig):
        try:
            return task_fn(cfg)
        except Exception as e:
            from lit_dtrain.strategies._connect import ends_the_sweep
            from lit_dtrain.train import CollectiveError

            error = user_error(e) or stopped_on_purpose(e)
            # a first connection that timed out or a failed collective ends the sweep: its later jobs would fail too
            ending = ends_the_sweep(error or e) if in_multirun() else None
            if error is None and ending is None or full_error_asked():  # Hydra's own switch, read as it does
                raise
            if in_multirun() and ending is None:
                if reported_by_rank_0(e):  # (_job_failure_once): rank 0's Hydra reports the job after the sweep
                    return None
                raise UserInputError(f"error: {error}") from e  # recorded as this job's failure; the sweep goes on
            _exit_with(ending or error, once_across_ranks=ending is None and not isinstance(error, CollectiveError))

    return wrapper


def _exit_with(error: BaseException, once_across_ranks: bool = True):
    """Print ``error: <message>`` on stderr (``once_across_ranks``: once for DDP's ranks; not after a dead peer, maybe
    rank 0 with the store) and exit 1 (``HYDRA_FULL_ERROR=1``: its traceback, then exit 1). Raised from a Hydra callback
    under ``HYDRA_FULL_ERROR=1`` (the checks below), a run started: ``run_name=''`` trained in the runs dir."""
    if full_error_asked():
        try:
            raise error
        except BaseException:  # noqa: BLE001 - printed with where it was raised, as the full error asked
            traceback.print_exc()
        raise SystemExit(1) from None
    (print_once_across_ranks if once_across_ranks else print)(f"error: {error}", file=sys.stderr)  # DDP: rank 0's
    raise SystemExit(1) from None


class ResumeSweepCheck(Callback):
    """Hydra callback (``conf/hydra/default.yaml``): refuse ``resume=auto`` in a multirun without ``hydra.sweep.dir``
    before Hydra creates the sweep dir. ``train(cfg)`` refuses it in each job too, but by then Hydra had written a
    sweep dir, its ``multirun.yaml`` and a dir per job (a sweep of nothing that ``scripts/compare_runs.py`` listed)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from lit_dtrain.resume import _created_by_this_start, new_sweep_dir_error

        if OmegaConf.select(config, "resume", default=None, throw_on_resolution_failure=False) != "auto":
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.exists() and _created_by_this_start(sweep_dir, unresolved(config.hydra.overrides.hydra)):
            _exit_with(new_sweep_dir_error(sweep_dir))
        if not sweep_dir.exists():  # a requeue-ready script's first start, or a mistyped dir: say so, once
            # (on stderr: Hydra sets up logging for the jobs only)
            print(f"warning: resume=auto: the sweep dir {sweep_dir} does not exist, so every job starts fresh (a sweep "
                  "resumes from its dir, e.g. 'hydra.sweep.dir=${paths.log_dir}/multiruns/<time>')", file=sys.stderr,
                  flush=True)


class SweepSyntaxCheck(Callback):
    """Hydra callback (``conf/hydra/default.yaml``): refuse in one line ``interval(...)`` under Hydra's basic sweeper
    (typed, or in an experiment's ``hydra.sweeper.params``) before the sweep dir is made; it was a 16-line traceback
    ending in 'BasicSweeper does not support sweep type : INTERVAL_SWEEP', naming no key and no fix. Also, under any
    sweeper, a swept config group option that does not exist (:func:`~lit_dtrain.sweep_grid.unknown_group_option`)."""

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        sweeper = config.hydra.sweeper
        lines = grid_lines(sweeper) + unresolved(config.hydra.overrides.task)
        try:
            overrides = OverridesParser.create().parse_overrides(lines)
        except Exception:  # noqa: BLE001 - Hydra reports an override it cannot parse itself
            return
        unknown = unknown_group_option(overrides, config_name, unresolved(config.hydra.overrides.get("hydra")))
        if unknown:  # -m model=nano,doesnotexist: Hydra's error came after it made the sweep dir
            _exit_with(ConfigError(unknown))
        job_dirs = job_checkpoint_dirs(config, lines)
        if shared := shared_checkpoint_dir_error(raw_checkpoint_dir(config), overrides, job_dirs):
            _exit_with(ConfigError(shared))  # before the sweep dir is made (train(cfg) refuses it in each job too)
        if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
            return  # a sampling sweeper (Optuna, Nevergrad) takes interval()
        for o in overrides:
            if o.is_sweep_override() and not o.is_discrete_sweep():
                key = o.get_key_element()
                _exit_with(ConfigError(
                    f"{o.input_line}: Hydra's basic sweeper runs listed values, not an "
                    f"interval (that needs a sampling sweeper plugin, e.g. Optuna's: hydra/sweeper=optuna); list "
                    f"them, {key}=1e-4,3e-4,1e-3, or use range(start,stop,step) or choice(...)"))


class OutputDirCheck(Callback):
    """Hydra callback (``conf/hydra/default.yaml``): refuse in one line a run or sweep dir that cannot be written (a
    read-only file system, a file in the way, no permission) before Hydra creates it. Hydra's ``mkdir`` failed with
    a traceback ('OSError: [Errno 30] Read-only file system: .../runs') that did not say which setting chose it."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        with _hydra_config(config):  # ${hydra:...} in run_name or hydra.run.dir, as Hydra's run_job reads them next
            _check_output_dir(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _check_output_dir(config, "sweep")
        note_sweep_dir(config.hydra.sweep.dir)  # removed if no job starts (a job's compose error): _sweep_of_nothing


@contextlib.contextmanager
def _hydra_config(config: DictConfig):
    """Hydra's config set to ``config`` (a single run's, which Hydra sets itself as its job starts, right after the
    callbacks' ``on_run_start``), put back after: ``run_name=${hydra:job.num}`` (or a ``hydra.run.dir`` of
    ``${hydra:job.override_dirname}``) raised 'HydraConfig was not set' in the check, which Hydra only warned about,
    and the run trained unchecked (into outputs/runs/None: a single run has no job number)."""
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig

    hydra_type = OmegaConf.get_type(config, "hydra") if "hydra" in config else None
    if not (isinstance(hydra_type, type) and issubclass(hydra_type, HydraConf)):  # not Hydra's (a test's config)
        yield
        return
    earlier = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = earlier


def _check_output_dir(config: DictConfig, kind: str) -> None:
    from omegaconf.errors import OmegaConfBaseException

    from lit_dtrain._output_dir_advice import output_dir_advice
    from lit_dtrain._removed_keys import check_run_dir_keys
    from lit_dtrain.utils.atomic import unwritable_dir_reason

    try:  # ~paths.log_dir: Hydra's traceback; run_name='' made the run dir outputs/runs itself (not a sweep's)
        check_run_dir_keys(config, run_name=kind == "run")
        directory = config.hydra[kind].dir
    except ConfigError as error:
        _exit_with(error)
    except OmegaConfBaseException as error:
        if kind != "run":  # a sweep dir Hydra's sweeper resolves itself
            raise
        _exit_with(ConfigError(_unresolvable_run_dir(config, error)))
    reason = unwritable_dir_reason(str(directory))
    if reason:
        _exit_with(ConfigError(
            f"the {kind} dir {str(directory)!r} {reason}; {output_dir_advice(config, kind, str(directory))}"
        ))


def _unresolvable_run_dir(config: DictConfig, error: BaseException) -> str:
    """The refusal of a run dir that cannot be resolved: ``run_name=${hydra:job.override_dirname}`` names the run dir
    after the overrides, its own among them, so it resolves itself without end (Hydra's RecursionError traceback,
    then 'An error occurred during Hydra's exception formatting')."""
    raw = config.hydra.run._get_node("dir")._value()
    if "maximum recursion depth" in str(error):
        return (f"hydra.run.dir={raw!r} refers to itself: ${{hydra:job.override_dirname}} lists every override, the "
                "run_name (or hydra.run.dir) that uses it too; leave that key out of it, "
                "'hydra.job.config.override_dirname.exclude_keys=[run_name]'")
    return f"hydra.run.dir={raw!r} cannot be resolved: {str(error).splitlines()[0]}"
