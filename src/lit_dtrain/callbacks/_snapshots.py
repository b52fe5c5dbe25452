"""In-memory CPU snapshots of the training state (model, optimizers, GradScaler, strategy comm state).

Used by ``LossSpikeMonitor``'s ``rollback`` action. A snapshot is a deep copy with every tensor cloned to
CPU, so restoring it with the modules' own ``load_state_dict`` is bit-exact and keeps the parameter objects
the optimizer refers to. LR schedulers are not part of it: the schedule follows the step count, so after a
restore every param group keeps the scheduled hyperparameters it holds *now* (:data:`SCHEDULED`: the LR, and the
momentum/betas that ``OneCycleLR``/``CyclicLR`` cycle with it; the optimizer's other group entries, such as
Prodigy's learned ``d``, come from the snapshot). A
strategy that keeps state of its own between steps (``CompressedDDPStrategy``: error-feedback residuals,
PowerSGD's warm start, DiLoCo's outer parameters) is snapshotted through ``comm_local_state_dict`` /
``load_comm_local_state_dict``, no collective involved. So is the average of a weight-averaging callback
(Lightning's ``WeightAveraging``, ``EMAWeightAveraging``, and ``StochasticWeightAveraging`` with its count of averaged
models): a rollback that kept it left the discarded steps' weights, the spike's among them, in the average a user
evaluates and saves (one more copy of the weights per snapshot).
Snapshots are not checkpointed: after a resume the
ring starts again from the resumed state. Full (unsharded) state dicts only; sharded strategies are rejected
by the caller.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Mapping

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging


def to_cpu(obj):
    """A deep copy of a (nested) state dict with every tensor cloned to CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def scaler_state(trainer) -> dict | None:
    """The GradScaler's state under ``16-mixed`` (None otherwise)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return None if scaler is None else copy.deepcopy(scaler.state_dict())


def load_scaler_state(trainer, state: dict | None) -> None:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and state is not None:
        scaler.load_state_dict(state)


SCHEDULED = ("lr", "momentum", "betas", "weight_decay")
"""The param-group entries a schedule sets by the step count (torch's LR schedulers: the LR; ``OneCycleLR`` and
``CyclicLR`` with ``cycle_momentum``: ``momentum`` or ``betas``; a weight-decay schedule of one's own)."""


def current_hparams(trainer) -> list[list[dict]]:
    """Every param group's entries but its params, as they are now (the LR an LR scheduler or a callback such as
    WSDScheduler set, and the entries a scheduler created since the snapshot added)."""
    return [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in trainer.optimizers]


def set_hparams(trainer, hparams: list[list[dict]]) -> None:
    """Put back the :data:`SCHEDULED` entries of ``hparams``, and those the snapshot's groups lack: SWA's ``SWALR``,
    created at its first epoch after the snapshot, adds ``swa_lr`` to each group, and its next step failed with
    ``KeyError: 'swa_lr'`` once a restore had dropped it."""
    for opt, opt_hparams in zip(trainer.optimizers, hparams):
        for group, values in zip(opt.param_groups, opt_hparams):
            group.update({k: v for k, v in values.items() if k in SCHEDULED or k not in group})


AVERAGING = (WeightAveraging, StochasticWeightAveraging)
"""Lightning's weight-averaging callbacks (``EMAWeightAveraging`` is a ``WeightAveraging``)."""


def averagers(trainer) -> list:
    """The trainer's weight-averaging callbacks whose average exists (built at fit setup)."""
    return [c for c in trainer.callbacks if isinstance(c, AVERAGING) and c._average_model is not None]


def average_state(callback) -> dict:
    """The average's weights, and ``StochasticWeightAveraging``'s count of averaged models (``WeightAveraging``'s
    ``AveragedModel`` keeps it in its own state dict). SWA's ``n_averaged`` is None until its first epoch start in
    this fit, which begins the count at ``_init_n_averaged``: 0, or the resumed checkpoint's count (a snapshot at a
    resume's train start is taken before; a rollback to it set the count to 0, and SWA's next update threw the
    resumed average away)."""
    if not isinstance(callback, StochasticWeightAveraging):
        return {"model": to_cpu(callback._average_model.state_dict())}
    count = callback._init_n_averaged if callback.n_averaged is None else int(callback.n_averaged)
    return {"model": to_cpu(callback._average_model.state_dict()), "n_averaged": int(count)}


def load_average_state(callback, state: dict) -> None:
    callback._average_model.load_state_dict(state["model"])  # (copied into its tensors, on their device)
    if isinstance(callback, StochasticWeightAveraging) and callback.n_averaged is not None:
        callback.n_averaged.fill_(state["n_averaged"])  # (SWA started after the snapshot: 0, its next update restarts)


def layout(trainer) -> tuple[list[list[int]], tuple[str, ...]]:
    """Each optimizer's parameter count per param group, and the module's state-dict keys: a snapshot restores only
    into the same layout (a ``BaseFinetuning`` unfreeze adds a group, and ``ModelPruning``'s first prune renames each
    pruned ``weight`` to ``weight_orig`` beside a ``weight_mask`` buffer; torch's ``load_state_dict`` then failed
    mid-training, 'Missing key(s) in state_dict: "net.0.weight_orig", ...')."""
    keys = tuple(trainer.lightning_module.state_dict(keep_vars=True))
    return [[len(g["params"]) for g in opt.param_groups] for opt in trainer.optimizers], keys


def capture(trainer) -> dict:
    """Snapshot of the whole training state after ``trainer.global_step`` steps."""
    comm_state = getattr(trainer.strategy, "comm_local_state_dict", None)
    return {
        "step": trainer.global_step,
        "layout": layout(trainer),
        "model": to_cpu(trainer.lightning_module.state_dict()),
        "optimizers": [to_cpu(opt.state_dict()) for opt in trainer.optimizers],
        "scaler": scaler_state(trainer),
        "strategy": to_cpu(comm_state()) if comm_state is not None else None,
        "averages": [average_state(c) for c in averagers(trainer)],
    }


def restore(trainer, snapshot: dict) -> None:
    """Load ``snapshot`` back; the LRs (and the other :data:`SCHEDULED` entries) stay those of the current step's
    schedule.

    The optimizer state holds the snapshot's LRs; the ones set now are put back, whoever set them (an LR
    scheduler, or a callback that had already set the next step's LR, which ``LearningRateMonitor`` logs at
    the next batch start before that callback sets it again). So are the momentum/betas: ``OneCycleLR``'s step
    after a rollback took the snapshot's beta1 (0.846 for the schedule's 0.888)."""
    hparams = current_hparams(trainer)
    trainer.lightning_module.load_state_dict(snapshot["model"], strict=True)
    for opt, state in zip(trainer.optimizers, snapshot["optimizers"]):
        opt.load_state_dict(copy.deepcopy(state))
    set_hparams(trainer, hparams)
    load_scaler_state(trainer, snapshot["scaler"])
    if snapshot["strategy"] is not None:
        trainer.strategy.load_comm_local_state_dict(to_cpu(snapshot["strategy"]))
    for callback, state in zip(averagers(trainer), snapshot["averages"]):
        load_average_state(callback, state)


class SnapshotRing:
    """The last ``keep`` snapshots; :meth:`pick` returns the newest one at least ``min_age`` steps old."""

    def __init__(self, keep: int = 2) -> None:
        self.snapshots: deque[dict] = deque(maxlen=keep)

    def add(self, trainer) -> None:
        self.snapshots.append(capture(trainer))

    def clear(self) -> None:
        self.snapshots.clear()

    def __len__(self) -> int:
        return len(self.snapshots)

    def pick(self, step: int, min_age: int, current_layout: tuple) -> tuple[dict | None, bool]:
        """(snapshot, old_enough); drops the newer snapshots, which may hold the update that caused the spike, and
        those of another layout (None: no snapshot fits the optimizers and the module now)."""
        fits = [s for s in self.snapshots if s["layout"] == current_layout]
        if len(fits) < len(self.snapshots):
            self.snapshots = deque(fits, maxlen=self.snapshots.maxlen)
        if not fits:
            return None, False
        eligible = [s for s in fits if step - s["step"] >= min_age]
        snap = eligible[-1] if eligible else fits[0]
        while self.snapshots and self.snapshots[-1] is not snap:
            self.snapshots.pop()
        return snap, bool(eligible)
