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
from omegaconf import DictConfig, ListConfig, OmegaConf

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
                f"that wrote it): {str(e)[:800]}"
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


_NUMERIC_KEYS = {  # key -> the type it must have (an override like trainer.max_steps=abc arrives as a string)
    "optimizer.lr": float, "trainer.max_steps": int, "trainer.val_check_interval": int,
    "trainer.accumulate_grad_batches": int, "trainer.log_every_n_steps": int, "trainer.gradient_clip_val": float,
    "data.batch_size": int, "data.block_size": int, "model.block_size": int, "seed": int,
    "optimizer.weight_decay": float, "optimizer.eps": float, "data.val_fraction": float,
    "data.max_val_windows": int, "data.val_batch_size": int, "model.vocab_size": int, "model.n_layer": int,
    "model.n_head": int, "model.n_kv_head": int, "model.d_model": int, "model.mlp_hidden": int,
    "model.rope_theta": float, "model.norm_eps": float, "model.init_std": float,
}


# numbers that must be finite: lr=inf (or weight_decay=inf) made the first update inf, and the run stopped a step
# later with a NonFiniteError blaming the gradients and saying the weights were still finite; rope_theta=inf and
# init_std=inf build a model that cannot train. gradient_clip_val=inf is a valid "no clipping".
_FINITE_KEYS = ("optimizer.lr", "optimizer.weight_decay", "optimizer.eps", "model.rope_theta", "model.norm_eps",
                "model.init_std")


_BOOL_KEYS = (  # read with `if value:`, so a string (compile=off, check_finite=no) would count as true
    "module.compile", "module.check_finite", "model.tie_embeddings", "model.depth_scaled_init", "data.progress",
)


# The keys of conf/train.yaml that are no class's arguments: its config groups, its own keys, and the keys of its plain
# sections (tests/unit/test_configs.py keeps this in step with the file). Hydra refuses an unknown key on the command
# line (struct mode), but a config file (an experiment, @package _global_) adds one without a word: `init_form:` there
# trained from scratch, `sample: {promt: ...}` or `decay_branch: {step: ...}` did nothing. A _target_ node refuses an
# unknown key itself (its class takes no such argument); paths.* stays open for a user's own interpolations.
CONFIG_KEYS = {
    "": ("model", "data", "optimizer", "scheduler", "callbacks", "strategy", "trainer", "logger", "paths", "hydra",
         "experiment", "seed", "run_name", "ckpt_path", "resume", "init_from", "decay_branch", "matmul_precision",
         "module", "sample"),
    "decay_branch": ("ckpt", "steps"),
    "module": ("compile", "check_finite"),
    "sample": ("prompt", "max_new_tokens", "temperature", "top_k"),
}


def check_known_keys(cfg: DictConfig) -> None:
    """:class:`ConfigError` naming a key that lit_dtrain does not read, at the root or in a plain section of
    conf/train.yaml (see ``CONFIG_KEYS``), unless an interpolation reads it: a typo in a config file must not fall
    back silently to the default."""
    import difflib

    # a key that an interpolation reads is read: a config's own variable (`d: 256`, `model.d_model: ${d}`)
    text = OmegaConf.to_yaml(cfg, resolve=False)
    for section, known in CONFIG_KEYS.items():
        node = cfg if not section else cfg.get(section)
        if not isinstance(node, DictConfig):
            continue
        for key in map(str, node.keys()):
            full = f"{section}.{key}" if section else key
            if key in known or re.search(r"\$\{\s*" + re.escape(full) + r"\s*[.}\[]", text):
                continue
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {(f'{section}.' if section else '') + close[0]!r}?" if close else ""
            where = f"{section} holds only" if section else "the top level holds only"
            raise ConfigError(f"unknown config key {full!r} (set in a config file, or added with '+'): lit_dtrain "
                              f"does not read it, so it would be ignored{hint} ({where} {', '.join(sorted(known))})")


def check_types(cfg: DictConfig) -> None:
    """Numbers must be numbers and flags booleans: name the key and the value instead of failing later in a
    comparison, or reading 'off' as true."""
    for key in _BOOL_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r} ({type(value).__name__})")
    for key, kind in _NUMERIC_KEYS.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if not ok or isinstance(value, bool):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{key} must be {what}, got {value!r} ({type(value).__name__})")
        if key in _FINITE_KEYS and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")


def _flag_or_number(annotation) -> tuple[str, set] | None:
    """``("bool", allowed)`` for a parameter annotated ``bool`` (``allowed``: the other values it takes, such as
    None or a ``Literal`` like Lightning's ``deterministic="warn"``), ``("int", allowed)`` for ``int`` alone,
    ``("number", allowed)`` for ``float`` or ``int | float``; None for any other annotation."""
    import types
    import typing

    if annotation is bool:
        return "bool", set()
    if annotation is int:
        return "int", set()
    if annotation is float:
        return "number", set()
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(annotation)
    allowed = {None} if type(None) in args else set()
    rest = [a for a in args if a is not type(None)]
    literals = [a for a in rest if typing.get_origin(a) is typing.Literal]
    for literal in literals:
        allowed.update(typing.get_args(literal))
    plain = [a for a in rest if a not in literals]
    if plain == [bool]:
        return "bool", allowed
    if plain == [int] and not literals:
        return "int", allowed
    if plain and not literals and all(a in (int, float) for a in plain):
        return "number", allowed
    return None


def check_target_arguments(cfg: DictConfig, node=None, path: str = "") -> None:
    """Flags and numbers of every ``_target_`` node (data, callbacks, sampler, strategy and codecs, Trainer): a value
    whose parameter is annotated ``bool`` must be a boolean, one annotated ``int`` an integer, one annotated as a
    number a number; null only where the annotation allows None. Constructors read flags with ``bool(value)`` or
    ``if value:``, so ``error_feedback=no``, ``check_grad=off`` or ``stages=maybe`` (strings) counted as true,
    silently; a string where a number belongs failed in a comparison that named neither key nor value. They read
    integers with ``int(value)``: ``data.seed=1.5`` trained as seed 1 and ``data.seed=true`` as 1, silently, and
    ``data.seed=null`` failed in Hydra's wrapper naming only the node (``full_key: data``)."""
    from typing import get_type_hints

    from hydra.utils import get_object

    node = cfg if node is None else node
    if isinstance(node, ListConfig):
        for i in range(len(node)):
            child = node._get_node(i)
            if isinstance(child, (DictConfig, ListConfig)):
                check_target_arguments(cfg, child, f"{path}.{i}" if path else str(i))
        return
    if not isinstance(node, DictConfig):
        return
    hints: dict = {}
    if "_target_" in node:
        try:
            target = get_object(node._target_)
            hints = get_type_hints(target.__init__ if isinstance(target, type) else target)
        except Exception:  # an unimportable target or unresolvable hints: instantiate names it, or nothing to check
            hints = {}
    for key in node.keys():
        key = str(key)
        if key.startswith("_") or OmegaConf.is_missing(node, key):
            continue
        child, full = node._get_node(key), f"{path}.{key}" if path else key
        if isinstance(child, (DictConfig, ListConfig)):
            check_target_arguments(cfg, child, full)
            continue
        expected = _flag_or_number(hints.get(key))
        if expected is None:
            continue
        kind, allowed = expected
        value = node[key]
        if value is None and None in allowed or isinstance(value, str) and value in allowed:
            continue
        others = "".join(" or null" if v is None else f" or {v!r}" for v in sorted(allowed, key=str))
        if kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{full} must be true or false{others}, got {value!r} ({type(value).__name__})")
        number = isinstance(value, int if kind == "int" else (int, float)) and not isinstance(value, bool)
        if kind != "bool" and not number:
            what = "an integer" if kind == "int" else "a number"
            raise ConfigError(f"{full} must be {what}{others}, got {value!r} ({type(value).__name__})")


def wsd_callback_keys(cfg: DictConfig) -> list[str]:
    """The ``callbacks.<key>`` entries that are a ``WSDScheduler`` (the callback form of WSD)."""
    from lit_dtrain.schedules.workflows import WSD_CALLBACK_TARGETS

    return [key for key, node in (cfg.get("callbacks") or {}).items()
            if isinstance(node, DictConfig) and node.get("_target_") in WSD_CALLBACK_TARGETS]


def scheduler_config(cfg: DictConfig) -> DictConfig | None:
    """The ``scheduler`` node to build, or None.

    A node without ``_target_`` is what an experiment's ``scheduler:`` settings leave after ``'~scheduler'``
    (``experiment=cpt_replay`` sets a warmup and a decay fraction). The WSD callback reads them (each of its keys in
    conf/callbacks/wsd.yaml defaults to ``scheduler.<key>``), so with it there is no scheduler to build; a key it has
    no argument for, or the node without the callback, would be read by nothing, which is an error."""
    node = cfg.get("scheduler")
    if not node or "_target_" in node:
        return node or None
    if keys := wsd_callback_keys(cfg):
        arguments = {k for key in keys for k in cfg.callbacks[key].keys() if k != "_target_"}
        if unread := [k for k in node.keys() if k not in arguments]:
            raise ConfigError(f"scheduler.{unread[0]} is set, but there is no LR scheduler ('~scheduler'), and the "
                              f"WSD callback (callbacks.{keys[0]}) takes only {sorted(arguments)}; nothing reads "
                              f"{['scheduler.' + k for k in unread]}")
        return None
    raise ConfigError(f"scheduler has no _target_: it holds only {list(node.keys())} (an experiment's settings "
                      "after '~scheduler'?), which nothing reads; pick a schedule (scheduler=wsd, cosine, constant) "
                      "or use the callback form: '~scheduler' 'callbacks=[default,wsd]'")


def check_config(cfg: DictConfig) -> None:
    """Reject bad values before any compute, naming the offending key."""
    check_known_keys(cfg)
    check_types(cfg)
    lr = cfg.optimizer.get("lr")
    if "lr" in cfg.optimizer and not (lr is not None and lr > 0):
        raise ConfigError(f"optimizer.lr must be > 0, got {lr}")
    betas = cfg.optimizer.get("betas")
    if betas is not None:
        values = list(betas) if isinstance(betas, (list, tuple, ListConfig)) else None
        if not (values and len(values) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in values)):
            shown = values if values is not None else betas
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {shown!r}")
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps is None or max_steps <= 0:
        raise ConfigError(f"trainer.max_steps must be a positive step budget, got {max_steps}")
    for key in ("trainer.val_check_interval", "trainer.accumulate_grad_batches"):  # Lightning divides by them
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {value}")
    val_fraction = OmegaConf.select(cfg, "data.val_fraction", default=None)
    if val_fraction is not None and not 0 < val_fraction < 1:  # was refused only when the token cache was built
        raise ConfigError(f"data.val_fraction must be in (0, 1) (the share of documents held out), got {val_fraction}")
    matmul = cfg.get("matmul_precision", "high")
    if matmul not in ("highest", "high", "medium"):  # torch warns that the call has no effect, and goes on
        raise ConfigError(f"matmul_precision must be one of 'highest', 'high', 'medium', got {matmul!r}")
    seed = cfg.get("seed")
    if seed is None or not 0 <= seed <= 2**32 - 1:  # seed_everything's bounds, named here (null: int(None) failed)
        raise ConfigError(f"seed must be an integer in [0, {2**32 - 1}] (numpy's range), got {seed}")
    clip = cfg.trainer.get("gradient_clip_val")
    if clip is not None and not clip >= 0:  # Lightning skips clipping for < 0 without a word
        raise ConfigError(f"trainer.gradient_clip_val must be >= 0 (null or 0: no clipping), got {clip}")
    model_block = cfg.model.get("block_size")
    data_block = cfg.data.get("block_size")
    if model_block is not None and data_block is not None and data_block > model_block:
        raise ConfigError(f"data.block_size={data_block} exceeds model.block_size={model_block} (the model's maximum)")
    vocab = cfg.model.get("vocab_size")
    if vocab is not None and cfg.data.get("tokenizer") is None:  # LMDataModule's default: the byte tokenizer
        from lit_dtrain.data.tokenizer import ByteTokenizer

        if vocab < ByteTokenizer.vocab_size:  # an IndexError in the embedding at the first step otherwise
            raise ConfigError(f"model.vocab_size={vocab} is below the tokenizer's {ByteTokenizer.vocab_size} token "
                              "ids (byte tokenizer: 256 bytes + EOS); the embedding needs a row for each")
    scheduler = scheduler_config(cfg)
    warmup = scheduler.get("warmup_steps") if scheduler else None
    if "total_steps" not in (scheduler or {}) and isinstance(warmup, int) and warmup > max_steps:
        # cosine/wsd refuse warmup > total_steps themselves; a schedule without a horizon (constant) cannot
        raise ConfigError(f"scheduler.warmup_steps={warmup} exceeds trainer.max_steps={max_steps}: the LR would "
                          "never reach optimizer.lr")
    if scheduler:  # WSDScheduler refuses a second LR schedule, but only in on_train_start, inside fit
        for key in wsd_callback_keys(cfg):
            raise ConfigError(f"callbacks.{key} sets the LR itself, and scheduler={scheduler._target_} "
                              "configures an LR scheduler too; use one of them: '~scheduler' "
                              f"'callbacks=[default,{key}]' for the callback form")
    try:  # the optimizer is built in configure_optimizers, inside fit: build it on a dummy parameter now
        instantiate(cfg.optimizer)([torch.zeros(1, requires_grad=True)])
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer: {e}") from e
    if scheduler:  # build the schedule on a dummy optimizer so bad arguments fail now
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        try:
            instantiate(scheduler)(dummy)
        except ValueError as e:
            raise ConfigError(f"scheduler: {e}") from e
    check_validation_limit(cfg)
    check_sample(cfg)
    # names the run dir and TensorBoard's event file, which TensorBoard encodes as UTF-8 (in Lightning's setup)
    check_utf8_text("run_name", str(cfg.get("run_name", "")))
    check_monitors(cfg)
    check_lightning_choices(cfg)
    check_target_arguments(cfg)
    if cfg.get("resume") not in (None, "auto"):
        raise ConfigError(f"resume must be null or 'auto', got {cfg.resume!r}; use ckpt_path=PATH for a file")
    if cfg.get("resume") == "auto" and cfg.get("ckpt_path"):
        raise ConfigError("set either resume=auto or ckpt_path=PATH, not both")


def warn_if_the_schedule_ends_early(cfg: DictConfig, start_step: int = 0) -> None:
    """Warn when ``scheduler.total_steps`` (the horizon of ``scheduler=cosine`` or ``wsd``) is below
    ``trainer.max_steps``: the steps past it run at the schedule's last factor (``min_lr_factor`` of the peak, 0
    for WSD), which trained nothing or little without a word. A warning, not an error: a horizon above
    ``max_steps`` is how a stable run to branch from is planned (docs/wsd.md), and one below may be meant.
    ``WSDScheduler`` (the callback form) warns the same at train start."""
    scheduler = scheduler_config(cfg)
    total = scheduler.get("total_steps") if scheduler else None
    max_steps = cfg.trainer.get("max_steps")
    if not (isinstance(total, int) and isinstance(max_steps, int)) or total >= max_steps:
        return
    past = max_steps - max(total, start_step)  # steps of this run past the horizon
    if past <= 0 or rank_zero_only.rank != 0:
        return
    floor = scheduler.get("min_lr_factor")
    at = f"min_lr_factor={floor} of the peak LR" if floor is not None else "the schedule's last LR"
    name = str(scheduler.get("_target_", "")).rsplit(".", 1)[-1]
    log.warning(
        "scheduler.total_steps=%d is below trainer.max_steps=%d: the %s ends at step %d and the last %d steps run "
        "at %s. Set scheduler.total_steps=%d (or leave it at its default, ${trainer.max_steps}), or "
        "trainer.max_steps=%d",
        total, max_steps, name or "schedule", total - 1, past, at, max_steps, total,
    )


def warn_about_torchrun_restarts(cfg: DictConfig, env=os.environ) -> None:
    """Under ``torchrun --max-restarts N`` (N > 0), at the first start: warn when a restart cannot continue the run.
    A restarted worker runs the same command: without ``resume=auto`` it is a fresh start in a run dir that holds
    checkpoints, which is refused (and each refusal uses up a restart). On gloo (CPU) with the agent's shared
    store, a restarted rank hung in the process group's setup or failed to connect in 3 of 4 tries here
    (pytorch#135712); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment avoids it (3 of 3)."""
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if restarts <= 0 or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or rank_zero_only.rank != 0:
        return
    if cfg.get("resume") != "auto":
        log.warning("torchrun --max-restarts=%d: a restarted worker continues this run only with resume=auto; "
                    "without it the restart is a fresh start in a run dir that holds checkpoints, which is refused",
                    restarts)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    gloo = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if gloo and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        log.warning("torchrun --max-restarts=%d on gloo with torchrun's shared store: a restarted rank can hang in "
                    "the process group's setup or fail to connect (pytorch#135712); set "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment", restarts)


def check_validation_limit(cfg: DictConfig) -> None:
    """``trainer.limit_val_batches``: 0 is Lightning's switch for no validation, which a lit_dtrain run cannot do
    without. The default ``ModelCheckpoint`` saves after each validation, so such a run wrote no checkpoint before its
    end, and its result (``val_loss``: summary.json, the value a sweep optimizes) was NaN, without a word. Values
    Lightning refuses (``-1``, ``1.5``) failed in Hydra's wrapper of the Trainer, ``abc`` as a TypeError."""
    value = cfg.trainer.get("limit_val_batches")
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or value < 0 or (isinstance(value, float) and value > 1):
        raise ConfigError(
            f"trainer.limit_val_batches must be null (all), a number of batches >= 1 or a fraction in (0, 1], "
            f"got {value!r}"
        )
    if value == 0:
        raise ConfigError(
            f"trainer.limit_val_batches={value} switches validation off, which a lit_dtrain run needs: checkpoints "
            "are saved after each validation (callbacks.model_checkpoint ranks them by val/loss), so none would be "
            "written before the end, and the run's val_loss (summary.json, a sweep's objective) would be NaN. To "
            "validate less, lower data.max_val_windows (windows per source) or set trainer.limit_val_batches=<N >= 1 "
            "batches>; to validate only once, after the last step, set trainer.val_check_interval >= "
            "trainer.max_steps"
        )


def check_sample(cfg: DictConfig) -> None:
    """``sample.*`` is used only after training: a bad value must fail now, not after the last step (it used to
    raise from inside ``generate`` before ``summary.json`` was written)."""
    node = cfg.get("sample") or {}

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    n = node.get("max_new_tokens", 0)
    if n is not None and not (is_int(n) and n >= 0):
        raise ConfigError(f"sample.max_new_tokens must be an integer >= 0 (0: no sample), got {n!r}")
    t = node.get("temperature", 0.8)
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0):
        raise ConfigError(f"sample.temperature must be a number >= 0 (0: greedy), got {t!r}")
    k = node.get("top_k", None)
    if k is not None and not (is_int(k) and k >= 0):
        raise ConfigError(f"sample.top_k must be null or an integer >= 0 (0: all tokens), got {k!r}")
    prompt = node.get("prompt", "def ")
    if prompt is None or isinstance(prompt, bool) or not isinstance(prompt, (str, int, float)):
        raise ConfigError(f"sample.prompt must be text (a string; '' starts at a document start), got {prompt!r}")
    check_utf8_text("sample.prompt", str(prompt))  # the tokenizer encodes UTF-8


def check_utf8_text(key: str, text: str) -> None:
    """:class:`ConfigError` naming ``key`` when ``text`` holds a lone surrogate, which UTF-8 cannot encode: what
    Python makes of a command-line byte that is not UTF-8 (``$'\\xff'`` is ``'\\udcff'``)."""
    bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        c = text[bad]
        byte = f" (byte 0x{ord(c) - 0xDC00:02x} of a command line that is not UTF-8)" if c >= "\udc80" else ""
        raise ConfigError(f"{key}={text!r} is not valid text: character {bad} is a lone surrogate{byte}; write it "
                          "in UTF-8")


def check_monitors(cfg: DictConfig) -> None:
    """A callback's ``monitor`` (ModelCheckpoint, EarlyStopping) naming a ``val``/``train`` metric that ``LitLLM``
    does not log, or a name without a ``/`` (``val_loss``): Lightning finds out only at the first validation, after
    ``trainer.val_check_interval`` steps of training, and stops without a checkpoint. Metrics of other families
    (logged by callbacks or strategies) are left to Lightning."""
    sources = cfg.data.get("sources")  # a malformed list (data.sources=[foo]) is LMDataModule's to name
    names = [str(s.get("name")) for s in sources if isinstance(s, DictConfig)] if OmegaConf.is_list(sources) else []
    known = ["train/loss", "train/grad_norm", "val/loss", "val/ppl"]
    known += [f"val/{n}/loss" for n in names] if len(names) > 1 else []
    for key, node in (cfg.get("callbacks") or {}).items():
        monitor = node.get("monitor") if isinstance(node, DictConfig) else None
        if not isinstance(monitor, str) or monitor in known:
            continue
        if "/" not in monitor or monitor.split("/")[0] in ("val", "train"):
            raise ConfigError(f"callbacks.{key}.monitor={monitor!r} is not a metric lit_dtrain logs; use one of "
                              f"{', '.join(map(repr, known))}")


def _precisions() -> tuple:
    """The ``precision`` values Lightning's Trainer accepts (its own list), or () where it cannot be read."""
    from typing import get_args

    try:
        from lightning.fabric.connector import _PRECISION_INPUT
    except ImportError:  # a Lightning without it: its Trainer names a bad value itself
        return ()
    return tuple(v for literal in get_args(_PRECISION_INPUT) for v in get_args(literal))


def check_lightning_choices(cfg: DictConfig) -> None:
    """Values that Lightning refuses when it builds the Trainer or a callback, where Hydra's wrapper names the node
    (``full_key: trainer``) but not the key: name the key and the values allowed."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    precision, precisions = cfg.trainer.get("precision"), _precisions()
    if precision is not None and precisions and precision not in precisions:
        raise ConfigError(
            f"trainer.precision={precision!r} is not one of Lightning's precisions: {', '.join(map(repr, precisions))}"
        )
    algorithm, algorithms = cfg.trainer.get("gradient_clip_algorithm"), [a.value for a in GradClipAlgorithmType]
    if algorithm is not None and str(algorithm).lower() not in algorithms:  # Lightning lower-cases it
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={algorithm!r} must be one of "
            f"{', '.join(map(repr, algorithms))} (or null: 'norm')"
        )
    devices = cfg.trainer.get("devices")
    ids = list(devices) if isinstance(devices, ListConfig) else None
    valid = (
        devices is None
        or devices == "auto"
        or (isinstance(devices, str) and re.fullmatch(r"[\d, ]+", devices))
        or (isinstance(devices, int) and not isinstance(devices, bool) and (devices >= 1 or devices == -1))
        or (ids is not None and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids))
    )
    if not valid:
        shown = ids if ids is not None else devices
        raise ConfigError(
            f"trainer.devices={shown!r} must be a number of devices >= 1, -1 (all), 'auto' or a list of "
            "device ids ([0, 1] or '0,1')"
        )
    for key, node in (cfg.get("callbacks") or {}).items():
        if not isinstance(node, DictConfig) or "mode" not in node or "_target_" not in node:
            continue
        try:
            cls = get_class(node._target_)
        except Exception:  # an unimportable target: build_callbacks names it
            continue
        if (
            isinstance(cls, type)
            and issubclass(cls, (ModelCheckpoint, EarlyStopping))
            and node.mode not in ("min", "max")
        ):
            raise ConfigError(
                f"callbacks.{key}.mode={node.mode!r} must be 'min' or 'max' (whether a lower or a "
                f"higher {node.get('monitor') or 'monitored value'} is better)"
            )


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
    """The readable ``*.ckpt`` of ``ckpt_dir`` with the highest ``global_step``, or None."""
    steps = {}
    for p in sorted(ckpt_dir.glob("*.ckpt")):
        try:
            steps[p] = checkpoint_global_step(p)
        except CheckpointError as e:
            log.warning("resume=auto: skipping %s", e)
    return max(steps, key=steps.get) if steps else None


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """The checkpoint to resume from: ``ckpt_path``, or ``last.ckpt`` of this run dir when ``resume=auto``."""
    if cfg.get("ckpt_path"):
        path = Path(str(cfg.ckpt_path)).expanduser()
        if not path.is_file():
            raise ConfigError(f"ckpt_path={str(cfg.ckpt_path)!r} {not_a_file_reason(path)}")
        return str(path)
    ckpt_dir = Path(cfg.paths.checkpoint_dir)
    if cfg.get("resume") == "auto" and (ckpt_dir / "last.ckpt").is_file():
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
        OmegaConf.save(HydraConfig.get().overrides.task, out_dir / "overrides.yaml")


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
    trainer: L.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=logger, strategy=build_strategy(cfg), plugins=[AtomicCheckpointIO()],
        **val_check_in_batches(cfg),
    )
    out_dir = Path(cfg.paths.output_dir)
    if trainer.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
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
    tmp = out_dir / ".summary.json.tmp"
    safe = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    tmp.write_text(json.dumps(safe, indent=2, allow_nan=False))  # strict JSON: NaN/inf become null
    os.replace(tmp, out_dir / "summary.json")
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
