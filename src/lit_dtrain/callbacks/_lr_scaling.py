"""Scaling an optimizer's LRs for one update and putting them back right after it, by several callbacks at once.

``LossSpikeMonitor``'s ``lr_cooldown`` and ``FourierSamplerCallback``'s stage multiplier both scale the LR of one
optimizer step and must undo it inside ``optimizer.step`` (Lightning steps the LR scheduler before
``on_train_batch_end``, and chainable torch schedulers read ``group["lr"]``). When each saved "its" LR and restored
it in a step post-hook of its own, the restores only nested correctly in one order, and which order was right
depended on the precision (under ``32-true`` Lightning runs the closure, hence ``on_before_optimizer_step``, inside
``optimizer.step`` after the pre-hooks; under ``16-mixed`` before it): in the wrong one a scaled LR was left in place
and, without an LR scheduler to recompute it, every later step compounded it.

Here every scaling of one step multiplies the current LRs, and one post-hook per optimizer puts back the LRs from
before the first scaling of that step, whatever the order of the scalings and of the callbacks. Before it does, it
keeps the LRs the update used (:func:`pop_applied_lrs`), which ``OncePerStepLRMonitor`` logs as ``<lr tag>-effective``
beside the schedule's LR when a callback scales it (``scales_lr``).
"""

from __future__ import annotations

import torch

from lit_dtrain.optim import set_lr

_ATTR = "_lit_dtrain_lr_scaling"


def _value(lr):
    return lr.clone() if isinstance(lr, torch.Tensor) else lr


def _state(optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.__dict__.get(_ATTR)
    if state is None:
        state = {"base": None, "applied": None, "found_inf": None}
        setattr(optimizer, _ATTR, state)
        # registered once and never removed while torch iterates over the post-hooks; only records on unscaled steps
        optimizer.register_step_post_hook(lambda opt, args, kwargs: _after_step(opt, state))
    return state


def _after_step(optimizer: torch.optim.Optimizer, state: dict) -> None:
    # kept as they are (a tensor LR cloned, not read): only a logged step reads them, so no host sync per step. A step
    # without any gradient (LossSpikeMonitor's skip or rollback dropped them) moved nothing: it applied no LR. Nor did
    # one the GradScaler skipped inside a fused optimizer (found_inf, set for the call), read at a logged step only
    if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
        found_inf = getattr(optimizer, "found_inf", None)
        state["applied"] = [_value(group["lr"]) for group in optimizer.param_groups]
        state["found_inf"] = found_inf.clone() if isinstance(found_inf, torch.Tensor) else None
    else:
        state["applied"] = None
    restore_lrs(optimizer)


def track_applied_lrs(optimizer: torch.optim.Optimizer) -> None:
    """From now on, record the LRs of every update of ``optimizer`` (scaled or not) for :func:`pop_applied_lrs`."""
    _state(optimizer)


def pop_applied_lrs(optimizer: torch.optim.Optimizer) -> list | None:
    """Each param group's LR of ``optimizer``'s latest update since the last call (scalings included), or ``None``
    when it took none (not tracked, a micro-batch that accumulates, a step the GradScaler skipped, a step whose
    gradients were dropped)."""
    state = optimizer.__dict__.get(_ATTR)
    if state is None:
        return None
    applied, found_inf = state["applied"], state.get("found_inf")
    state["applied"] = state["found_inf"] = None
    if applied is not None and found_inf is not None and bool(found_inf.any()):
        return None
    return applied


def unscaled_lrs(optimizer: torch.optim.Optimizer) -> list:
    """Each param group's LR without this step's scalings: the LRs :func:`restore_lrs` puts back, else the current."""
    state = optimizer.__dict__.get(_ATTR)
    if state is not None and state["base"] is not None:
        return list(state["base"])
    return [group["lr"] for group in optimizer.param_groups]


def scale_lrs_for_step(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every param group's LR by ``factor`` for the coming update; the LRs from before the first scaling of
    this step come back right after ``optimizer.step`` (or at :func:`restore_lrs`, when the step was not taken)."""
    if factor == 1.0:
        return
    state = _state(optimizer)
    if state["base"] is None:  # (a Tensor LR is scaled in place below: keep its value)
        state["base"] = [_value(group["lr"]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        set_lr(group, group["lr"] * factor)


def restore_lrs(optimizer: torch.optim.Optimizer) -> bool:
    """Put back the LRs from before this step's scalings (True), or do nothing when none is pending (False)."""
    state = optimizer.__dict__.get(_ATTR)
    if state is None or state["base"] is None:
        return False
    for group, lr in zip(optimizer.param_groups, state["base"]):
        set_lr(group, lr)
    state["base"] = None
    return True
