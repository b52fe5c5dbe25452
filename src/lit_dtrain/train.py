"""``train(cfg)``: build everything from a composed Hydra config, fit, validate, summarize.

A plain function (as in lightning-hydra-template) so tests and other programs can call it directly. Its parts
are modules of their own: the config checks (``lit_dtrain.config_checks``), the checkpoint a start
continues from (``lit_dtrain.resume``), the callbacks it adds (``lit_dtrain.train_callbacks``), its exit on
SIGTERM (``lit_dtrain.sigterm_exit``) and its end-of-run sample and report (``lit_dtrain._run_report``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lit_dtrain._chdir_paths import absolute_paths_under_chdir
from lit_dtrain._collective_errors import CollectiveError, collectives_named  # noqa: F401 - CollectiveError: train's
from lit_dtrain._config_values import forget_given_values, said_as_given
from lit_dtrain._job_failure_once import note_training_start
from lit_dtrain._launch_checks import check_multinode_launch, check_torchrun_launch, warn_about_torchrun_restarts
from lit_dtrain._model_config_check import check_the_resumed_model
from lit_dtrain._own_builds_check import check_own_builds
from lit_dtrain._removed_keys import check_removed_keys
from lit_dtrain._run_report import _generate_sample, _report, sample_settings, summary_entropy
from lit_dtrain.callbacks._checkpoint_report import summary_entry
from lit_dtrain.callbacks._contract import check_step_outputs
from lit_dtrain.callbacks.memory_monitor import highest, ranks_peak_rss_mib
from lit_dtrain.callbacks.model_checkpoint import own_the_resumed_file, resumed_and_trained_nothing
from lit_dtrain.checkpoint import AtomicCheckpointIO, CheckpointError, checkpoint_global_step, misfit_message
from lit_dtrain.config_checks import (
    check_callback_nodes,
    check_config,
    check_known_keys,
    scheduler_config,
    warn_if_the_schedule_ends_early,
)
from lit_dtrain.config_resolvers import UNRESOLVED
from lit_dtrain.divergence import NonFiniteLossWatch, report_divergence
from lit_dtrain.errors import ConfigError, interpolation_error  # noqa: F401 - ConfigError: importable from here (tests)
from lit_dtrain.loggers import ConfigHparams, build_logger, flat_hparams
from lit_dtrain.logs_kept import LogsKeptUntilTraining, put_back_a_killed_starts_logs
from lit_dtrain.module import LitLLM, perplexity
from lit_dtrain.resume import check_optimizer_state, check_start_step, resolve_ckpt_path, warn_if_accumulation_splits
from lit_dtrain.run_lock import hold_checkpoint_dir, hold_run_dir, release_run_dir
from lit_dtrain.schedules._init_from import (
    drop_required_init_from_on_a_full_resume,
    keep_the_weights_origin,
    refuse_empty_checkpoint_paths,
)
from lit_dtrain.schedules.workflows import (
    apply_decay_branch,
    check_init_from,
    fit_default_warmup,
    load_model_weights,
    warn_if_the_resume_moves_the_lr,
)
from lit_dtrain.sigterm_exit import (
    HoldSigtermInValidate,
    SigtermRecorder,
    agree_on_a_late_sigterm,
    hint_train_resume,
    interrupted_by_ctrl_c,
    keyboard_interrupt_kept,
    sigterm_after_the_last_step,
    sigterm_handler_kept,
    stopped_by_sigterm,
)
from lit_dtrain.slurm import catch_requeue_signal, check_slurm_launch, slurm_plugins, warn_about_a_requeued_fresh_start
from lit_dtrain.stop_reason import agree_on_early_stop, early_stop_kept, stop_reason, warn_if_the_schedule_did_not_end
from lit_dtrain.stops_before_training import StopsBeforeTraining, may_resume
from lit_dtrain.strategies.by_name import refuse_spawned_ranks, trainer_strategy
from lit_dtrain.strategies.comm_checkpoint import refuse_another_preset
from lit_dtrain.sweeps import check_sweep_world_size, log_training_start, logs_a_failed_job, pin_sweep_dir, sweep_checks
from lit_dtrain.train_callbacks import (
    LogStepSync,
    TrainClock,
    ValLimitCheck,
    add_required_callbacks,
    figures_of_the_fit_that_trained,
    max_time_timer,
)
from lit_dtrain.utils.atomic import remove_killed_writes_temp_files, write_atomically
from lit_dtrain.utils.distributed import destroy_default_group, destroy_process_group_at_exit
from lit_dtrain.utils.job_log import console_lines_to_job_log, warnings_reach_the_console
from lit_dtrain.utils.launcher_watch import past_the_last_collective, watched_run
from lit_dtrain.utils.lightning_noise import quiet_lightning_noise
from lit_dtrain.utils.rss import own_peaks_for_a_multirun_job

log = logging.getLogger(__name__)


def _fit(trainer: L.Trainer, module, datamodule, ckpt_path) -> None:
    with collectives_named(trainer):
        try:
            with keyboard_interrupt_kept(trainer):
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except RuntimeError as e:
            if ckpt_path and str(e).startswith("Error(s) in loading state_dict"):
                raise CheckpointError(misfit_message(ckpt_path, module, e)) from e
            raise


def _remove_killed_writes_temp_files(cfg: DictConfig) -> list[Path]:
    """The temp files of writes killed midway (checkpoints, ``metrics.csv``, ``summary.json`` ...) in the run dir, its
    subdirs and ``paths.checkpoint_dir`` (also a symbolic link, or elsewhere), removed where their writer's pid is
    dead (:func:`remove_killed_writes_temp_files`): a live process's is its write in progress."""
    return [*remove_killed_writes_temp_files(cfg.paths.output_dir),
            *remove_killed_writes_temp_files(cfg.paths.checkpoint_dir)]  # (swept already: none left to remove)


def val_check_in_batches(cfg: DictConfig) -> dict:
    """``trainer.val_check_interval`` counts optimizer steps here, Lightning counts micro-batches: with gradient
    accumulation it is scaled, so validation (and the checkpoint after it) falls every N optimizer steps, at the
    end of a step, never in the middle of an accumulation. A duration given as a mapping (``{minutes: 30}``) goes to
    Lightning as the ``timedelta`` (a ``dict`` is merged back into a DictConfig by Hydra): the DictConfig, which
    Lightning took for a number of batches, was a TypeError before training ("'<=' not supported between instances
    of 'int' and 'DictConfig'")."""
    interval = cfg.trainer.get("val_check_interval")
    if isinstance(interval, DictConfig):
        return {"val_check_interval": datetime.timedelta(**OmegaConf.to_container(interval, resolve=True))}
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    if accumulate > 1 and isinstance(interval, int):
        return {"val_check_interval": interval * accumulate}
    return {}


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """Every entry of ``cfg.callbacks`` that has a ``_target_`` (null entries switch one off)."""
    check_callback_nodes(cfg)  # check_config's: a node without _target_ ('+callbacks.loss_spike.z=3')
    callbacks = []
    for node in (cfg.get("callbacks") or {}).values():
        if node is None:
            continue
        callbacks.append(instantiate(node))
    branch = f"branch: decay_branch.ckpt={Path(cfg.paths.checkpoint_dir) / 'last.ckpt'} decay_branch.steps=N"
    for callback in callbacks:  # WSDScheduler: train.py warns about a resume's LR itself, in the config's words;
        if hasattr(callback, "warn_on_resume_lr"):  # an early-stopped run's resume trains no step: it branches
            callback.warn_on_resume_lr, callback.decay_advice = False, branch
    return callbacks


def record_training_start(out_dir: Path, write: bool = True) -> None:
    """Write this start's Hydra overrides to ``<run dir>/overrides.yaml`` and log that it trains to its job log
    (:func:`log_training_start`; a no-op outside Hydra). Hydra writes ``.hydra/overrides.yaml`` at every start,
    before the job runs: a start that a check refused in a run dir (a sweep re-run with ``resume=auto`` and its
    values in another order, a bad value) overwrote the record of the run trained there, and
    ``scripts/compare_runs.py`` labelled that run with the refused values. This file is written only by a start
    that passed the checks and trains, beside ``config_resolved.yaml`` (``write=False``: a ``fast_dev_run`` smoke test,
    which keeps the record of the run trained in that dir)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        overrides = HydraConfig.get().overrides.task
        if write:
            write_atomically(out_dir / "overrides.yaml", lambda tmp: OmegaConf.save(overrides, tmp))
        log_training_start(log)


@logs_a_failed_job  # a sweep job's error, in its log: any Hydra app calling train(cfg) gets it
def train(cfg: DictConfig) -> tuple[dict, dict]:
    """Train per ``cfg``; returns (metrics, objects). Rank 0 writes ``summary.json`` to the run dir.

    A one-process group that the run started (a strategy such as FSDP or DDP on one device) is destroyed when it
    returns or raises: left alive, an NCCL group made a later ``train()`` on the CPU in the same process fail at its
    first collective. Groups of several ranks, and any group that existed before the call, are left alone (a
    multirun under DDP runs its jobs in lockstep on one group). The variables Lightning's DDP setup exported for it
    (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``/``PORT``) get their earlier values back: a ``train.py`` with 2 DDP
    ranks that this process starts later would otherwise take itself for an externally launched rank 0 and wait for a
    rank 1 forever."""
    had_group = dist.is_available() and dist.is_initialized()
    launch_env = {key: os.environ.get(key) for key in _DDP_LAUNCH_ENV}
    try:
        # watched_run: a rank Lightning's launcher started ends when rank 0 is gone (it waited 30 min for it)
        with watched_run(), sigterm_handler_kept(), contextlib.ExitStack() as held:  # held: the run dir's lock
            return _train(cfg, held)
    except KeyboardInterrupt:  # Ctrl-C where nothing saves (in training, PreemptionCheckpoint saves and exits 130)
        branch = OmegaConf.select(cfg, "decay_branch.ckpt", default=None)  # it sets ckpt_path, refused beside it
        key, given = ("decay_branch.ckpt", branch) if branch else ("ckpt_path", cfg.get("ckpt_path"))
        raise SystemExit(interrupted_by_ctrl_c(cfg.paths.checkpoint_dir, given, key)) from None
    finally:
        if not had_group and destroy_default_group(single_process_only=True):
            for key, value in launch_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_DDP_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _train(cfg: DictConfig, held: contextlib.ExitStack) -> tuple[dict, dict]:
    # a stop signal from here to training says so on every rank (stops_before_training.py): in the config checks, the
    # model's build (-15 and no line before), and until on_train_start
    stops = held.enter_context(StopsBeforeTraining())
    stops.looked_for = not may_resume(cfg)  # until resolve_ckpt_path: a stop in the checks is no known new run
    absolute_paths_under_chdir(cfg)  # hydra.job.chdir=true: relative paths stay the command's, not the run dir's
    check_removed_keys(cfg)  # ~optimizer.lr and the like: one line, not a class default or a KeyError
    # under srun: SIGUSR1 requeues the job from here on (its default ended the process), if a requeue continues the run
    catch_requeue_signal(continues=cfg.get("resume") == "auto")
    quiet_lightning_noise()
    held.enter_context(console_lines_to_job_log())  # Lightning's lines and warnings into train.log too
    held.enter_context(warnings_reach_the_console())  # under hydra/job_logging=disabled too
    destroy_process_group_at_exit()  # a no-op without one; Lightning's own handler covers NCCL only
    pin_sweep_dir()  # multirun + DDP: rank 1, which Lightning re-launches in fit, joins this sweep dir
    own_peaks_for_a_multirun_job()  # job 2 on of a sweep in one process: its memory figures, not the jobs' highest
    sweep_checks(cfg)  # -m warning; a multirun's resume=auto: before this start rewrites the job's config_resolved.yaml
    forget_given_values()  # whole floats read as integers, said as given in a refusal below
    try:
        check_known_keys(cfg)  # first: the decay branch below reads its keys
        refuse_empty_checkpoint_paths(cfg)  # init_from=$CKPT with CKPT unset trained from random weights
        drop_required_init_from_on_a_full_resume(cfg)  # a branch or extension of an experiment=cpt_replay run
        branch_step = apply_decay_branch(cfg)  # WSD decay branch: sets ckpt_path, max_steps and the schedule's horizon
        check_config(cfg)
        check_own_builds(cfg)  # lit_dtrain's callbacks and codecs, built and dropped: their argument checks
        init_weights = check_init_from(cfg)  # not on a resume=auto of this run's own checkpoints
    except UNRESOLVED as e:  # ${lit.required:...} of an experiment, ${nope}, or ${oc.evn:X} (no such resolver)
        raise interpolation_error(e, cfg) from None
    except Exception as e:  # data.block_size=1.0 was refused as 'data.block_size=1', decay_branch.steps=0.0 'got 0'
        said_as_given(e)
        raise
    ckpt_path = resolve_ckpt_path(cfg)
    start_step = checkpoint_global_step(ckpt_path) if ckpt_path else 0
    stops.resumed_step, stops.looked_for = (start_step if ckpt_path else None), True
    if ckpt_path:  # before the schedule is built: an extension's default warmup must not re-warm a stable checkpoint
        check_the_resumed_model(cfg.model, ckpt_path)  # a checkpoint of another model: that error alone, no LR warning
        fit_default_warmup(cfg, ckpt_path, start_step)
        warn_if_the_resume_moves_the_lr(cfg, ckpt_path, start_step)  # a branch's start warns itself, its restart not
        keep_the_weights_origin(cfg, ckpt_path)  # init_from: where the checkpoint's run began, for the run's record
    warn_if_the_schedule_ends_early(cfg, start_step)
    warn_about_torchrun_restarts(cfg)
    check_slurm_launch(cfg)  # before any compute: a wrong world size, or a rank that never comes
    warn_about_a_requeued_fresh_start(cfg, ckpt_path)  # a requeued job without resume=auto starts over
    check_torchrun_launch(cfg)
    check_multinode_launch(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))

    datamodule = instantiate(cfg.data, _convert_="all")
    if (cfg.get("module") or {}).get("compile"):
        # Dynamo caches compiled graphs per code object (Llama.forward), not per model, and a job leaves two there
        # (training, validation; the sample runs the k/v cache eagerly). The jobs of a
        # multirun share the process: one that swept a model shape hit dynamo's recompile_limit (8) at its third
        # job, which then trained eagerly with only a log warning. Each job compiles from an empty cache.
        torch.compiler.reset()
    model = instantiate(cfg.model)
    if init_weights:  # continual pre-training: weights only
        load_model_weights(model, cfg.init_from)
    module = LitLLM(
        model,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(scheduler) if (scheduler := scheduler_config(cfg)) else None,
        val_names=datamodule.val_names,
        **OmegaConf.to_container(cfg.module, resolve=True),
    )
    callbacks = build_callbacks(cfg)
    run_name = cfg.get("run_name")  # the resume hints name it: a default one is the start time
    hint_train_resume(callbacks, run_name)  # PreemptionCheckpoint names resume=auto, with this run's names
    if cfg.trainer.get("enable_progress_bar") is False:  # honour the flag instead of Lightning's conflict error
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    if not cfg.get("logger"):  # logger=none / ~logger: the LR monitor has nowhere to log (Lightning would refuse)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    add_required_callbacks(callbacks, datamodule.sampler)
    check_step_outputs(callbacks, module)  # before any compute
    clock = TrainClock()
    # LogStepSync first: it must fix the logging step before any other callback's on_train_batch_start logs at it
    # (LearningRateMonitor logs the step's LR there)
    watch = NonFiniteLossWatch()  # the first NaN/inf loss, for summary.json's "diverged"
    callbacks = [LogStepSync(), *callbacks, clock, watch, HoldSigtermInValidate(), SigtermRecorder()]
    callbacks = early_stop_kept(callbacks, branch=branch_step is not None)  # a branch: its decay, all of it
    if isinstance(limit := cfg.trainer.get("limit_val_batches"), float) and limit < 1:
        callbacks.append(ValLimitCheck(limit))  # at fit start: the loaders' sizes need the token caches
    if cfg.get("logger"):  # the resolved config in TensorBoard's HParams view
        callbacks.append(ConfigHparams(flat_hparams(OmegaConf.to_container(cfg, resolve=True))))
    if rank_zero_only.rank == 0:  # before fit: this process writes nothing there yet, and no other one may train there
        held.callback(release_run_dir, hold_run_dir(cfg.paths.output_dir))
        held.callback(release_run_dir, hold_checkpoint_dir(cfg.paths.checkpoint_dir, cfg.paths.output_dir))
        for tmp in _remove_killed_writes_temp_files(cfg):
            log.warning("removed %s, left by a process killed while writing it", tmp)
        put_back_a_killed_starts_logs(cfg.paths.output_dir)  # a resume killed before training had cut them
    if ckpt_path:  # start_step is read before fit: the final save below may overwrite this very file (resume=auto)
        check_start_step(cfg, start_step, ckpt_path)
        check_optimizer_state(cfg, ckpt_path)
        warn_if_accumulation_splits(cfg, ckpt_path)
        if cfg.get("resume") == "auto":  # a step file it took is the run's own: its top-k drops it as any other
            own_the_resumed_file(callbacks)
    extra = val_check_in_batches(cfg)
    if timer := max_time_timer(cfg.trainer, callbacks):  # last, where Lightning appends its own Timer
        callbacks.append(timer)
        extra["max_time"] = None
    if cfg.module.get("compile") and "inference_mode" not in cfg.trainer:
        # the final validate under inference_mode is another dispatch key set than the in-fit validation's no_grad:
        # dynamo compiled a graph for it alone (~45 s for model=nano on 2 CPU cores); no_grad reuses the fit's
        extra["inference_mode"] = False
    with trainer_strategy(cfg) as strategy:  # strategy=auto on several processes: Lightning's "ddp", as strategy=ddp's
        if ckpt_path:  # another codec's state: refused before the logger cuts the run's logs at the checkpoint's step
            refuse_another_preset(strategy, ckpt_path)
        # a resume refused from here to the fit's load: the logs build_logger cuts are put back (logs_kept.py); a stop
        # signal until training starts says so on every rank, fresh starts too (stops_before_training.py)
        kept = stops
        if ckpt_path and rank_zero_only.rank == 0:
            kept = held.enter_context(LogsKeptUntilTraining(cfg.paths.output_dir, start_step))
        logger = build_logger(cfg, start_step)
        trainer: L.Trainer = instantiate(
            cfg.trainer, callbacks=[*callbacks, *dict.fromkeys((stops, kept))], logger=logger, strategy=strategy,
            plugins=[AtomicCheckpointIO(name for name, _ in module.named_parameters()), *slurm_plugins()],
            **extra,
        )
    refuse_spawned_ranks(trainer)  # ddp_spawn / ddp_fork: fit's state would stay in the ranks it spawned
    check_sweep_world_size(trainer.world_size, cfg.trainer)  # before fit starts the other ranks
    out_dir = Path(cfg.paths.output_dir)
    # a smoke test: Lightning checkpoints and logs nothing, and the run dir keeps the record of the run trained there
    # (its config_resolved.yaml, overrides.yaml and summary.json, which compare_runs.py reads)
    smoke_test = bool(trainer.fast_dev_run)
    if trainer.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not smoke_test:  # whole or not at all, as the checkpoints: a resume's check and compare_runs.py read both
            text = OmegaConf.to_yaml(cfg, resolve=True)
            write_atomically(out_dir / "config_resolved.yaml", lambda tmp: tmp.write_text(text))
        record_training_start(out_dir, write=not smoke_test)
    if not smoke_test:  # every rank: a failure from here on is this run's own, for its job log (logs_a_failed_job)
        note_training_start()

    t0 = clock.fit_started()
    try:
        _fit(trainer, module, datamodule, ckpt_path)
    except SIGTERMException:
        raise SystemExit(stopped_by_sigterm(trainer, run_name=run_name, ckpt_dir=cfg.paths.checkpoint_dir)) from None
    stops.cut_stands()
    kept.cut_stands()  # the fit returned: its cut stands (a finished run's restart validates again)
    t1 = time.perf_counter()
    fit_seconds = t1 - t0
    train_seconds = t1 - clock.start if clock.start is not None else fit_seconds
    last_ckpt = str(Path(cfg.paths.checkpoint_dir) / "last.ckpt")
    with collectives_named(trainer, record=True):  # rank 0's disk full in last.ckpt: rank 1 names it
        agree_on_early_stop(trainer)  # before last.ckpt (rank 0's EarlyStopping state) and summary.json's "stopped"
        restored_last = resumed_and_trained_nothing(ckpt_path, last_ckpt, trainer.global_step, start_step)
        if not smoke_test and not restored_last:
            trainer.save_checkpoint(last_ckpt, weights_only=False)  # always a resumable checkpoint of the final step
    if sigterm_after_the_last_step(trainer):  # else it was ignored, and the next job of a multirun started
        raise SystemExit(stopped_by_sigterm(trainer, saved_last=True, run_name=run_name))

    stopped = stop_reason(trainer)  # before validate(), which is not the fit (Lightning's Timer times each stage)
    warn_if_the_schedule_did_not_end(trainer, stopped, start_step, last_ckpt)
    train_loss = float(trainer.callback_metrics.get("train/loss", float("nan")))  # validate() resets the metrics
    try:
        with collectives_named(trainer), keyboard_interrupt_kept(trainer):
            val = trainer.validate(module, datamodule=datamodule, verbose=False)
    except SIGTERMException:  # Lightning's exit status 0 otherwise; resume=auto validates last.ckpt
        raise SystemExit(stopped_by_sigterm(trainer, saved_last=True, run_name=run_name)) from None
    if sigterm_after_the_last_step(trainer):  # one during the validation, which every rank finished
        raise SystemExit(stopped_by_sigterm(trainer, saved_last=True, run_name=run_name))
    peak_rss = ranks_peak_rss_mib(trainer)  # every rank's, the final validation's and last.ckpt's included
    past_the_last_collective()  # the ranks' last one: rank 0 may now end first, normally
    val_metrics = {k: float(v) for k, v in (val[0] if val else {}).items()}
    steps = int(trainer.global_step)
    per_step = datamodule.batch_size * trainer.world_size * datamodule.block_size
    per_step *= int(cfg.trainer.get("accumulate_grad_batches") or 1)
    # a start that only validated: the figures of the fit that trained the steps (its tokens, start_step, wall time)
    previous = figures_of_the_fit_that_trained(trainer, out_dir, clock, per_step, stopped, restored_last) \
        if steps == start_step > 0 else {}
    # the micro-batches trained, where counted: an epoch's last step can have fewer than accumulate_grad_batches
    tokens = clock.tokens if clock.tokens is not None and clock.start is not None else (steps - start_step) * per_step
    val_loss = val_metrics.get("val/loss", float("nan"))
    metrics = {
        "val_loss": val_loss,
        "val_ppl": perplexity(val_loss),
        "steps": steps,
        "tokens_per_sec": tokens / train_seconds if tokens else None,  # None: this invocation trained no step
        "tokens": tokens, "start_step": start_step, "wall_seconds": fit_seconds,  # this start's, or `previous`
        "checkpoint": None if smoke_test else last_ckpt,
        "unigram_entropy": None,  # below: previous's only where it is of this data (summary_entropy)
        "train_loss": train_loss,
        "stopped": stopped,  # max_steps, max_epochs, early_stopping, max_time, should_stop
        **{k: v for k, v in val_metrics.items() if k.startswith("val/") and k not in ("val/loss", "val/ppl")},
    }
    metrics.update(previous)
    metrics["peak_rss_mib"] = highest(previous.get("peak_rss_mib"), peak_rss)  # a restart's: the run's, its own too
    metrics["unigram_entropy"] = summary_entropy(trainer, datamodule, previous)
    metrics.update(summary_entry(trainer.callbacks))  # the checkpointing plan this start trained with
    report_divergence(metrics, module, watch, cfg.paths.checkpoint_dir)  # NaN weights: no last.ckpt holds them
    try:  # rank 0's alone: should it raise (a GPU out of memory), rank 1 waits in the agreement, not in the next job
        sample = _generate_sample(module, datamodule, cfg, trainer, last_ckpt, previous)
        if trainer.is_global_zero:
            _report(metrics, sample, out_dir, trainer, write_summary=not smoke_test, settings=sample_settings(cfg))
    finally:  # a signal in the sample or report: a multirun's rank 1 then stops before the next job too
        agree_on_a_late_sigterm(trainer)
    return metrics, {"trainer": trainer, "module": module, "datamodule": datamodule, "model": model}
