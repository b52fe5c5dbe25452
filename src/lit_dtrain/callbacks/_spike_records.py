"""The ``spikes.jsonl`` records of :class:`~lit_dtrain.callbacks.loss_spike.LossSpikeMonitor` (no torch, no Lightning).

One JSON object per line: a spike (its step, loss and grad-norm statistics, reasons, the actions taken, the
sample ``index`` values excluded, the snapshot step of a rollback and the next step's LR multiplier), or an
accepted level shift (``reasons: ["level_shift"]`` or ``["grad_level_shift"]``, no actions). Non-finite
floats are written as strings (``"nan"``, ``"inf"``), so every line is valid JSON.
"""

from __future__ import annotations

import json
import math
import os
import time

from lit_dtrain.utils.atomic import write_atomically


def json_float(x: float | None):
    return None if x is None else (x if math.isfinite(x) else str(x))


def spike_record(step: int, decision, actions: list[str], indices: list[int], rolled_back_to: int | None,
                 lr_multiplier_next: float) -> dict:
    """The record of the spike at ``step`` (``decision``: its :class:`~._spike_stats.SpikeDecision`)."""
    d = decision
    return {
        "step": step, "loss": json_float(d.loss), "loss_z": json_float(d.loss_z),
        "loss_rel": json_float(d.loss_rel), "grad_norm": json_float(d.grad_norm),
        "grad_z": json_float(d.grad_z), "reasons": list(d.reasons), "actions": actions,
        "index": indices, "rolled_back_to": rolled_back_to,
        "lr_multiplier_next": lr_multiplier_next, "time": time.time(),
    }


def spike_message(step: int, decision, actions: list[str]) -> str:
    """The console warning and TensorBoard text of the spike at ``step`` (action ``log``)."""
    d = decision
    return (f"loss spike at step {step}: loss={d.loss:.4g} z={d.loss_z:.3g} rel={d.loss_rel:.3g} "
            f"grad_norm={d.grad_norm} reasons={d.reasons} -> {actions}")


def level_shift_records(step: int, decision, grad_norm: float | None, max_consecutive: int | None) -> list[tuple]:
    """``(record, message)`` of each level shift the detector accepted at ``step`` (loss, grad norm)."""
    shifts = []
    if decision.level_shift:
        shifts.append((
            {"step": step, "loss": decision.loss, "reasons": ["level_shift"], "actions": []},
            f"loss level shift accepted at step {step}: {max_consecutive} spikes in a row; "
            f"statistics restart at loss {decision.loss:.4g}"))
    if decision.grad_level_shift:
        shifts.append((
            {"step": step, "loss": decision.loss, "grad_norm": grad_norm, "reasons": ["grad_level_shift"],
             "actions": []},
            f"grad-norm level shift accepted at step {step}: {max_consecutive} grad-norm spikes in a "
            f"row; its statistics restart at grad norm {grad_norm:.4g}"))
    return shifts


LASTING_RUN_WARN_AT = 10  # the default max_consecutive: a run of spikes this long (and 10x, 100x ...) is told


def lasting_run_message(step: int, detector, actions: list[str]) -> str | None:
    """A warning when, with ``max_consecutive=None`` (a new level is never accepted), the current run of consecutive
    loss (or grad-norm) spikes has reached 10, 100, 1000 ... steps; else None. Without it, a loss that moved for good
    made ``skip`` drop every later step (or ``lr_cooldown`` hold the LR down) with no console line when ``log`` was
    not an action, and the run ended with exit 0 having trained on none of them."""
    if detector.max_consecutive is not None:
        return None
    n = max(len(detector.consecutive), len(detector.grad_consecutive))
    if n < LASTING_RUN_WARN_AT or str(n).rstrip("0") != "1":
        return None
    return (f"LossSpikeMonitor: the last {n} steps (to step {step}) were all spikes (actions {actions}), and "
            "max_consecutive=null never accepts a new loss or grad-norm level: if the level moved for good, every "
            "later step is treated as a spike too; set callbacks.loss_spike.max_consecutive (e.g. 10) to accept it")


def append_record(path: str, event: dict) -> None:
    """Append ``event`` as one JSON line to ``path`` (its directory is created)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({k: json_float(v) if isinstance(v, float) else v for k, v in event.items()}) + "\n")


def supersede_replayed(path: str, start_step: int) -> tuple[int, str] | None:
    """Move the records of steps ``>= start_step`` from ``path`` to ``<root>.superseded<ext>``.

    Returns ``(records moved, superseded path)``, or None when nothing moved. Lines that are not such records
    (no integer ``step``) stay where they are.
    """
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    keep, drop = [], []
    for line in lines:
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            step = -1  # not ours: keep it
        (drop if step >= start_step else keep).append(line)
    if not drop:
        return None
    root, ext = os.path.splitext(path)
    superseded = f"{root}.superseded{ext or '.jsonl'}"
    with open(superseded, "a") as f:
        f.write("".join(line + "\n" for line in drop))
    write_atomically(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in keep)))
    return len(drop), superseded
