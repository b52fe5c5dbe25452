"""``train(cfg)``: build everything from a composed Hydra config, fit, validate, summarize.

A plain function (as in lightning-hydra-template) so tests and other programs can call it directly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lit_dtrain.callbacks._contract import check_step_outputs
from lit_dtrain.callbacks.preemption import PreemptionCheckpoint
from lit_dtrain.checkpoint import (
    AtomicCheckpointIO,
    CheckpointError,
    checkpoint_files,
    checkpoint_global_step,
    not_a_file_reason,
    remove_stale_temp_files,
    safe_torch_load,
    state_dict_mismatch,
)
from lit_dtrain.config_checks import (
    check_config,
    check_known_keys,
    scheduler_config,
    warn_about_torchrun_restarts,
    warn_if_the_schedule_ends_early,
)
from lit_dtrain.config_resolvers import RequiredValueError, launch_run_name
from lit_dtrain.errors import ConfigError
from lit_dtrain.loggers import ConfigHparams, ResumableCSVLogger, flat_hparams
from lit_dtrain.module import LitLLM, perplexity
from lit_dtrain.schedules.workflows import (
    apply_decay_branch,
    check_init_from,
    fit_default_warmup,
    load_model_weights,
    warn_if_the_resume_jumps_up,
)
from lit_dtrain.sweeps import logs_a_failed_job, sweep_checks
from lit_dtrain.utils.atomic import write_atomically
from lit_dtrain.utils.distributed import (
    PeerRankFailedError,
    destroy_default_group,
    destroy_process_group_at_exit,
    is_collective_failure,
)

log = logging.getLogger(__name__)


class _DropLightningTips(logging.Filter):
    """Drop Lightning's '💡 Tip: ... try installing litlogger/litmodels' adverts (printed on every run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning_noise() -> None:
    """Silence messages every run prints that a user cannot act on (idempotent).

    - Lightning's litlogger / litmodels adverts;
    - torch's FutureWarning about ``LeafSpec``, raised inside Lightning's own ``_pytree`` helper;
    - Lightning's "use sync_dist=True" hint for ``val/*``: LitLLM logs values of torchmetrics metrics, whose
      ``compute()`` has already reduced them over the ranks.
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())
    leafspec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leafspec, category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/")


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank died, hung, or the network broke."""


def _fit(trainer: L.Trainer, module, datamodule, ckpt_path) -> None:
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except RuntimeError as e:
        if ckpt_path and str(e).startswith("Error(s) in loading state_dict"):
            raise CheckpointError(
                f"checkpoint {ckpt_path!r} does not fit the configured model (set model.* to the shape of the run "
                f"that wrote it): {_state_dict_mismatch(ckpt_path, module) or str(e).splitlines()[-1].strip()}"
            ) from e
        if trainer.world_size > 1 and (is_collective_failure(e) or isinstance(e, PeerRankFailedError)):
            launcher = getattr(trainer.strategy, "launcher", None)
            if launcher is not None and hasattr(launcher, "kill"):  # do not wait for a hung child rank
                launcher.kill(signal.SIGKILL)
            raise CollectiveError(
                f"rank {trainer.global_rank}: a collective failed at step {trainer.global_step} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:300]}). Another rank probably died or hung; "
                "the collective timeout is strategy.collective_timeout_s. Resume with resume=auto."
            ) from e
        raise


def _state_dict_mismatch(ckpt_path, module) -> str | None:
    """:func:`state_dict_mismatch` of the checkpoint's weights and ``module``'s, in one line (torch's error lists
    every tensor on a line of its own); None when it cannot be told (then torch's last line is reported)."""
    try:
        return state_dict_mismatch(safe_torch_load(ckpt_path, mmap=True)["state_dict"], module.state_dict())
    except Exception:  # only a better message for an error being raised already
        return None


PREEMPTED_EXIT_STATUS = 128 + signal.SIGTERM  # 143: what a shell reports for a process that SIGTERM ended


def _stopped_by_sigterm(trainer: L.Trainer, saved_last: bool = False) -> int:
    """The exit status of a fit that SIGTERM stopped (Lightning raises ``SIGTERMException``, a ``SystemExit`` with
    status 0). A preempted run has not finished: status 0 let ``train.py && next`` and SLURM's ``afterok`` go on
    as if it had, and a multirun stopped mid-sweep looked complete. Says whether a checkpoint was saved
    (``saved_last``: train() saved the final ``last.ckpt``)."""
    if saved_last:
        log.warning(
            "stopped by SIGTERM after the last step (%d), whose last.ckpt is saved: resume=auto validates it and "
            "writes summary.json",
            trainer.global_step,
        )
    elif not any(isinstance(c, PreemptionCheckpoint) and c.saved_step is not None for c in trainer.callbacks):
        log.warning(
            "stopped by SIGTERM at step %d without a checkpoint (no PreemptionCheckpoint among the callbacks): "
            "resume=auto continues from the last validation's checkpoint, if any",
            trainer.global_step,
        )
    log.info("exiting with status %d (stopped by SIGTERM, not finished)", PREEMPTED_EXIT_STATUS)
    return PREEMPTED_EXIT_STATUS


def _sigterm_after_the_last_step(trainer: L.Trainer) -> bool:
    """Whether a SIGTERM came during fit's last validation, which nothing acted on: ``PreemptionCheckpoint``'s
    handler only records it (it saves at the end of a batch, and none ends after the last validation), and
    Lightning's flag is read before validation batches but the last; or during ``train()``'s final validation,
    which :class:`_HoldSigtermInValidate` lets finish. The ranks agree (one all-reduce), so that all of them stop,
    or none."""
    pending = trainer.received_sigterm or any(
        isinstance(c, (PreemptionCheckpoint, _HoldSigtermInValidate)) and c.signalled for c in trainer.callbacks
    )
    return bool(trainer.strategy.reduce_boolean_decision(pending, all=False))


_DEFAULT_RUN_NAME = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}"  # conf/train.yaml: ${now:%Y-%m-%d}_${now:%H-%M-%S}


def _default_run_name(cfg: DictConfig) -> bool:
    """Whether ``run_name`` is still conf/train.yaml's default (the ``${now:...}`` timestamp, or a launcher's id), i.e.
    nobody gave one (a name given on the command line replaces the interpolation, even one that looks like it)."""
    raw = OmegaConf.to_container(cfg, resolve=False).get("run_name")
    return isinstance(raw, str) and "${now:" in raw


_IMPORTED_AT = time.time()  # before Hydra resolves ${now:...} for this start's sweep dir


def _created_by_this_start(sweep_dir: Path, hydra_overrides: list[str] | None = None) -> bool:
    """Whether ``sweep_dir`` is the default sweep dir (conf/hydra: ``<time>.%f``) of this very start (not one given
    with ``hydra.sweep.dir``): its timestamp is not older than this process's import of lit_dtrain.train. Under
    srun/torchrun the default is the launch's id (as ``run_name``'s), the same on every rank and again on a
    re-launch with that id (a requeued SLURM job, a fixed ``--rdzv-id``): such a dir is this start's while none of
    its jobs holds a checkpoint (every rank sees the same: a job's checkpoints are written after all ranks
    passed this check, and before any rank starts the next job). ``hydra_overrides``: Hydra's own overrides of this
    start, where its runtime config is not set yet (default: read from it)."""
    launch = launch_run_name("")
    if launch:
        given = _sweep_dir_given(hydra_overrides)
        return sweep_dir.name == launch and not given and not any(sweep_dir.glob("*/checkpoints/*.ckpt"))
    if not re.fullmatch(rf"{_DEFAULT_RUN_NAME}\.\d{{6}}", sweep_dir.name):
        return False
    started = datetime.strptime(sweep_dir.name, "%Y-%m-%d_%H-%M-%S.%f").timestamp()
    return started >= _IMPORTED_AT - 1.0


def _sweep_dir_given(hydra_overrides: list[str] | None = None) -> bool:
    """Whether ``hydra.sweep.dir`` was set on the command line: among ``hydra_overrides`` (Hydra's own overrides),
    by default among those of Hydra's runtime config (False outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if hydra_overrides is None:
        if not HydraConfig.initialized():
            return False
        hydra_overrides = list(HydraConfig.get().overrides.hydra)
    return any(str(o).lstrip("+~").split("=")[0] == "hydra.sweep.dir" for o in hydra_overrides)


def new_sweep_dir_error(sweep_dir: Path) -> ConfigError:
    """The refusal of ``resume=auto`` in a multirun whose sweep dir is this start's new one (nothing to resume)."""
    return ConfigError(
        f"resume=auto in a multirun needs hydra.sweep.dir=<the sweep to continue>: without it this start "
        f"writes a new sweep dir {str(sweep_dir)!r} that holds no checkpoint. Re-run the same -m arguments "
        "with hydra.sweep.dir=<outputs/multiruns/<time or launch id> of that sweep>: job N resumes "
        "<sweep dir>/N"
    )


def _newest_step_checkpoint(ckpt_dir: Path) -> Path | None:
    """The readable ``*.ckpt`` of ``ckpt_dir`` with the highest ``global_step`` (``last.ckpt`` among equals), or
    None. Reads each file's ``global_step`` only (mmap: milliseconds for any size)."""
    steps = {}
    for p in sorted(ckpt_dir.glob("*.ckpt")):
        try:
            steps[p] = checkpoint_global_step(p)
        except CheckpointError as e:
            log.warning("resume=auto: skipping %s", e)
    return max(steps, key=lambda p: (steps[p], p.name == "last.ckpt")) if steps else None


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """The checkpoint to resume from: ``ckpt_path``, or ``last.ckpt`` of this run dir when ``resume=auto``."""
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser()
        if not path.is_file():
            raise ConfigError(f"ckpt_path={str(cfg.ckpt_path)!r} {not_a_file_reason(path)}")
        return str(path)
    ckpt_dir = Path(cfg.paths.checkpoint_dir)
    if cfg.get("resume") == "auto" and (ckpt_dir / "last.ckpt").is_file():
        # ModelCheckpoint writes a new best step file before last.ckpt: a kill in between leaves last.ckpt a
        # validation behind. Resuming from it redid those steps and saved the step file again as '<name>-v1.ckpt',
        # leaving the first one behind for good (the resumed ModelCheckpoint state did not know it).
        newest = _newest_step_checkpoint(ckpt_dir)
        if newest is not None and newest.name != "last.ckpt":
            log.warning("resume=auto: %s is newer than %s, resuming from it", newest, ckpt_dir / "last.ckpt")
            return str(newest)
        return str(ckpt_dir / "last.ckpt")
    earlier = checkpoint_files(ckpt_dir)
    if earlier and cfg.get("resume") == "auto":
        # no last.ckpt beside other checkpoints: the run was killed while writing its first last.ckpt
        # (ModelCheckpoint writes the step file first). Continue from the newest intact one.
        newest = _newest_step_checkpoint(ckpt_dir)
        if newest is not None:
            log.warning("resume=auto: no %s, resuming from the newest checkpoint %s", ckpt_dir / "last.ckpt", newest)
            return str(newest)
    if earlier:  # a fresh run here would write last-v1.ckpt beside them, and a later resume=auto pick the old one
        raise ConfigError(
            f"run dir {str(ckpt_dir.parent)!r} already holds checkpoints of an earlier run ({', '.join(earlier[:3])}"
            f"{', ...' if len(earlier) > 3 else ''}); continue it with resume=auto or ckpt_path=PATH, or choose "
            "another run_name"
        )
    if cfg.get("resume") == "auto":
        run_name = str(cfg.get("run_name"))
        requeued = launch_run_name("").startswith("slurm-")  # a Slurm job keeps its id (and step) when requeued
        if Path(str(cfg.paths.output_dir)).name == run_name and _default_run_name(cfg) and not requeued:
            # a single run under the default run_name (a new one each start or torchrun launch): nothing to resume
            raise ConfigError(
                f"resume=auto needs run_name=<the run to continue>: without it run_name is this start's default "
                f"({run_name}: its start time, or its torchrun launch), a new run dir that holds no checkpoint; or "
                "give ckpt_path=PATH (under srun the default, slurm-<job>.<step>, survives a requeue and resumes)"
            )
        sweep_dir = Path(str(cfg.paths.output_dir)).parent
        if _created_by_this_start(sweep_dir):
            # a multirun job in the sweep dir this start just created (conf/hydra: ${now:...%S.%f} or the launch's
            # id): nothing to resume. (conf/hydra's ResumeSweepCheck refuses it before Hydra creates that dir.)
            raise new_sweep_dir_error(sweep_dir)
        log.info("resume=auto: no %s yet, starting fresh", ckpt_dir / "last.ckpt")
    return None


def check_start_step(cfg: DictConfig, start_step: int, ckpt_path: str | None) -> None:
    """A checkpoint past ``trainer.max_steps`` leaves nothing to train: refuse it instead of validating it and
    reporting its step as if this run had been asked for it (at ``max_steps`` it is a finished run: validated)."""
    max_steps = cfg.trainer.get("max_steps")
    if ckpt_path and isinstance(max_steps, int) and start_step > max_steps:
        raise ConfigError(
            f"checkpoint {ckpt_path!r} is at step {start_step}, past trainer.max_steps={max_steps}; set "
            f"trainer.max_steps >= {start_step} to continue it (= {start_step} only validates it)"
        )


_OPTIMIZER_KINDS = {  # configured target -> the per-parameter state it reads on resume
    "lit_dtrain.optim.adamw": ("torch", "torch AdamW"),
    "lit_dtrain.optim.adamw8bit": ("bnb", "bitsandbytes 8-bit AdamW"),
}


def check_optimizer_state(cfg: DictConfig, ckpt_path: str) -> None:
    """Refuse resuming a checkpoint whose optimizer state was written by the other AdamW (torch <-> bitsandbytes):
    Lightning restores it without complaint and the first step fails inside the optimizer (``KeyError: 'state1'``
    in bitsandbytes, ``KeyError: 'exp_avg'`` in torch)."""
    configured = _OPTIMIZER_KINDS.get(str(cfg.optimizer.get("_target_")))
    if configured is None:
        return
    ckpt = safe_torch_load(ckpt_path, mmap=True)
    saved = None
    for opt_state in ckpt.get("optimizer_states") or []:
        for param_state in (opt_state.get("state") or {}).values() if isinstance(opt_state, dict) else []:
            keys = set(param_state) if isinstance(param_state, dict) else set()
            if "exp_avg" in keys:
                saved = ("torch", "torch AdamW")
            elif "state1" in keys or any(str(k).startswith("__bnb") for k in keys):
                saved = ("bnb", "bitsandbytes 8-bit AdamW")
            if saved:
                break
        if saved:
            break
    if saved is not None and saved[0] != configured[0]:
        name = cfg.optimizer._target_.rsplit(".", 1)[-1]
        raise ConfigError(
            f"checkpoint {ckpt_path!r} holds {saved[1]} optimizer state, but optimizer={name} is configured; resume "
            f"with the optimizer it was trained with, or switch with init_from={ckpt_path} (weights only)"
        )


def val_check_in_batches(cfg: DictConfig) -> dict:
    """``trainer.val_check_interval`` counts optimizer steps here, Lightning counts micro-batches: with gradient
    accumulation it is scaled, so validation (and the checkpoint after it) falls every N optimizer steps, at the
    end of a step, never in the middle of an accumulation."""
    interval = cfg.trainer.get("val_check_interval")
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    if accumulate > 1 and isinstance(interval, int):
        return {"val_check_interval": interval * accumulate}
    return {}


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """Every entry of ``cfg.callbacks`` that has a ``_target_`` (null entries switch one off)."""
    callbacks = []
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise ConfigError(f"callbacks.{name} has no _target_")
        callbacks.append(instantiate(node))
    return callbacks


def build_logger(cfg: DictConfig, start_step: int):
    """The configured logger, or False. On a resume at ``start_step`` > 0 it gets ``purge_step=start_step``
    (TensorBoard, and lit_dtrain's ``ResumableCSVLogger`` behind ``logger=csv``): what the interrupted run
    logged past its last checkpoint is dropped, so a resumed curve continues the old one instead of
    doubling back over it, and the history before it is kept."""
    node = cfg.get("logger")
    if not node:
        return False
    extra = {}
    cls = get_class(node._target_)
    if start_step > 0 and "purge_step" not in node:
        if issubclass(cls, (TensorBoardLogger, ResumableCSVLogger)):
            extra["purge_step"] = start_step
        elif issubclass(cls, CSVLogger):
            log.warning("resuming with Lightning's CSVLogger, which deletes the existing metrics.csv; use "
                        "logger=csv (lit_dtrain.loggers.ResumableCSVLogger) to keep it")
    return instantiate(node, **extra)


def build_strategy(cfg: DictConfig):
    node = cfg.get("strategy")
    if node is None:
        return "auto"
    if "_target_" in node:
        return instantiate(node)
    return node.get("name", "auto")


def _generate_sample(module: LitLLM, datamodule, cfg: DictConfig) -> str:
    gen_cfg = cfg.get("sample") or {}
    n_tokens = int(gen_cfg.get("max_new_tokens") or 0)
    if n_tokens <= 0 or not hasattr(module.model, "generate"):
        return ""
    model = getattr(module.model, "_orig_mod", module.model)
    if not all(torch.isfinite(p).all() for p in model.parameters()):  # torch.multinomial would raise on NaN
        log.warning("no text sample: the model's weights are not finite (the run diverged; val_loss is NaN)")
        return ""
    prompt = datamodule.tokenizer.prompt_ids(str(gen_cfg.get("prompt", "def ")))
    ids = torch.as_tensor(prompt.astype("int64"))[None].to(module.device)
    g = torch.Generator(device=module.device.type).manual_seed(int(cfg.seed))
    was_training = model.training
    model.eval()
    out = model.generate(ids, n_tokens, temperature=float(gen_cfg.get("temperature", 0.8)),
                         top_k=gen_cfg.get("top_k", 40), generator=g)
    model.train(was_training)
    return datamodule.tokenizer.decode(out[0].cpu())


class _TrainClock(L.Callback):
    """When training proper starts (``on_train_start``): after the DDP launch, the process-group rendezvous,
    data setup and a checkpoint restore. ``tokens_per_sec`` is measured from here, so it does not charge a run
    with other processes' start-up (in a multirun with DDP only job 0 launches rank 1 and waits for it)."""

    def __init__(self) -> None:
        self.start: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()


class _LogStepSync(L.Callback):
    """Keeps the step that loggers see equal to ``global_step`` after a resume.

    Lightning logs at its own counter of stepped batches, restored from the checkpoint and bumped by one on
    restart, on the assumption that the checkpoint was saved inside a training batch. The final ``last.ckpt``
    that :func:`train` writes after ``fit`` is not, so continuing a finished run (``resume=auto`` with a larger
    ``trainer.max_steps``) logged every later point one step late (val at 9, 12, 13 instead of 8, 11, 12) and its
    curves did not line up with a straight run's. With one optimizer (LitLLM) the two counters are equal by
    construction; this puts them back in line at the first batch, after Lightning's restart bookkeeping."""

    def __init__(self) -> None:
        self._checked = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if self._checked:
            return
        self._checked = True
        loop = trainer.fit_loop.epoch_loop
        if getattr(loop, "_batches_that_stepped", trainer.global_step) != trainer.global_step:
            log.debug("logging step %d -> global_step %d", loop._batches_that_stepped, trainer.global_step)
            loop._batches_that_stepped = trainer.global_step


class _ValLimitCheck(L.Callback):
    """A fractional ``trainer.limit_val_batches`` that leaves a val loader 0 batches: Lightning finds out at the
    first validation, ``val_check_interval`` steps into the run and before any checkpoint, and stops the run there
    (0.1 of a 1-batch loader trained 15 steps, then failed and saved nothing). The loaders' sizes are known once
    the datamodule is set up, so this checks them when the fit starts, before the first step."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loaders = trainer.datamodule.val_dataloader() if trainer.datamodule is not None else []
        names = getattr(pl_module, "val_names", None) or [str(i) for i in range(len(loaders))]
        sizes = {name: len(loader) for name, loader in zip(names, loaders)}
        empty = {name: n for name, n in sizes.items() if int(n * self.limit) < 1}
        if empty:
            raise ConfigError(
                f"trainer.limit_val_batches={self.limit} leaves no validation batch: it is a fraction of each val "
                f"loader, and int({self.limit} x batches) is 0 for {empty} (batches per source and rank: {sizes}). "
                f"Give a fraction >= {_fraction_for_one_batch(min(sizes.values()))}, a number of batches (an int >= "
                "1), or null for all"
            )


class _HoldSigtermInValidate(L.Callback):
    """During ``train()``'s final ``trainer.validate`` a SIGTERM is only recorded (``signalled``): the validation
    finishes on every rank, then ``train()`` has the ranks agree (:func:`_sigterm_after_the_last_step`) and exit with
    143 together. Lightning's own handler broadcasts from inside the handler, and its evaluation loop stops the
    signalled rank alone at its next batch: under DDP the other ranks waited for it in the epoch-end metric
    reduction until ``strategy.collective_timeout_s`` (30 min by default) and failed with a timeout, exit status 1.
    Inert in fit's validations (``PreemptionCheckpoint`` handles a SIGTERM there) and in a single process, where
    Lightning's early stop involves no other rank."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        main_thread = threading.current_thread() is threading.main_thread()
        if trainer.state.fn != "validate" or trainer.world_size == 1 or not main_thread:
            return
        self.signalled = trainer.received_sigterm  # one before this hook: Lightning's flag would stop this rank alone
        trainer._signal_connector.received_sigterm = False
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)  # after Lightning registered its own

    def _restore_handler(self) -> None:
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handler()  # after the epoch-end metric reduction

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handler()


def _fraction_for_one_batch(batches: int) -> str:
    """The smallest fraction, to 3 significant digits, that leaves a loader of ``batches`` one batch by Lightning's
    count ``int(batches * fraction)``: 1 / batches rounded up (0.334 of 3; 0.333 gives 0, as 1 / 49 does of 49)."""
    decimals = max(0, 2 - math.floor(math.log10(1 / batches)))
    units = -(-(10**decimals) // batches)  # ceil(10**decimals / batches)
    while int(batches * float(text := f"{units / 10**decimals:.{decimals}f}")) < 1:
        units += 1
    return text.rstrip("0").rstrip(".") if "." in text else text  # 0.5 of 2, not 0.500


def save_trained_overrides(out_dir: Path) -> None:
    """Write this start's Hydra overrides to ``<run dir>/overrides.yaml`` (a no-op outside Hydra). Hydra writes
    ``.hydra/overrides.yaml`` at every start, before the job runs: a start that a check refused in a run dir
    (a sweep re-run with ``resume=auto`` and its values in another order, a bad value) overwrote the record of the
    run trained there, and ``scripts/compare_runs.py`` labelled that run with the refused values. This file is
    written only by a start that passed the checks and trains, beside ``config_resolved.yaml``."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        overrides = HydraConfig.get().overrides.task
        write_atomically(out_dir / "overrides.yaml", lambda tmp: OmegaConf.save(overrides, tmp))


def pin_sweep_dir() -> None:
    """Multirun with DDP: Lightning re-launches rank 1 with the same ``-m`` arguments, so rank 1 runs its own
    sweep in lockstep with rank 0's. Exporting rank 0's sweep dir (``conf/hydra`` reads
    ``LIT_DTRAIN_SWEEP_DIR``) makes rank 1's jobs write into rank 0's job dirs instead of a second,
    later-timestamped multirun folder. A no-op outside a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        os.environ["LIT_DTRAIN_SWEEP_DIR"] = str(Path(HydraConfig.get().runtime.output_dir).parent)


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
        return _train(cfg)
    finally:
        if not had_group and destroy_default_group(single_process_only=True):
            for key, value in launch_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


_DDP_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _train(cfg: DictConfig) -> tuple[dict, dict]:
    quiet_lightning_noise()
    destroy_process_group_at_exit()  # a no-op without one; Lightning's own handler covers NCCL only
    pin_sweep_dir()  # multirun + DDP: rank 1, which Lightning re-launches in fit, joins this sweep dir
    sweep_checks(cfg)  # -m warning; a multirun's resume=auto: before this start rewrites the job's config_resolved.yaml
    try:
        check_known_keys(cfg)  # first: the decay branch below reads its keys
        branch_step = apply_decay_branch(cfg)  # WSD decay branch: sets ckpt_path, max_steps and the schedule's horizon
        check_config(cfg)
        check_init_from(cfg)
    except RequiredValueError as e:  # a key an experiment needs from the command line (${lit.required:...})
        raise ConfigError(str(e).splitlines()[0]) from None
    ckpt_path = resolve_ckpt_path(cfg)
    start_step = checkpoint_global_step(ckpt_path) if ckpt_path else 0
    if ckpt_path:  # before the schedule is built: an extension's default warmup must not re-warm a stable checkpoint
        fit_default_warmup(cfg, ckpt_path, start_step)
        if branch_step is None:  # (a branch warns itself, naming decay_branch.ckpt)
            warn_if_the_resume_jumps_up(cfg, ckpt_path, start_step)
    warn_if_the_schedule_ends_early(cfg, start_step)
    warn_about_torchrun_restarts(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))

    datamodule = instantiate(cfg.data, _convert_="all")
    if (cfg.get("module") or {}).get("compile"):
        # Dynamo caches compiled graphs per code object (Llama.forward), not per model, and a job leaves three there
        # (training, validation, the sample; four while the final validate ran under inference_mode). The jobs of a
        # multirun share the process: one that swept a model shape hit dynamo's recompile_limit (8) at its third
        # job, which then trained eagerly with only a log warning. Each job compiles from an empty cache.
        torch.compiler.reset()
    model = instantiate(cfg.model)
    if cfg.get("init_from"):  # continual pre-training: weights only
        load_model_weights(model, cfg.init_from)
    module = LitLLM(
        model,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(scheduler) if (scheduler := scheduler_config(cfg)) else None,
        val_names=datamodule.val_names,
        **OmegaConf.to_container(cfg.module, resolve=True),
    )
    callbacks = build_callbacks(cfg)
    if cfg.trainer.get("enable_progress_bar") is False:  # honour the flag instead of Lightning's conflict error
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    if not cfg.get("logger"):  # logger=none / ~logger: the LR monitor has nowhere to log (Lightning would refuse)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    for cb in getattr(datamodule.sampler, "required_callbacks", lambda: [])():  # a sampler is inert without them
        if not any(isinstance(c, type(cb)) for c in callbacks):
            log.info("adding %s (required by %s)", type(cb).__name__, type(datamodule.sampler).__name__)
            callbacks.append(cb)
    check_step_outputs(callbacks, module)  # before any compute
    clock = _TrainClock()
    # _LogStepSync first: it must fix the logging step before any other callback's on_train_batch_start logs at it
    # (LearningRateMonitor logs the step's LR there)
    callbacks = [_LogStepSync(), *callbacks, clock, _HoldSigtermInValidate()]
    if isinstance(limit := cfg.trainer.get("limit_val_batches"), float) and limit < 1:
        callbacks.append(_ValLimitCheck(limit))  # at fit start: the loaders' sizes need the token caches
    if cfg.get("logger"):  # the resolved config in TensorBoard's HParams view
        callbacks.append(ConfigHparams(flat_hparams(OmegaConf.to_container(cfg, resolve=True))))
    if rank_zero_only.rank == 0 and Path(cfg.paths.checkpoint_dir).is_dir():  # before fit: nothing writes there yet
        for tmp in remove_stale_temp_files(cfg.paths.checkpoint_dir):
            log.warning("removed %s, left by a process killed while writing a checkpoint", tmp)
    if ckpt_path:  # start_step is read before fit: the final save below may overwrite this very file (resume=auto)
        check_start_step(cfg, start_step, ckpt_path)
        check_optimizer_state(cfg, ckpt_path)
    logger = build_logger(cfg, start_step)
    extra = val_check_in_batches(cfg)
    if cfg.module.get("compile") and "inference_mode" not in cfg.trainer:
        # the final validate under inference_mode is another dispatch key set than the in-fit validation's no_grad:
        # dynamo compiled a graph for it alone (~45 s for model=nano on 2 CPU cores); no_grad reuses the fit's
        extra["inference_mode"] = False
    trainer: L.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=logger, strategy=build_strategy(cfg), plugins=[AtomicCheckpointIO()],
        **extra,
    )
    out_dir = Path(cfg.paths.output_dir)
    if trainer.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        # whole or not at all, as the checkpoints: a resume's sweep check and compare_runs.py read both files
        text = OmegaConf.to_yaml(cfg, resolve=True)
        write_atomically(out_dir / "config_resolved.yaml", lambda tmp: tmp.write_text(text))
        save_trained_overrides(out_dir)

    t0 = time.perf_counter()
    try:
        _fit(trainer, module, datamodule, ckpt_path)
    except SIGTERMException:
        raise SystemExit(_stopped_by_sigterm(trainer)) from None
    t1 = time.perf_counter()
    fit_seconds = t1 - t0
    train_seconds = t1 - clock.start if clock.start is not None else fit_seconds
    last_ckpt = str(Path(cfg.paths.checkpoint_dir) / "last.ckpt")
    trainer.save_checkpoint(last_ckpt, weights_only=False)  # always leave a resumable checkpoint of the final step
    if _sigterm_after_the_last_step(trainer):  # else it was ignored, and the next job of a multirun started
        raise SystemExit(_stopped_by_sigterm(trainer, saved_last=True))

    train_loss = float(trainer.callback_metrics.get("train/loss", float("nan")))  # validate() resets the metrics
    try:
        val = trainer.validate(module, datamodule=datamodule, verbose=False)
    except SIGTERMException:  # Lightning's exit status 0 otherwise; resume=auto validates last.ckpt
        raise SystemExit(_stopped_by_sigterm(trainer, saved_last=True)) from None
    if _sigterm_after_the_last_step(trainer):  # one during the validation, which every rank finished
        raise SystemExit(_stopped_by_sigterm(trainer, saved_last=True))
    val_metrics = {k: float(v) for k, v in (val[0] if val else {}).items()}
    steps = int(trainer.global_step)
    previous: dict = {}
    if steps == start_step > 0:
        log.info("the checkpoint is already at step %d = trainer.max_steps: nothing to train, only validated", steps)
        with contextlib.suppress(OSError, ValueError):  # keep the training figures of the run that got there
            previous = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    world = trainer.world_size
    tokens = (steps - start_step) * datamodule.batch_size * world * datamodule.block_size
    tokens *= int(cfg.trainer.get("accumulate_grad_batches") or 1)
    val_loss = val_metrics.get("val/loss", float("nan"))
    metrics = {
        "val_loss": val_loss,
        "val_ppl": perplexity(val_loss),
        "steps": steps,
        "tokens_per_sec": tokens / train_seconds if tokens else None,  # None: this invocation trained no step
        "wall_seconds": fit_seconds,
        "checkpoint": last_ckpt,
        "unigram_entropy": datamodule.unigram_entropy(),
        "train_loss": train_loss,
        **{k: v for k, v in val_metrics.items() if k.startswith("val/") and k != "val/loss"},
    }
    metrics.update({k: previous[k] for k in ("tokens_per_sec", "wall_seconds", "train_loss") if k in previous})
    sample = _generate_sample(module, datamodule, cfg)
    if trainer.is_global_zero:
        _report(metrics, sample, out_dir, trainer)
    return metrics, {"trainer": trainer, "module": module, "datamodule": datamodule, "model": model}


@rank_zero_only
def _report(metrics: dict, sample: str, out_dir: Path, trainer: L.Trainer) -> None:
    safe = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    text = json.dumps(safe, indent=2, allow_nan=False)  # strict JSON: NaN/inf become null
    write_atomically(out_dir / "summary.json", lambda tmp: tmp.write_text(text))
    if sample:
        print(f"--- sample ---\n{sample}\n--------------")
        for lg in trainer.loggers:
            if hasattr(getattr(lg, "experiment", None), "add_text"):
                lg.experiment.add_text("sample", f"```\n{sample}\n```", global_step=trainer.global_step)
    tokens_per_sec = metrics["tokens_per_sec"]
    print(
        f"summary: val_loss={metrics['val_loss']:.4f} ppl={metrics['val_ppl']:.2f} "
        f"tokens/s={'-' if tokens_per_sec is None else f'{tokens_per_sec:.0f}'} steps={metrics['steps']} "
        f"wall={metrics['wall_seconds']:.1f}s ckpt={metrics['checkpoint']}"
    )
