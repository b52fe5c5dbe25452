"""Pure LR-factor functions of the step, and ``LambdaLR`` adapters over them.

A factor multiplies each param group's base (peak) LR. Schedules are pure functions of the optimizer step
(as in torchtitan's ``linear_warmup_stable_decay``), so the ``LRScheduler``, the
:class:`~lit_dtrain.callbacks.WSDScheduler` callback and the tests all share one definition. Step ``s``
is the 0-based index of the optimizer step the factor is used for: ``LambdaLR`` evaluates it at
``last_epoch = s``, the callback at ``trainer.global_step = s``.

WSD (warmup-stable-decay, Hu et al. 2024 "MiniCPM"; Hägele et al. 2024 "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations") holds the peak LR until a short final decay, so one stable
run can branch into decays at any step, or be extended.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from lit_dtrain.optim import set_lr
from lit_dtrain.utils.args import as_written, is_number
from lit_dtrain.utils.args import check_int as _check_int
from lit_dtrain.utils.rank_zero import log_once

DECAY_TYPES = ("linear", "cosine", "1-sqrt", "exponential")

log = logging.getLogger(__name__)


@contextmanager
def no_schedule_warnings():
    """Build a schedule without its warnings: the config check's build on a dummy optimizer, before the run's own
    build warns (a decay_fraction that rounds to no decay was logged twice)."""
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


_rounded_decay_told: tuple[int, float] | None = None  # see rounded_decay_told


def rounded_decay_told(total_steps: int | None, decay_fraction: float | None = None) -> None:
    """A caller's own warning has said that ``decay_fraction`` of ``total_steps`` rounds to no decay (train.py's, which
    also names the steps past ``total_steps``): the schedule built next does not say it again in other words
    (``total_steps=2 max_steps=4`` read 'the last 2 steps run at min_lr_factor=0.0' beside 'the LR stays at its peak
    to the last step'). ``None`` clears it (train.py does at each start)."""
    global _rounded_decay_told
    _rounded_decay_told = None if total_steps is None else (int(total_steps), decay_fraction)


def _check_min_factor(min_lr_factor: float) -> float:
    if not is_number(min_lr_factor):
        raise ValueError(f"min_lr_factor must be a number in [0, 1], got {min_lr_factor!r}")
    if not 0.0 <= min_lr_factor <= 1.0:  # also rejects NaN
        raise ValueError(f"min_lr_factor must be in [0, 1], got {min_lr_factor}")
    return float(min_lr_factor)


def _warmup_factor(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


def resolve_decay_steps(total_steps: int, decay_steps: int | None = None, decay_fraction: float | None = None) -> int:
    """``decay_steps``, or ``round(decay_fraction * total_steps)``; exactly one of them must be given (the error names
    the arguments; lit_dtrain's config check names its config keys, :func:`~lit_dtrain.schedules.workflows.
    check_one_decay_length`, so that another project's user is not told about lit_dtrain's yaml files).

    ``round`` is Python's (round half to even), as the WSD definition states, of the exact product of
    ``decay_fraction`` as written (its shortest decimal form) and ``total_steps``: in floats ``0.35 * 90`` is
    ``31.499999999999996``, which rounded to 31 where ``31.5`` rounds to 32.
    """
    total_steps = _check_int("total_steps", total_steps, minimum=1)
    if (decay_steps is None) == (decay_fraction is None):
        raise ValueError(
            f"give exactly one of decay_steps and decay_fraction, got decay_steps={decay_steps!r}, "
            f"decay_fraction={decay_fraction!r}"
        )
    if decay_fraction is not None:
        if not is_number(decay_fraction):
            raise ValueError(f"decay_fraction must be a number in [0, 1], got {decay_fraction!r}")
        if not 0.0 <= decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in [0, 1], got {decay_fraction}")
        return round(as_written(decay_fraction) * total_steps)
    return _check_int("decay_steps", decay_steps)


def check_wsd_args(
    *,
    total_steps: int,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    decay_type: str = "1-sqrt",
    min_lr_factor: float = 0.0,
    decay_fraction: float | None = None,
) -> int:
    """Validate WSD arguments (``ValueError`` naming the argument); returns the resolved ``decay_steps``. A
    ``decay_fraction`` above 0 that rounds to 0 decay steps is a warning (the WSD constructors call this once):
    the schedule has no decay, its last step runs at the peak LR, not ``min_lr_factor``."""
    resolved = resolve_decay_steps(total_steps, decay_steps, decay_fraction)
    told = _rounded_decay_told == (int(total_steps), decay_fraction)
    if decay_fraction and not resolved and not told:  # every rank builds the schedule: rank 0 says it
        log_once(
            log, logging.WARNING,
            "WSD: decay_fraction=%s of total_steps=%s rounds to 0 decay steps (round(%s) = 0): no decay, the LR stays "
            "at its peak to the last step and never reaches min_lr_factor; give decay_steps (at least 1) for one",
            decay_fraction, total_steps, float(as_written(decay_fraction) * int(total_steps)),
        )
    decay_steps = resolved
    warmup_steps = _check_int("warmup_steps", warmup_steps)
    m = _check_min_factor(min_lr_factor)
    if decay_type not in DECAY_TYPES:
        raise ValueError(f"decay_type must be one of {DECAY_TYPES}, got {decay_type!r}")
    if decay_type == "exponential" and m <= 0.0:
        raise ValueError(f"min_lr_factor must be > 0 for decay_type='exponential' (m ** p), got {min_lr_factor}")
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"warmup_steps + decay_steps must be <= total_steps, got warmup_steps={warmup_steps} + "
            f"decay_steps={decay_steps} > total_steps={total_steps}: shorten warmup_steps or the decay (decay_steps, "
            "decay_fraction), or raise total_steps (in train.py scheduler.total_steps, by default trainer.max_steps)"
        )
    return decay_steps


def wsd_lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    decay_type: str = "1-sqrt",
    min_lr_factor: float = 0.0,
    decay_fraction: float | None = None,
) -> float:
    """Warmup-stable-decay LR factor of optimizer step ``step`` (0-based).

    - warmup, ``step < warmup_steps``: ``(step + 1) / warmup_steps``;
    - stable, ``warmup_steps <= step < total_steps - decay_steps``: ``1.0``;
    - decay, ``total_steps - decay_steps <= step < total_steps``: with
      ``p = (step - (total_steps - decay_steps) + 1) / decay_steps`` in (0, 1] and ``m = min_lr_factor``,
      ``linear``: ``1 - p*(1 - m)``, ``cosine``: ``m + (1 - m)*0.5*(1 + cos(pi*p))``,
      ``1-sqrt``: ``m + (1 - m)*(1 - sqrt(p))``, ``exponential``: ``m ** p`` (needs ``m > 0``);
      the last step (``p = 1``) gets exactly ``m``;
    - after, ``step >= total_steps``: ``m``.

    Give ``decay_steps`` or ``decay_fraction`` (``decay_steps = round(decay_fraction * total_steps)``).
    Raises ``ValueError`` naming the argument for negative values, ``min_lr_factor`` outside [0, 1],
    ``warmup_steps + decay_steps > total_steps``, an unknown ``decay_type``.
    """
    decay_steps = check_wsd_args(  # its decay_fraction resolved here: called each step, it would warn each step
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        decay_steps=resolve_decay_steps(total_steps, decay_steps, decay_fraction),
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )
    return _checked_wsd_factor(_check_int("step", step), total_steps=int(total_steps), warmup_steps=int(warmup_steps),
                               decay_steps=decay_steps, decay_type=decay_type, min_lr_factor=min_lr_factor)


def _checked_wsd_factor(step: int, *, total_steps: int, warmup_steps: int, decay_steps: int, decay_type: str,
                        min_lr_factor: float) -> float:
    """:func:`wsd_lr_factor` of arguments that it has checked (``decay_steps`` resolved): the schedulers built below
    check them once, not at every step (~40 us per call and param group)."""
    m = float(min_lr_factor)
    if step < warmup_steps:
        return _warmup_factor(step, warmup_steps)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    if step >= total_steps:
        return m
    p = (step - decay_start + 1) / decay_steps  # in (0, 1]
    if decay_type == "linear":
        value = m + (1.0 - m) * (1.0 - p)  # = 1 - p*(1 - m), written so that p = 1 gives exactly m
    elif decay_type == "cosine":
        value = m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))
    elif decay_type == "1-sqrt":
        value = m + (1.0 - m) * (1.0 - math.sqrt(p))
    else:  # exponential
        value = m**p
    return min(1.0, max(m, value))  # guard against a last-ulp excursion outside [m, 1]


def cosine_lr_factor(step: int, *, total_steps: int, warmup_steps: int = 0, min_lr_factor: float = 0.1) -> float:
    """Linear warmup ((step + 1) / warmup_steps), then a cosine from 1 down to ``min_lr_factor`` on the last step.

    This is WSD with no stable phase: ``decay_steps = total_steps - warmup_steps``, ``decay_type='cosine'``.
    """
    total_steps = _check_int("total_steps", total_steps, minimum=1)
    warmup_steps = _check_int("warmup_steps", warmup_steps)
    if warmup_steps > total_steps:
        raise ValueError(  # the fix named, as WSD's error does (cpt_replay's warmup 50, never typed, in a short run)
            f"warmup_steps must be <= total_steps, got warmup_steps={warmup_steps} > total_steps={total_steps}: "
            "shorten warmup_steps or raise total_steps (in train.py scheduler.total_steps, by default "
            "trainer.max_steps)"
        )
    return wsd_lr_factor(
        step,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        decay_steps=total_steps - warmup_steps,
        decay_type="cosine",
        min_lr_factor=min_lr_factor,
    )


def constant_lr_factor(step: int, *, warmup_steps: int = 0) -> float:
    """1.0 after an optional linear warmup of ``warmup_steps`` ((step + 1) / warmup_steps)."""
    warmup_steps = _check_int("warmup_steps", warmup_steps)
    step = _check_int("step", step)
    if step < warmup_steps:
        return _warmup_factor(step, warmup_steps)
    return 1.0


class StepLambdaLR(LambdaLR):
    """``LambdaLR`` that re-applies its factor, with the configured peak LRs, when a checkpoint is loaded.

    Plain ``LambdaLR.load_state_dict`` restores ``last_epoch`` but leaves each group's LR at the value
    the *old* schedule set before saving, so the first step after a resume with a changed schedule (a
    WSD decay branch, an extended ``total_steps``) would run at the old LR. Lightning restores the
    optimizer before the scheduler, so setting the LR here makes the first resumed step use the new
    schedule's ``factor(last_epoch)``. The state stays a plain dict (``functools.partial`` lambdas are
    saved as their empty ``__dict__``), so the schedule's arguments always come from the config, and so do
    the peaks: ``LambdaLR`` restores the checkpoint's ``base_lrs``, which silently kept a resume with another
    ``optimizer.lr`` (lowered after an instability) at the old peak; the ones this scheduler was built with,
    the optimizer's configured LRs, are kept.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        configured = list(self.base_lrs)  # the optimizer's LRs when this scheduler was built: the config's peaks
        super().load_state_dict(state_dict)
        if len(configured) == len(self.base_lrs):
            self.base_lrs = configured
            for group, lr in zip(self.optimizer.param_groups, configured):
                group["initial_lr"] = lr  # (restored from the checkpoint's optimizer state with the old peak)
        self.set_step(self.last_epoch)

    def set_step(self, step: int) -> None:
        """Move the schedule to optimizer step ``step`` and set every group's LR to ``base_lr * factor(step)``."""
        self.last_epoch = int(step)
        values = [base_lr * fn(self.last_epoch) for fn, base_lr in zip(self.lr_lambdas, self.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, values):
            set_lr(group, lr)
        self._last_lr = list(values)


def lambda_scheduler(optimizer: Optimizer, factor_fn, **kwargs) -> StepLambdaLR:
    """A :class:`StepLambdaLR` stepping once per optimizer step with ``factor_fn(step, **kwargs)``."""
    factor_fn(0, **kwargs)  # validate arguments now, not at the first step
    return StepLambdaLR(optimizer, partial(factor_fn, **kwargs))


def wsd_scheduler(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    decay_fraction: float | None = None,
    decay_type: str = "1-sqrt",
    min_lr_factor: float = 0.0,
) -> StepLambdaLR:
    """``LambdaLR`` over :func:`wsd_lr_factor` (give ``decay_steps`` or ``decay_fraction``)."""
    decay_steps = check_wsd_args(
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
        decay_fraction=decay_fraction,
    )
    return lambda_scheduler(
        optimizer,
        _checked_wsd_factor,
        total_steps=int(total_steps),  # checked above: 1000.0 is 1000
        warmup_steps=int(warmup_steps),
        decay_steps=decay_steps,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )


def cosine_scheduler(optimizer: Optimizer, *, total_steps: int, warmup_steps: int = 0, min_lr_factor: float = 0.1):
    """``LambdaLR`` over :func:`cosine_lr_factor`."""
    cosine_lr_factor(0, total_steps=total_steps, warmup_steps=warmup_steps, min_lr_factor=min_lr_factor)  # checks
    total_steps, warmup_steps = int(total_steps), int(warmup_steps)
    if warmup_steps == total_steps and min_lr_factor < 1.0:  # as WSD's decay_fraction that rounds to no decay
        log_once(
            log, logging.WARNING,
            "cosine: warmup_steps=%d equals total_steps=%d: the schedule is all warmup, its LR reaches the peak on the "
            "last step and never decays toward min_lr_factor=%s; shorten warmup_steps (or raise total_steps) for a "
            "cosine decay", warmup_steps, total_steps, min_lr_factor,
        )
    return lambda_scheduler(optimizer, _checked_wsd_factor, total_steps=total_steps, warmup_steps=warmup_steps,
                            decay_steps=total_steps - warmup_steps, decay_type="cosine", min_lr_factor=min_lr_factor)


def constant_scheduler(optimizer: Optimizer, *, warmup_steps: int = 0):
    """``LambdaLR`` over :func:`constant_lr_factor`."""
    return lambda_scheduler(optimizer, constant_lr_factor, warmup_steps=warmup_steps)


_FACTORS = {
    "wsd_scheduler": wsd_lr_factor,
    "cosine_scheduler": cosine_lr_factor,
    "constant_scheduler": constant_lr_factor,
}


def schedule_factor(node, step: int) -> float | None:
    """The factor that a ``conf/scheduler`` node (``_target_`` one of the adapters above, with its arguments) gives
    optimizer step ``step``; ``None`` for another target or arguments that do not validate."""
    fn = _FACTORS.get(str(node.get("_target_", "")).rsplit(".", 1)[-1])
    kwargs = {k: v for k, v in node.items() if not str(k).startswith("_")}
    try:
        return fn(step, **kwargs) if fn is not None else None
    except (TypeError, ValueError):
        return None
