"""Where Lightning's training loop is within an optimizer step, and whether its ``Timer`` can stop it mid-step: one
place for the private names they read."""

from __future__ import annotations

import contextlib
from typing import Any


def mid_accumulation(trainer: Any) -> bool:
    """Whether the micro-batch that just ran is not its optimizer step's last (Lightning's private
    ``_TrainingEpochLoop._should_accumulate``: it steps on an epoch's final batch even mid-accumulation). A stop, a
    checkpoint or a count taken here would split a step: its accumulated gradients are in no checkpoint."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def logging_axis_step(trainer: Any) -> int:
    """The step at which Lightning's logger connector writes a row given no step (a training row, a validation's
    ``val/loss``): its private ``_batches_that_stepped`` (lightning 2.6). A row written with this step explicitly lands
    beside Lightning's own without the ``epoch`` scalar that the connector adds to every row given no step."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def lightnings_timer_splits_steps(trainer: Any) -> int | None:
    """The largest ``accumulate_grad_batches`` of a fit whose time limit is Lightning's own ``Timer``
    (``Trainer(max_time=...)``) checked per batch: it stops between micro-batches, mid-step; None where it cannot
    (no such timer, one micro-batch a step, or ``lit_dtrain.callbacks.StepEndTimer``, which waits for the step's
    end). Reads the ``Timer``'s private ``_duration`` and ``_interval`` (lightning 2.6)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler, Timer

    if not any(type(c) is Timer and c._duration is not None and c._interval == "step" for c in trainer.callbacks):
        return None
    most = max([int(trainer.accumulate_grad_batches or 1)] + [
        max(c.scheduling.values()) for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)])
    return most if most > 1 else None


def reopen_stopped_epoch(checkpoint: dict) -> bool:
    """Rewrite the fit loop's progress in a checkpoint written after a stop that closed its epoch mid-way (Lightning
    ends the epoch at ``trainer.should_stop``) into that of a checkpoint taken at the stopping batch's end, mid-epoch,
    the form ``PreemptionCheckpoint``'s file has; True where it did. Resumed from the closed form, a fit under
    ``max_epochs`` started the next epoch and never trained the rest of the stopped one (10 of 12 steps). Reads
    Lightning's private loop state (lightning 2.6): leaves any other form as it is."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    loop_state = fit.get("epoch_loop.state_dict")
    if not (epochs and batches and isinstance(loop_state, dict)):
        return False
    e, b = epochs["total"], batches["total"]
    closed = e["ready"] == e["started"] == e["processed"] and e["completed"] in (e["processed"] - 1, e["processed"])
    if not closed or not b["ready"] == b["started"] == b["processed"] == b["completed"] or b["completed"] == 0:
        return False
    for part in ("total", "current"):
        epochs[part]["processed"] = epochs[part]["completed"] = epochs[part]["started"] - 1  # the epoch runs on
        batches[part]["completed"] -= 1  # saved at the stopping batch's end (Lightning completes it on restart)
    loop_state["_batches_that_stepped"] = max(loop_state.get("_batches_that_stepped", 1) - 1, 0)  # (restart adds 1)
    return True


def reopen_epoch_end(checkpoint: dict) -> bool:
    """Rewrite a checkpoint written at the end of an epoch that ran its DataLoader to the end, in
    ``on_train_epoch_end`` (``ModelCheckpoint``'s default save point, where Lightning has counted the epoch processed
    but not completed), into the form of a save at that epoch's last batch end; True where it did. A fit under
    ``max_steps`` restarts from the first form "on epoch end": it ended that epoch again and counted it twice, so every
    later epoch ran one ahead (a ``DistributedSampler`` drew the next epoch's order, epochs 2, 3 where the straight run
    drew 1, 2; with ``max_epochs`` too the fit ended an epoch early, 8 of 12 steps, and without a validation it trained
    a batch more); from the second it resumes as the straight run. A fit resumed from the second form leaves its
    epochs' ``ready``/``started`` one behind in its later saves, so only ``completed`` is read. Reads Lightning's
    private loop state (lightning 2.6): leaves any other form as it is."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    loop_state = fit.get("epoch_loop.state_dict")
    if not (epochs and batches and isinstance(loop_state, dict) and batches.get("is_last_batch")):
        return False
    e, b = epochs["total"], batches["total"]
    if e["processed"] != e["completed"] + 1 or not b["ready"] == b["started"] == b["processed"] == b["completed"] > 0:
        return False
    for part in ("total", "current"):
        ended = epochs[part]["completed"]  # the epoch the save ended, 0-based
        epochs[part].update(ready=ended + 1, started=ended + 1, processed=ended)
        batches[part]["completed"] -= 1  # saved at the last batch's end (Lightning completes it on restart)
    loop_state["_batches_that_stepped"] = max(loop_state.get("_batches_that_stepped", 1) - 1, 0)  # (restart adds 1)
    return True


def fit_position(trainer) -> str:
    """Where in ``trainer``'s fit a failure came, for the ranks' lines: `` at step N``; before training started (the
    checkpoint's load), `` before training, resuming from step N`` (``trainer.ckpt_path``'s): ``global_step`` is 0
    until the loops are restored, so a step-4 checkpoint rank 1 alone refused read 'rank 1 stopped at step 0'. A
    strategy that does not say when training started (not ``utils.distributed.RankFailureRecords``): `` at step N``."""
    fitting = getattr(getattr(trainer, "state", None), "fn", "fit") == "fit"
    if not fitting or getattr(trainer.strategy, "training_started", True):
        return f" at step {trainer.global_step}"  # (train()'s final validate too)
    resumed = trainer.global_step or None  # the loops restored, training not started yet
    with contextlib.suppress(Exception):  # the line of an error on its way: no step rather than another error
        from lit_dtrain.checkpoint import checkpoint_global_step

        resumed = resumed or (checkpoint_global_step(trainer.ckpt_path, verify=False) if trainer.ckpt_path else None)
    return " before training" + (f", resuming from step {resumed}" if resumed is not None else "")


def epoch_ends_and_fit_goes_on(trainer: Any) -> bool:
    """Whether the batch just trained (or the validation after it) ends an epoch that another epoch follows: the
    epoch's last batch (Lightning's private ``_num_ready_batches_reached``; never in a stream without an end), and
    no ``max_steps``, ``max_epochs`` or early stop (that ``min_steps``/``min_epochs`` allow: the private
    ``_can_stop_early``) ends the fit there. The same on every rank (their epochs are as long; ``EarlyStopping``
    agrees its stop)."""
    loop = trainer.fit_loop

    def reached(count: int, limit: Any) -> bool:
        return isinstance(limit, int) and limit >= 0 and count >= limit

    if not loop.epoch_loop._num_ready_batches_reached():
        return False
    if reached(trainer.global_step, trainer.max_steps) or reached(trainer.current_epoch + 1, trainer.max_epochs):
        return False
    return not (trainer.should_stop and loop._can_stop_early)
