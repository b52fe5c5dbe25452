"""Checks of a composed config before any compute, each naming the offending key: types and values
(:func:`check_config`), every ``_target_`` node's arguments against its class, unknown keys, and warnings for
settings that would waste a run (a schedule that ends early, torchrun restarts that cannot continue it).
``lit_dtrain.train`` runs them.

The value checks and the warnings are here; :func:`check_config` also runs the key and type checks of
``lit_dtrain.config_keys`` and the checks of Lightning's choices in ``lit_dtrain.config_lightning``."""

from __future__ import annotations

import logging
import os

import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain._compose_errors import callback_options, choose_callback_first
from lit_dtrain._config_values import as_integer, check_datamodule_arguments
from lit_dtrain.config_keys import (
    check_known_keys,
    check_target_arguments,
    check_types,
)
from lit_dtrain.config_lightning import (
    check_lightning_choices,
    check_val_check_interval,
)
from lit_dtrain.config_warnings import (
    warn_if_a_checkpoint_name_shows_another_metric,
    warn_if_the_default_callbacks_are_dropped,
    warn_if_the_stages_outlast_the_run,
)
from lit_dtrain.data._fit_end import min_epochs_problem
from lit_dtrain.errors import ConfigError
from lit_dtrain.models.llama import check_sampling
from lit_dtrain.schedules.lr import resolve_decay_steps, rounded_decay_told, schedule_factor
from lit_dtrain.utils.args import is_number, is_whole_float
from lit_dtrain.utils.words import counted, plural

log = logging.getLogger(__name__)


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
    check_callback_nodes(cfg)
    lr = cfg.optimizer.get("lr")
    if "lr" in cfg.optimizer and not (lr is not None and lr > 0):
        raise ConfigError(f"optimizer.lr must be > 0, got {lr}")
    if is_number(eps := cfg.optimizer.get("eps")) and not eps > 0:  # torch takes 0 (and refused -1 in its words)
        raise ConfigError(f"optimizer.eps must be > 0, got {eps}: Adam divides each update by sqrt(v) + eps, so an "
                          "element whose gradient is 0 (an untied embedding's row of a byte not in the batch) got 0/0 "
                          "= NaN at the first step")
    betas = cfg.optimizer.get("betas")
    if "betas" in cfg.optimizer:  # null: "optimizer: 'NoneType' object is not iterable"
        values = list(betas) if isinstance(betas, (list, tuple, ListConfig)) else None
        if not (values and len(values) == 2 and all(
                is_number(b) and 0 <= b < 1 for b in values)):
            shown = values if values is not None else betas
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {shown!r}")
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps is None or max_steps <= 0:
        raise ConfigError(f"trainer.max_steps must be a positive step budget, got {max_steps}")
    if is_number(min_steps := cfg.trainer.get("min_steps")) and min_steps > max_steps:  # Lightning stops at max_steps
        raise ConfigError(f"trainer.min_steps={min_steps} exceeds trainer.max_steps={max_steps}: the run stops at "
                          "max_steps; lower trainer.min_steps or raise trainer.max_steps")
    check_val_check_interval(cfg)
    for key in ("trainer.val_check_interval", "trainer.accumulate_grad_batches"):  # Lightning divides by them
        value = OmegaConf.select(cfg, key, default=None)
        if is_number(value) and value <= 0:
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
    every = cfg.trainer.get("log_every_n_steps")
    if is_number(every) and every < 0:  # Lightning logs where step % every == 0: -1 logged every step, -3 every 3rd
        raise ConfigError("trainer.log_every_n_steps must be >= 0 (N: training rows every N optimizer steps; "
                          f"0: none), got {every}")
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
    # is_number: scheduler.warmup_steps=5.0 (converted with the schedule's arguments, below) trained without a word
    if "total_steps" not in (scheduler or {}) and is_number(warmup) and warmup > max_steps:
        # cosine/wsd refuse warmup > total_steps themselves; a schedule without a horizon (constant) cannot
        raise ConfigError(f"scheduler.warmup_steps={warmup} exceeds trainer.max_steps={max_steps}: the LR would "
                          "never reach optimizer.lr")
    if scheduler:  # WSDScheduler refuses a second LR schedule, but only in on_train_start, inside fit
        for key in wsd_callback_keys(cfg):
            # the conf/callbacks option where it is one ('+callbacks.my_wsd._target_=...' is none to choose)
            form = f"'callbacks=[default,{key}]'" if key in (callback_options() or ()) else f"beside callbacks.{key}"
            raise ConfigError(f"callbacks.{key} sets the LR itself, and scheduler={scheduler._target_} "
                              f"configures an LR scheduler too; use one of them: '~scheduler' {form} for the "
                              "callback form")
    # its keys first, as every _target_ node's below: '++optimizer.lrr=1e-3' ended in the build's "adamw() got an
    # unexpected keyword argument 'lrr'", naming neither the config key nor 'optimizer.lr'
    check_target_arguments(cfg, cfg.optimizer, "optimizer")
    try:  # the optimizer is built in configure_optimizers, inside fit: build it on a dummy parameter now
        instantiate(cfg.optimizer)([torch.zeros(1, requires_grad=True)])
    except (ValueError, TypeError, ImportError) as e:  # (ImportError: optimizer=adamw8bit without bitsandbytes)
        raise ConfigError(f"optimizer: {e}") from e
    from lit_dtrain.schedules.lr import no_schedule_warnings
    from lit_dtrain.schedules.workflows import check_one_decay_length, unknown_argument_error

    check_one_decay_length(cfg)  # names the config keys, where the schedule's error names its arguments
    if scheduler:  # build the schedule on a dummy optimizer so bad arguments fail now
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        try:
            with no_schedule_warnings():  # the run's own build warns
                instantiate(scheduler)(dummy)
        except ValueError as e:
            raise ConfigError(f"scheduler: {e}") from e
        except TypeError as e:  # experiment=cpt_replay scheduler=cosine: the experiment's decay_fraction (a traceback)
            raise ConfigError(unknown_argument_error("scheduler", scheduler, e)) from None
    check_validation_limit(cfg)
    check_sample(cfg)
    check_group_nodes(cfg)
    # names the run dir and TensorBoard's event file, which TensorBoard encodes as UTF-8 (in Lightning's setup)
    check_utf8_text("run_name", str(cfg.get("run_name", "")))
    check_monitors(cfg)
    check_checkpoint_dirs(cfg)
    warn_if_the_default_callbacks_are_dropped(cfg)
    warn_if_the_stages_outlast_the_run(cfg)
    warn_if_a_checkpoint_name_shows_another_metric(cfg)
    check_lightning_choices(cfg)
    from lit_dtrain.strategies.registry import check_strategy_specs

    check_strategy_specs(cfg)  # a codec given by name or mapping (no _target_ for the next check)
    check_target_arguments(cfg)
    check_model_shape(cfg)
    check_datamodule_arguments(cfg)  # first: a sampler's own minimum (FourierSampler's 2) names its reason
    for key in ("model.block_size", "data.block_size"):  # the model's first: data's is ${model.block_size}
        if is_number(window := OmegaConf.select(cfg, key)) and window < 2:  # it trained (a bigram model) and exited 0
            raise ConfigError(f"{key}={window}: a window of 1 token trains the model without context; give >= 2")
    check_min_epochs(cfg)
    if cfg.get("resume") not in (None, "auto"):
        raise ConfigError(f"resume must be null or 'auto', got {cfg.resume!r}; use ckpt_path=PATH for a file")


def check_callback_nodes(cfg: DictConfig) -> None:
    """Every ``callbacks.<name>`` node has a ``_target_`` (a null one switches it off): ``+callbacks.loss_spike.z=3``
    without choosing loss_spike adds a node holding z alone. Refused with the config checks: it was refused as the
    callbacks were built, after the seed ('Seed set to 1337' printed first), the datamodule and the model."""
    for name, node in (cfg.get("callbacks") or {}).items():
        if isinstance(node, DictConfig) and "_target_" not in node:
            held = f" (it holds only {', '.join(map(str, node.keys()))})" if len(node) else ""
            raise ConfigError(f"callbacks.{name} has no _target_{held}; {choose_callback_first(name)}")


def check_model_shape(cfg: DictConfig) -> None:
    """``model.*`` values that ``build_llama``'s ``LlamaConfig`` refuses (``model.n_layer=0``, ``model.n_head=3``
    beside ``d_model=128``), before any compute: they were refused as the model was built, after the seed and the
    datamodule. The same line as there; a model of one's own is checked as it is built."""
    node = cfg.get("model")
    if not isinstance(node, DictConfig) or node.get("_target_") != "lit_dtrain.models.build_llama":
        return
    from lit_dtrain.models.llama import LlamaConfig

    shape = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not str(k).startswith("_")}
    try:
        LlamaConfig.from_dict(shape)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None


def check_min_epochs(cfg: DictConfig) -> None:
    """:func:`~lit_dtrain.data._fit_end.min_epochs_problem` for the config, once whole floats are ints (the Trainer's
    integer arguments are made so by ``check_target_arguments``: ``min_epochs=2.0`` above ``max_epochs=1`` passed),
    and a whole float above 1 is a number of batches, as Lightning reads it (``limit_train_batches=2.0`` was taken
    for the endless stream: 'min_epochs=1 can never be met')."""
    finite = next((int(v) for k in ("overfit_batches", "limit_train_batches")  # 1.0: Lightning's "all", endless
                   if (is_number(v := cfg.trainer.get(k), integer=True) and v >= 1) or (is_whole_float(v) and v > 1)),
                  None)
    if problem := min_epochs_problem(cfg.trainer.get("min_epochs"), cfg.trainer.get("max_epochs"),
                                     cfg.trainer.get("max_steps", -1), finite,
                                     cfg.trainer.get("accumulate_grad_batches") or 1, prefix="trainer."):
        raise ConfigError(problem)


def check_checkpoint_dirs(cfg: DictConfig) -> None:
    """``callbacks.model_checkpoint.dirpath`` or ``callbacks.preemption.dirpath`` away from ``paths.checkpoint_dir``:
    the end of the run saves ``last.ckpt`` and ``resume=auto`` looks for checkpoints in ``paths.checkpoint_dir`` alone.
    A run killed at step 9 with its step-6 checkpoint in the callback's dir resumed from nothing: it trained from
    step 0 again, exited 0, and overwrote that dir's ``last.ckpt``. A checkpoint callback of another name may save
    elsewhere (extra copies)."""
    own = os.path.abspath(os.path.expanduser(str(cfg.paths.checkpoint_dir)))
    for key in ("model_checkpoint", "preemption"):
        node = (cfg.get("callbacks") or {}).get(key)
        dirpath = node.get("dirpath") if isinstance(node, DictConfig) else None
        if isinstance(node, DictConfig) and dirpath is None and str(node.get("_target_")).endswith("ModelCheckpoint"):
            given = "paths.checkpoint_dir" if cfg.paths.get("checkpoint_dir") is None else f"callbacks.{key}.dirpath"
            raise ConfigError(f"{given}=null saves in Lightning's default dir (the logger's <dir>/checkpoints), not "
                              f"{own!r}, where resume=auto looks: leave it at its default, ${{paths.checkpoint_dir}}")
        if dirpath is not None and os.path.abspath(os.path.expanduser(str(dirpath))) != own:
            raise ConfigError(
                f"callbacks.{key}.dirpath={str(dirpath)!r} is not paths.checkpoint_dir={own!r}, where the run saves "
                f"its final last.ckpt and resume=auto looks for checkpoints: set paths.checkpoint_dir={str(dirpath)!r} "
                "instead (the checkpoint callbacks follow it)"
            )


def check_group_nodes(cfg: DictConfig) -> None:
    """A nested config group set with a dot: ``data.sampler=fourier`` (or ``-m data.sampler=random,fourier``) sets
    the key to the string 'fourier', where ``data/sampler=fourier`` picks conf/data/sampler/fourier.yaml; the
    datamodule then failed with "AttributeError: 'str' object has no attribute 'min_block_size'"."""
    value = OmegaConf.select(cfg, "data.sampler", default=None)
    if isinstance(value, str):
        raise ConfigError(f"data.sampler={value!r} sets the key to a string, not a sampler config: pick a sampler with "
                          f"the config group data/sampler={value} (a '/', as in conf/data/sampler/; a sweep: "
                          "data/sampler=random,fourier)")


def warn_if_the_schedule_ends_early(cfg: DictConfig, start_step: int = 0) -> None:
    """Warn when ``scheduler.total_steps`` (the horizon of ``scheduler=cosine`` or ``wsd``) is below
    ``trainer.max_steps``: the steps past it run at the schedule's last factor (``min_lr_factor`` of the peak, 0
    for WSD), which trained nothing or little without a word. A warning, not an error: a horizon above
    ``max_steps`` is how a stable run to branch from is planned (docs/wsd.md), and one below may be meant.
    ``WSDScheduler`` (the callback form) warns the same at train start."""
    scheduler = scheduler_config(cfg)
    total = scheduler.get("total_steps") if scheduler else None
    max_steps = cfg.trainer.get("max_steps")
    rounded_decay_told(None)
    if not (isinstance(total, int) and isinstance(max_steps, int)) or total == max_steps:
        return
    if total > max_steps:  # on purpose (a stable run to branch from, one job of a longer run), but say where it ends
        factor = schedule_factor(scheduler, max_steps - 1) if max_steps > 0 else None
        if factor is not None and rank_zero_only.rank == 0:
            log.info(
                "scheduler.total_steps=%d is above trainer.max_steps=%d: this run stops at step %d with the LR at "
                "%.4g of the peak, before its schedule ends (at step %d)",
                total, max_steps, max_steps - 1, factor, total - 1,
            )
        return
    past = max_steps - max(total, start_step)  # steps of this run past the horizon
    if past <= 0 or rank_zero_only.rank != 0:
        return
    floor = scheduler.get("min_lr_factor")
    at = f"min_lr_factor={floor} of the peak LR" if floor is not None else "the schedule's last LR"
    name = str(scheduler.get("_target_", "")).rsplit(".", 1)[-1]
    ends, fix = f"ends at step {total - 1}", ""
    if fraction := _rounded_to_no_decay(scheduler, total):  # one warning, not a second one of the schedule's own
        rounded_decay_told(total, fraction)
        ends = (f"ends at step {total - 1} with no decay (decay_fraction={fraction} of {total} steps rounds to 0 "
                f"decay steps), so its LR falls from the peak straight to {at.removesuffix(' LR')}")
        fix = " with scheduler.decay_steps=1 or more for a decay"
    log.warning(
        "scheduler.total_steps=%d is below trainer.max_steps=%d: the %s %s and the last %s %s at %s. "
        "Set scheduler.total_steps=%d (or leave it at its default, ${trainer.max_steps}), or trainer.max_steps=%d%s",
        total, max_steps, name or "schedule", ends, counted(past, "step"), plural(past, "runs", "run"),
        "it" if fix else at, max_steps, total, fix,
    )


def _rounded_to_no_decay(scheduler: DictConfig, total: int) -> float | None:
    """The scheduler's ``decay_fraction`` where it rounds to 0 decay steps of ``total`` (else None)."""
    fraction = scheduler.get("decay_fraction")
    if not fraction or scheduler.get("decay_steps") is not None:
        return None
    try:
        return fraction if resolve_decay_steps(total, None, fraction) == 0 else None
    except ValueError:  # a bad value: the schedule's build names it
        return None


def check_validation_limit(cfg: DictConfig) -> None:
    """``trainer.limit_val_batches``: 0 is Lightning's switch for no validation, which a lit_dtrain run cannot do
    without. The default ``ModelCheckpoint`` saves after each validation, so such a run wrote no checkpoint before its
    end, and its result (``val_loss``: summary.json, the value a sweep optimizes) was NaN, without a word. Values
    Lightning refuses (``-1``, ``1.5``) failed in Hydra's wrapper of the Trainer, ``abc`` as a TypeError. A whole float
    above 1 (``2.0``) is that many batches, as Lightning takes it (it was refused as not 'a number of batches >= 1')."""
    value = cfg.trainer.get("limit_val_batches")
    if value is None:
        return
    if is_whole_float(value) and value > 1:  # 2.0: two batches (1.0 stays Lightning's fraction, all of them)
        cfg.trainer.limit_val_batches = value = as_integer("trainer.limit_val_batches", value)
    number = is_number(value)
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
    n = node.get("max_new_tokens", 0)
    names = {key: f"sample.{key}" for key in ("max_new_tokens", "temperature", "top_k", "top_p")}
    try:  # generate's own check: sample.temperature=inf passed here and was refused by scripts/generate.py
        check_sampling(0 if n is None else n, node.get("temperature", 0.8), node.get("top_k", None), names,
                       top_p=node.get("top_p", None))
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    (logged by callbacks or strategies) are left to Lightning. A ``monitor`` or ``filename`` that is not text
    (``monitor=0``, ``filename=-1``) failed there too, and a falsy one (``filename=0``) named files by Lightning's
    default, silently."""
    sources = cfg.data.get("sources")  # a malformed list (data.sources=[foo]) is LMDataModule's to name
    names = [str(s.get("name")) for s in sources if isinstance(s, DictConfig)] if OmegaConf.is_list(sources) else []
    known = ["train/loss", "train/grad_norm", "val/loss", "val/ppl"]
    known += [f"val/{n}/loss" for n in names] if len(names) > 1 else []
    for key, node in (cfg.get("callbacks") or {}).items():
        monitor = node.get("monitor") if isinstance(node, DictConfig) else None
        for name in ("monitor", "filename"):  # monitor=0, filename=-1: Lightning's error at the first save, after
            value = node.get(name) if isinstance(node, DictConfig) else None  # training (a TypeError for filename)
            if value is not None and not isinstance(value, str):
                value = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
                raise ConfigError(f"callbacks.{key}.{name} must be text or null, got {value!r} "
                                  f"({type(value).__name__})")
            if value == "":  # falsy: Lightning's null (filename '' wrote '0-2.ckpt'), which reads as a mistake
                raise ConfigError(f"callbacks.{key}.{name} is empty (''): give one, or null for Lightning's default "
                                  f"({'no metric: the latest is kept' if name == 'monitor' else '{epoch}-{step}'})")
        if not isinstance(monitor, str) or monitor in known:
            continue
        if "/" not in monitor or monitor.split("/")[0] in ("val", "train"):
            raise ConfigError(f"callbacks.{key}.monitor={monitor!r} is not a metric lit_dtrain logs; use one of "
                              f"{', '.join(map(repr, known))}")


