"""Optimizer factories: AdamW (fused/foreach where available) and bitsandbytes 8-bit AdamW."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def set_lr(group: dict, value) -> None:
    """Set a param group's LR. A Tensor LR (what a compiled or capturable optimizer step is given, so that a new LR
    neither recompiles nor re-captures it) is filled in place, as torch's LR schedulers do: replacing it with a float,
    or with another tensor, changed the object that compiled step holds."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr.copy_(value) if isinstance(value, torch.Tensor) else lr.fill_(value)
    else:
        group["lr"] = value


def adamw(
    params: Iterable,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the fused implementation when requested or available, else foreach."""
    _check_lr(lr)
    params = list(params)
    if fused is None:  # fused kernels exist for CUDA and (since torch 2.4) CPU float tensors
        fused = all(_fusable(p) for p in _tensors(params))
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs)


# bitsandbytes' 8-bit AdamW casts a parameter to fp32 for its update: a trainer.precision=64-true run with it trained
# weights that were exactly fp32 values after every step (21 of 21 tensors of the tiny model), silently
ADAMW8BIT_FP64 = ("bitsandbytes computes the update in fp32 and writes fp32-rounded values back, so the weights are "
                  "fp32 after every step; train in float64 with optimizer=adamw")


def adamw8bit(
    params: Iterable,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
):
    """bitsandbytes' 8-bit AdamW (block-wise quantized optimizer state). Refuses float64 parameters
    (:data:`ADAMW8BIT_FP64`)."""
    _check_lr(lr)
    params = list(params)
    if any(p.dtype == torch.float64 for p in _tensors(params)):
        raise ValueError(f"optimizer=adamw8bit cannot train float64 parameters: {ADAMW8BIT_FP64}")
    try:
        import bitsandbytes as bnb
    except Exception as e:  # not installed, or its native library does not load on this machine
        raise ImportError(f"optimizer=adamw8bit needs bitsandbytes, which does not import here "
                          f"({type(e).__name__}: {e}): pip install bitsandbytes, or use optimizer=adamw") from e
    return bnb.optim.AdamW8bit(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def _check_lr(lr: float) -> None:
    if not lr > 0:
        raise ValueError(f"optimizer.lr must be > 0, got {lr}")


def _tensors(params: list) -> list[torch.Tensor]:
    """The parameters of an optimizer's ``params`` argument: tensors, or param groups (dicts) of them."""
    return [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]


def _fusable(p: torch.Tensor) -> bool:
    return p.is_floating_point() and p.device.type in ("cpu", "cuda")


__all__ = ["ADAMW8BIT_FP64", "adamw", "adamw8bit"]
