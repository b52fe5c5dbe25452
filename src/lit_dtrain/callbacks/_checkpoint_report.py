"""What ``SelectiveCheckpointing`` chose, where people look: the ``ckpt/*`` scalars and ``summary.json``'s
``activation_checkpointing`` entry. The plan was in the setup log line and the checkpoint only.

The scalars are constant through a fit, but are written at every logged step beside ``memory/*`` (Lightning's
``log_every_n_steps`` cadence), as every lit_dtrain scalar is: a resumed run's curves are then the straight run's, and
a row at a start's first step only would be off the cadence."""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L

from lit_dtrain.callbacks._checkpoint_policies import MODES
from lit_dtrain.callbacks._logging import log_interval, log_step_metrics, on_log_cadence
from lit_dtrain.utils.loop import logging_axis_step, mid_accumulation

MIB = 2**20


def plan_figures(policy: str, plan: list[str], report: dict | None) -> dict:
    """The plan in use and its block counts per mode; under ``budget``, the probe's figures of that plan (the ratios
    of the log line 'budget probe: measured R of no-checkpointing peak activation memory (budget B)', and the probe
    pass's bytes: its batch, not training's). A resumed ``budget`` run trains with its checkpoint's plan: where this
    start's probe measured another one, its figures are left out (they are not of the plan in use)."""
    figures = {"policy": policy, "plan": list(plan), **{f"blocks_{mode}": plan.count(mode) for mode in MODES}}
    if report is not None and report["plan"] == list(plan):
        figures.update({key: report[key] for key in (
            "memory_budget", "measured_ratio", "estimated_ratio", "fits", "none_act_bytes", "measured_bytes",
            "budget_bytes")})
        figures["tries"] = len(report["tries"])
    return figures


def plan_scalars(figures: dict) -> dict[str, float]:
    """``figures`` (:func:`plan_figures`) as scalars for the loggers: ``ckpt/blocks_<mode>``, and under ``budget``
    ``ckpt/memory_budget``, ``ckpt/measured_ratio``, ``ckpt/estimated_ratio`` and the probe's
    ``ckpt/probe_act_mib``, ``ckpt/probe_budget_mib`` (MiB, as ``memory/*``: a float32 scalar holds bytes exactly
    only up to 16 MiB; ``summary.json`` has the bytes)."""
    scalars = {f"ckpt/blocks_{mode}": float(figures[f"blocks_{mode}"]) for mode in MODES}
    if "measured_ratio" in figures:
        scalars.update({f"ckpt/{key}": float(figures[key]) for key in ("memory_budget", "measured_ratio",
                                                                        "estimated_ratio")})
        scalars["ckpt/probe_act_mib"] = figures["measured_bytes"] / MIB
        scalars["ckpt/probe_budget_mib"] = figures["budget_bytes"] / MIB
    return scalars


def log_plan_scalars(trainer: L.Trainer, pl_module: L.LightningModule, scalars: dict[str, float]) -> None:
    """``scalars`` (:func:`plan_scalars`) to the loggers at the optimizer step just taken, where it is a logged one
    (rank 0, once per optimizer step under accumulation); called from ``on_train_batch_end``."""
    if not scalars or not trainer.is_global_zero or mid_accumulation(trainer):
        return
    step = logging_axis_step(trainer)  # the optimizer step just taken (0-based), where train/loss is written
    if on_log_cadence(log_interval(None, trainer), step, trainer):
        log_step_metrics(trainer, pl_module, scalars, step, callback_metrics=False)


def summary_entry(callbacks: Iterable) -> dict:
    """``{"activation_checkpointing": figures}`` for ``summary.json`` where a ``SelectiveCheckpointing`` ran (a list
    of them where several did), else ``{}``."""
    from lit_dtrain.callbacks.selective_checkpointing import SelectiveCheckpointing

    found = [c.plan_figures() for c in callbacks if isinstance(c, SelectiveCheckpointing) and c.plan]
    if not found:
        return {}
    return {"activation_checkpointing": found[0] if len(found) == 1 else found}
