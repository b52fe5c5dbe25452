"""Values that Lightning refuses, or silently replaces, when it builds the Trainer or a callback, checked before any
compute and named by their key: :func:`check_lightning_choices` (precision, gradient clip algorithm, devices, a
callback's ``mode``) and :func:`check_precision` (a precision that cannot run as configured).
``lit_dtrain.config_checks.check_config`` runs them; they are importable from there too.
"""

from __future__ import annotations

import datetime
import importlib.util
import re

import torch
from hydra._internal.utils import _locate  # hydra.utils.get_class logs an ERROR for a target that is no class
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain._base_60 import base_60_source
from lit_dtrain._config_values import as_integer
from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.args import is_number, is_whole_float


def _precisions() -> tuple:
    """The ``precision`` values Lightning's Trainer accepts (its own list), or () where it cannot be read."""
    from typing import get_args

    try:
        from lightning.fabric.connector import _PRECISION_INPUT
    except ImportError:  # a Lightning without it: its Trainer names a bad value itself
        return ()
    return tuple(v for literal in get_args(_PRECISION_INPUT) for v in get_args(literal))


FP16_TINY = 2.0**-14  # fp16's smallest normal number


def _on_cpu(cfg: DictConfig) -> bool:
    """Whether Lightning picks its CPU accelerator: ``cpu``, or ``auto`` with neither CUDA nor MPS."""
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    return accelerator == "cpu" or (
        accelerator == "auto" and not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )


def check_precision(cfg: DictConfig) -> None:
    """``16-mixed`` (also ``16``) on a CPU: Lightning trains in ``bf16-mixed`` instead, with a warning among the
    start-up lines (fp16 autocast has no CPU GradScaler there); the run's config and summary still said 16-mixed.
    ``transformer-engine`` without its package: a ``ModuleNotFoundError`` from inside the Trainer's construction.
    ``16-true`` with an Adam ``eps`` below fp16's smallest normal number: the second moments are fp16 too, a squared
    gradient below 6e-8 is 0 there (87 % of them at the first step of the nano model), and the update of such an
    entry is ``g / eps``: the weights grew from |w| <= 1 to 105 in one step and the loss was NaN at step 3.
    ``64-true`` with ``optimizer=adamw8bit``: :data:`lit_dtrain.optim.ADAMW8BIT_FP64`. ``strategy=fsdp`` with
    ``optimizer=adamw8bit``: FSDP gathers each state tensor as shaped like its parameter, and bitsandbytes' block
    scales are not, so the run trained up to its first checkpoint and failed there with torch's 'The size of tensor a
    (32) must match the size of tensor b (96)' (a toy model on 2 gloo ranks; bitsandbytes#89)."""
    from lit_dtrain.optim import ADAMW8BIT_FP64

    precision = str(cfg.trainer.get("precision"))
    optimizer = cfg.get("optimizer") or {}
    eps = optimizer.get("eps")
    if precision in ("64", "64-true") and optimizer.get("_target_") == "lit_dtrain.optim.adamw8bit":
        raise ConfigError(f"trainer.precision={precision} cannot be combined with optimizer=adamw8bit: "
                          f"{ADAMW8BIT_FP64}")
    strategy = cfg.get("strategy")
    if (optimizer.get("_target_") == "lit_dtrain.optim.adamw8bit" and isinstance(strategy, DictConfig)
            and strategy.get("_target_") == "lit_dtrain.strategies.make_fsdp"):
        raise ConfigError("strategy=fsdp cannot be combined with optimizer=adamw8bit: FSDP cannot save bitsandbytes' "
                          "8-bit optimizer state (its block scales are not shaped like the parameters), so the run "
                          "would fail at its first checkpoint. Use optimizer=adamw, or strategy=ddp")
    if precision == "16-true" and isinstance(eps, (int, float)) and eps < FP16_TINY:
        raise ConfigError(
            f"trainer.precision=16-true keeps the optimizer's second moments in fp16, where optimizer.eps={eps} "
            f"is below the smallest normal number ({FP16_TINY:.3g}): an update is then gradient / eps, and the weights "
            "blow up in the first steps. Use bf16-true or bf16-mixed (16-mixed on a GPU), or set "
            "optimizer.eps=1e-4 or more"
        )
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if precision in ("16-mixed", "16") and _on_cpu(cfg):
        raise ConfigError(
            f"trainer.precision={precision} (fp16 autocast with loss scaling) does not run on CPU "
            f"(trainer.accelerator={accelerator}): Lightning would train in bf16-mixed instead. Set "
            "trainer.precision=bf16-mixed, or train on a GPU (trainer=gpu)"
        )
    if precision.startswith("transformer-engine") and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            f"trainer.precision={precision} needs NVIDIA's transformer_engine package, which is not installed "
            "(and a GPU); use bf16-mixed or 16-mixed"
        )


_TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def _base_60_hint(value) -> str:
    """For an integer of at least an hour's seconds given as ``trainer.max_time``: YAML 1.1 reads an unquoted
    ``1:00:00:00`` (or ``12:00:00``) in a config file as a base-60 integer (216000), and the refusal named only that
    number, which the user never wrote."""
    if not is_number(value, integer=True) or value < 3600:
        return ""
    n = int(value)
    fields = [n // 216000, n // 3600 % 60, n // 60 % 60, n % 60] if n >= 216000 else [n // 3600, n // 60 % 60, n % 60]
    written = ":".join([str(fields[0])] + [f"{f:02d}" for f in fields[1:]])
    quoted = written if len(fields) == 4 else f"00:{fields[0]:02d}:{fields[1]:02d}:{fields[2]:02d}"
    return (f"; written unquoted in a YAML file, {written} is YAML's base-60 number {n}: quote it, max_time: "
            f"'{quoted}' (or, for {n} seconds, {{seconds: {n}}})")


def check_accelerator(accelerator) -> None:
    """``trainer.accelerator`` named as Lightning's registry has it (``gpuu``, ``CPU``: Lightning's ValueError in
    Hydra's wrapper, after the seed) and available here (``tpu`` without torch_xla: its ModuleNotFoundError; ``mps``
    off a Mac: its MisconfigurationException). An accelerator given as an object (a ``_target_`` node) is Lightning's
    to check."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    if not isinstance(accelerator, str) or accelerator in ("auto", "gpu"):  # gpu: checked above (CUDA or MPS)
        return
    names = sorted(AcceleratorRegistry.available_accelerators())
    if accelerator not in names:
        raise ConfigError(f"trainer.accelerator={accelerator!r} is not one of Lightning's accelerators: "
                          f"{', '.join(['auto', 'gpu', *names])}")
    if not AcceleratorRegistry[accelerator]["accelerator"].is_available():
        here = [name for name in names if AcceleratorRegistry[name]["accelerator"].is_available()]
        raise ConfigError(f"trainer.accelerator={accelerator}: Lightning's {accelerator} accelerator is not available "
                          f"on this machine (available: {', '.join(['auto', *here])}); use trainer.accelerator=auto")


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
    check_precision(cfg)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if (accelerator == "cuda" or accelerator == "gpu" and not torch.backends.mps.is_available()) \
            and not torch.cuda.is_available():  # Lightning: 'No supported gpu backend found!', in Hydra's wrapper
        raise ConfigError(
            f"trainer.accelerator={accelerator} (trainer=gpu), but torch {torch.__version__} finds no CUDA GPU: on "
            "this machine use trainer=cpu (or trainer=ddp_cpu); for a GPU, install torch's CUDA build (README.md)"
        )
    check_accelerator(cfg.trainer.get("accelerator", "auto"))
    max_time = cfg.trainer.get("max_time")  # Lightning's Timer: 2.5 was "AttributeError: 'float' object has no
    if max_time is not None and not isinstance(max_time, DictConfig) and not (  # attribute 'total_seconds'"
            isinstance(max_time, str) and re.fullmatch(r"\d+:\d\d:\d\d:\d\d", max_time.strip())):  # Timer's
        raise ConfigError(f"trainer.max_time={max_time!r} must be 'DD:HH:MM:SS' (e.g. '00:12:00:00'), a mapping "
                          f"such as {{hours: 12}}, or null (no limit){_base_60_hint(max_time)}")
    if isinstance(max_time, DictConfig):  # datetime.timedelta's keywords: {mins: 5} was its TypeError's traceback
        wrong = [f"{k}={v!r}" for k, v in max_time.items()  # not v >= 0: nan too (timedelta's ValueError)
                 if k not in _TIMEDELTA_KEYS or not is_number(v) or not v >= 0]
        if wrong:
            raise ConfigError(f"trainer.max_time's {', '.join(wrong)}: a mapping takes numbers >= 0 under "
                              f"{', '.join(_TIMEDELTA_KEYS)} (e.g. {{hours: 12}}), as datetime.timedelta does")
    if max_time is not None:  # {hours: inf}, {hours: nan}, '1000000000:00:00:00': timedelta's error in a traceback
        value = OmegaConf.to_container(max_time, resolve=True) if isinstance(max_time, DictConfig) else max_time
        parts = value if isinstance(value, dict) else dict(zip(("days", "hours", "minutes", "seconds"),
                                                               map(int, value.split(":"))))
        try:
            limit = datetime.timedelta(**parts)
        except OverflowError as e:
            raise ConfigError(f"trainer.max_time={value!r} is beyond datetime.timedelta ({e}): give a finite time "
                              "(at most 999999999 days), or null for no limit") from None
        if not limit:  # the timer stops the fit before its first step: a 0-step run, last.ckpt and exit status 0
            raise ConfigError(f"trainer.max_time={value!r} is no time: the run would train 0 of its "
                              "trainer.max_steps steps and end as if done; give a time > 0 (e.g. '00:12:00:00'), or "
                              "null for no limit")
    every = cfg.trainer.get("check_val_every_n_epoch")  # 0: a ZeroDivisionError at the end of the first epoch
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise ConfigError(f"trainer.check_val_every_n_epoch must be null (validate by steps: "
                          f"trainer.val_check_interval) or an integer >= 1, got {every!r}")
    overfit = cfg.trainer.get("overfit_batches")  # a fraction: Lightning's MisconfigurationException naming
    if overfit is not None and not (is_number(overfit) and overfit >= 0 and overfit % 1 == 0  # limit_train_batches
                                    and not (isinstance(overfit, float) and overfit == 1.0)):  # 1.0: 'all batches'
        raise ConfigError(f"trainer.overfit_batches={overfit!r} must be a whole number of batches to train on again "
                          "and again (e.g. 1 or 8; 0: off): the training stream is drawn by step and has no length, "
                          "so a fraction of it cannot be taken")
    if is_whole_float(overfit):  # 2.0: Lightning takes it as 2 batches but sets limit_train_batches to the float 2.0,
        # its MisconfigurationException 'must be 1.0 or an int'
        cfg.trainer.overfit_batches = as_integer("trainer.overfit_batches", overfit)
    limit = cfg.trainer.get("limit_train_batches")  # a fraction: Lightning's MisconfigurationException traceback
    if limit is not None and not (is_number(limit) and limit >= 0 and (limit % 1 == 0)):  # once fit starts
        raise ConfigError(f"trainer.limit_train_batches={limit!r} must be a whole number of batches per epoch (or "
                          "null): the training stream is drawn by step without end, so a fraction of an epoch cannot "
                          "be taken; to train less, lower trainer.max_steps")
    if limit is not None and limit == 0:  # Lightning skips training: a 0-step run, last.ckpt and exit status 0
        raise ConfigError("trainer.limit_train_batches=0 switches training off: the run would train 0 of its "
                          "trainer.max_steps steps and end as if done; give a whole number of batches per epoch >= 1 "
                          "(or null)")
    epochs = cfg.trainer.get("max_epochs")  # 0: a 0-step run, last.ckpt and exit status 0; -2: Lightning's error
    if is_number(epochs, integer=True) and epochs < 1 and epochs != -1:  # after the seed, naming 'trainer:'
        why = ("switches training off: the run would train 0 of its trainer.max_steps steps and end as if done"
               if epochs == 0 else "is not a number of epochs (Lightning takes -1 for no limit)")
        raise ConfigError(f"trainer.max_epochs={epochs} {why}; give a number of epochs >= 1, or -1 or null (no "
                          "epoch limit: the run stops at trainer.max_steps)")
    sanity = cfg.trainer.get("num_sanity_val_steps")  # Lightning checks no bound: -2 ran no sanity check, silently
    if is_number(sanity, integer=True) and sanity < -1:
        raise ConfigError(f"trainer.num_sanity_val_steps={sanity} must be an integer >= -1 (N: validation batches "
                          "before training; 0: none; -1: all)")
    algorithm, algorithms = cfg.trainer.get("gradient_clip_algorithm"), [a.value for a in GradClipAlgorithmType]
    if algorithm is not None and str(algorithm).lower() not in algorithms:  # Lightning lower-cases it
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={algorithm!r} must be one of "
            f"{', '.join(map(repr, algorithms))} (or null: 'norm')"
        )
    devices = cfg.trainer.get("devices")
    if is_whole_float(devices):  # 2.0 (1e0, ${oc.decode:...} of '2.0'): that many, as every integer key takes it
        cfg.trainer.devices = devices = as_integer("trainer.devices", devices)
    ids = list(devices) if isinstance(devices, ListConfig) else None
    valid = (
        devices is None
        or devices == "auto"
        or (isinstance(devices, str) and re.fullmatch(r"[\d, ]+", devices))
        or (is_number(devices, integer=True) and (devices >= 1 or devices == -1))
        or (ids is not None and ids and all(is_number(i, integer=True) and i >= 0 for i in ids))
    )
    if not valid:
        shown = ids if ids is not None else devices
        raise ConfigError(
            f"trainer.devices={shown!r} must be a number of devices >= 1, -1 (all), 'auto' or a list of "
            "device ids ([0, 1] or '0,1')"
        )
    cpu_count = devices == "auto" or (isinstance(devices, str) and devices.strip().isdigit() and int(devices) >= 1) \
        or (is_number(devices, integer=True) and devices >= 1)
    if _on_cpu(cfg) and not cpu_count:  # Lightning: "TypeError('`devices` selected with `CPUAccelerator` should be
        shown = ids if ids is not None else devices  # an int > 0.')" in Hydra's wrapper, naming only full_key: trainer
        raise ConfigError(
            f"trainer.devices={shown!r} does not run on a CPU (trainer.accelerator={accelerator}"
            f"{'' if accelerator == 'cpu' else ', and no GPU here'}), where it is a number of processes >= 1: use "
            "trainer.devices=1 (or 'auto'), or trainer=ddp_cpu trainer.devices=N for N processes"
        )
    for key, node in (cfg.get("callbacks") or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            cls = _locate(node._target_)  # a function (token_throughput_monitor) is no class: nothing to check
        except Exception:  # an unimportable target: build_callbacks names it
            continue
        _check_checkpointing_off(cfg, key, cls)
        _check_lr_monitor(key, node, cls)
        _check_accumulation_scheduler(key, node, cls)
        if "mode" not in node:
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


def _check_checkpointing_off(cfg: DictConfig, key: str, cls) -> None:
    """``trainer.enable_checkpointing=false`` beside a ``ModelCheckpoint`` callback (the default's
    ``callbacks.model_checkpoint``): Lightning's 'Trainer was configured with `enable_checkpointing=False` but found
    `ModelCheckpoint` in callbacks list', naming neither key. Refused rather than honoured: train.py saves last.ckpt
    at the end and on SIGTERM whatever the flag says, so dropping the callback is what the flag can mean here."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if cfg.trainer.get("enable_checkpointing") is False and isinstance(cls, type) and issubclass(cls, ModelCheckpoint):
        raise ConfigError(f"trainer.enable_checkpointing=false, but callbacks.{key} is a ModelCheckpoint, which "
                          f"Lightning refuses beside it: for no checkpoints during training set callbacks.{key}=null "
                          "instead (train.py still saves last.ckpt at the end, and on SIGTERM, for a resume)")


def _check_lr_monitor(key: str, node: DictConfig, cls) -> None:
    """A ``LearningRateMonitor``'s ``logging_interval`` other than step, epoch or null: Lightning's
    ``MisconfigurationException`` in Hydra's wrapper, naming only ``full_key: callbacks.<key>``."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    interval = node.get("logging_interval")
    if isinstance(cls, type) and issubclass(cls, LearningRateMonitor) and interval not in (None, "step", "epoch"):
        raise ConfigError(f"callbacks.{key}.logging_interval={interval!r} must be 'step' (the LR of every logged "
                          "step), 'epoch' or null (by the scheduler's interval)")


def _check_accumulation_scheduler(key: str, node: DictConfig, cls) -> None:
    """Lightning's ``GradientAccumulationScheduler`` in the config: train.py reads the accumulation from
    ``trainer.accumulate_grad_batches`` (validation every N optimizer steps, the resume's micro-batch check), so
    ``scheduling={0: 2}`` with ``val_check_interval=3`` validated 4 times in 6 steps, in the middle of
    accumulations. A project of one's own may use it (docs/callbacks_in_your_project.md)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    if isinstance(cls, type) and issubclass(cls, GradientAccumulationScheduler):
        scheduling = node.get("scheduling")
        values = set(scheduling.values()) if isinstance(scheduling, DictConfig) else set()
        value = values.pop() if len(values) == 1 else "<micro-batches>"
        raise ConfigError(f"callbacks.{key} is Lightning's GradientAccumulationScheduler, which lit_dtrain's runs do "
                          "not count (validation every N steps and the resume check read trainer."
                          f"accumulate_grad_batches): remove it and set trainer.accumulate_grad_batches={value}, one "
                          "accumulation for the run")


def _one_process(cfg: DictConfig) -> bool:
    """Whether the Trainer runs one process: one node, and one device (``auto`` on a CPU is one)."""
    devices = cfg.trainer.get("devices", "auto")
    one = devices in (1, "1") or (devices == "auto" and _on_cpu(cfg)) or (isinstance(devices, ListConfig)
                                                                         and len(devices) == 1)
    return one and cfg.trainer.get("num_nodes", 1) in (1, None)


def check_val_check_interval(cfg: DictConfig) -> None:
    """``trainer.val_check_interval`` in the forms Lightning documents: an integer (optimizer steps here), a whole
    float above 1 (``1e3``: taken as that integer), or a duration (``'DD:HH:MM:SS'``, ``{minutes: 1}``) on one
    process without gradient accumulation; a fraction of an epoch, and a duration where it cannot work, are refused
    saying why. Each was refused as 'must be an integer'."""
    key, value = "trainer.val_check_interval", cfg.trainer.get("val_check_interval")
    steps = "give the optimizer steps between validations as an integer (e.g. 250; >= trainer.max_steps: once, " \
            "at the end)"
    if (written := base_60_source(key, value)) is not None:  # YAML's 1:00:00:00 is 216000 steps
        path, text = written
        # the duration in the one form taken: '1:30:00' quoted was refused as no 'DD:HH:MM:SS' (the fix it named)
        d, h, m, s = value // 86400, value // 3600 % 24, value // 60 % 60, value % 60
        days = text if text.count(":") == 3 else f"{d:02d}:{h:02d}:{m:02d}:{s:02d}"
        raise ConfigError(f"{key}={value!r} comes from {str(path)!r}, where it is written unquoted as {text}, which "
                          f"YAML reads as the base-60 number {value} (steps): quote it for a duration, "
                          f"val_check_interval: '{days}', or write {value} for steps")
    if value is None or is_number(value, integer=True):
        return
    if is_number(value):
        if 0 < value <= 1:  # Lightning's 1.0 is one epoch, 0.5 half of one: an epoch of this stream never ends
            raise ConfigError(f"{key}={value!r} is a fraction of an epoch (Lightning's float), and the training stream "
                              f"is drawn by step without end, so an epoch never ends: {steps}")
        if not is_whole_float(value):
            raise ConfigError(f"{key}={value!r} is not a whole number of steps: {steps}")
        cfg.trainer.val_check_interval = as_integer(key, value)
        return
    if isinstance(value, DictConfig):
        try:
            seconds = datetime.timedelta(**OmegaConf.to_container(value)).total_seconds()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key}={OmegaConf.to_container(value)!r} is no duration ({e}): use datetime.timedelta's "
                              "keys, e.g. {minutes: 30}") from None
    elif isinstance(value, str) and re.fullmatch(r"\d+:\d+:\d+:\d+", value.strip()):
        seconds = sum(int(x) * m for x, m in zip(value.split(":"), (86400, 3600, 60, 1)))
    else:
        raise ConfigError(f"{key}={value!r} must be optimizer steps (an integer) or a duration, 'DD:HH:MM:SS' or a "
                          "mapping such as {minutes: 30}")
    if seconds <= 0:
        raise ConfigError(f"{key}={value!r} must be a duration > 0")
    if not _one_process(cfg):  # Lightning lets each rank decide from its own clock
        raise ConfigError(f"{key}={value!r} is a duration, which each process measures on its own clock: the ranks "
                          f"could decide after different steps to validate, and their collectives would not match (a "
                          f"hang); {steps}")
    if int(cfg.trainer.get("accumulate_grad_batches") or 1) > 1:  # Lightning checks after every micro-batch
        raise ConfigError(f"{key}={value!r} is a duration, which Lightning checks after every micro-batch: with "
                          "trainer.accumulate_grad_batches > 1 it can validate (and checkpoint) in the middle of an "
                          f"optimizer step's accumulation; {steps}")
