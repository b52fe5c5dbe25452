"""What :class:`~lit_dtrain.callbacks.loss_spike.LossSpikeMonitor` does with a spike it has decided on: the event is
started before the optimizer step (the step's grads dropped), finished after it (the GradScaler and the strategy's comm
state restored, or a snapshot rolled back to; the spike's samples excluded) and recorded in ``spikes.jsonl``.

:class:`SpikeEvents` holds these methods of the monitor; the monitor's ``__init__`` sets the state they use.
"""

from __future__ import annotations

import logging
import os

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_dtrain.callbacks import _snapshots as snapshots
from lit_dtrain.callbacks import _spike_records as records
from lit_dtrain.callbacks import _spike_step as step_ops
from lit_dtrain.callbacks._spike_samples import check_not_all_excluded, gather_indices

log = logging.getLogger("lit_dtrain.callbacks.loss_spike")

EXCLUDED_SAMPLE = "excluded_sample"


class SpikeEvents:
    """The spike events of :class:`~lit_dtrain.callbacks.loss_spike.LossSpikeMonitor` (see the module docstring)."""

    events_kept = 1000  # events kept in memory (``events``), the latest; spikes.jsonl holds every one
    _buffer_copies: list | None = None  # the last step's buffer copies, written over at the next step's start

    def _supersede_replayed_events(self, trainer: L.Trainer) -> None:
        """A fit that starts at step s replays steps >= s: their records (from a run that died before checkpointing
        them) move from spikes.jsonl to spikes.superseded.jsonl, so each event of the run's history is listed once.
        Also at s = 0: ``resume=auto`` of a run killed before its first checkpoint starts afresh in the same run dir.
        Not under ``fast_dev_run``: a smoke test replays no run of its dir (it moved that run's records aside)."""
        if getattr(trainer, "fast_dev_run", False):
            return
        path = self._events_path(trainer)
        moved = records.supersede_replayed(path, trainer.global_step)
        if moved is not None:
            log.info(f"LossSpikeMonitor: started at step {trainer.global_step}; {moved[0]} record(s) of the replayed "
                     f"steps moved from {path} to {moved[1]}")

    def _set_excluded_device(self, device: torch.device) -> None:
        self._excluded_dev = None  # (none left: cleared by monitor.excluded.clear(), which kept skipping them)
        if self._sampler is None and self.excluded:
            self._excluded_dev = torch.as_tensor(sorted(set(self.excluded)), dtype=torch.long, device=device)

    def _keep_step_buffers(self, pl_module) -> None:
        """At a step's first micro-batch: the module's buffers, put back if the step is dropped (the skipped batch's
        forward moved BatchNorm's running statistics: a corrupt batch's running_var 0.57 -> 371, skipped)."""
        if self._step_buffers is None and {"skip", "rollback"} & set(self.actions):
            # into the previous step's copies (kept from step to step: a new copy a step cost a large buffer its size
            # in page faults); dropped once a restore may have made one of them a buffer, and at the fit's end
            self._step_buffers = self._buffer_copies = step_ops.buffer_values(pl_module, self._buffer_copies)

    def _release_copies(self) -> None:
        """The fit ended or raised: the snapshots and the buffer copies are kept no longer."""
        self.snapshots.clear()
        self._buffer_copies = None

    def _start_event(self, trainer, optimizer, step: int, decision) -> None:
        only_excluded = decision.reasons == [EXCLUDED_SAMPLE]
        actions = ["skip"] if only_excluded else list(self.actions)
        indices = gather_indices(trainer, self._indices)
        drop_step = "skip" in actions or "rollback" in actions
        if drop_step:
            self._saved_scaler = snapshots.scaler_state(trainer)
            step_ops.drop_grads(trainer, optimizer)
            # now, not at batch end: a weight average updated there (Lightning's EMAWeightAveraging, listed before
            # this callback) would take in the dropped forwards' buffers (a rollback then restores the snapshot's)
            step_ops.restore_buffers(trainer.lightning_module, self._step_buffers or [])
            self._buffer_copies = None
        if "lr_cooldown" in actions:
            self.cooldown_start = step + 1 if drop_step else step
        self._pending = {"step": step, "decision": decision, "actions": actions, "indices": indices,
                         "drop": drop_step, "counted": not only_excluded}

    def _finish_event(self, trainer, pl_module, pending: dict) -> None:
        step, actions = pending["step"], pending["actions"]
        rolled_back_to = None
        if "rollback" in actions:
            rolled_back_to = self._rollback(trainer, step)
        if rolled_back_to is None and pending["drop"]:  # skip (or no snapshot): Lightning stepped the GradScaler
            snapshots.load_scaler_state(trainer, self._saved_scaler)
            undo = getattr(trainer.strategy, "undo_comm_step", None)
            if undo is not None:
                undo()
        if pending["counted"]:
            self.num_spikes += 1
            if trainer.is_global_zero and (lasting := records.lasting_run_message(step, self.detector, actions)):
                log.warning(lasting)
        d = pending["decision"]
        event = records.spike_record(step, d, actions, pending["indices"], rolled_back_to, self.lr_multiplier(step + 1))
        self._record(trainer, event, records.spike_message(step, d, actions) if "log" in actions else None)
        # after the record: an exclusion that leaves nothing to train on raises, and the event is still in the file
        to_exclude = list(pending["indices"])
        if pending["drop"] and pending["counted"]:
            if self.exclude_previous_steps:
                for previous in self.recent_indices:
                    to_exclude.extend(previous)
            try:
                self.exclude(sorted(set(to_exclude)), trainer)
            except RuntimeError as e:
                raise RuntimeError(
                    f"LossSpikeMonitor: excluding the samples of the spike at step {step} failed ({self.num_spikes} "
                    f"spikes, {len(self.excluded)} samples excluded in all): {e}{self._see_events(trainer, '. See ')}"
                ) from e

    def _record(self, trainer, event: dict, message: str | None) -> None:
        """Keep the event, append it to spikes.jsonl (rank 0) and, with a message, warn and log a text event."""
        self.events.append(event)
        # one per spike for the whole fit otherwise; spikes.jsonl has them all (not [:-kept]: [:-0] keeps every one)
        del self.events[: max(0, len(self.events) - self.events_kept)]
        if not trainer.is_global_zero:
            return
        if not getattr(trainer, "fast_dev_run", False):  # (a smoke test's, beside its dir's run's: logging is off)
            records.append_record(self._events_path(trainer), event)
        if message:
            log.warning(message)
            for lg in trainer.loggers:
                if hasattr(getattr(lg, "experiment", None), "add_text"):
                    lg.experiment.add_text("spike/events", message, global_step=event["step"])

    def exclude(self, indices: list[int], trainer=None) -> None:
        """Never train on these sample indices again (sampler exclusion, or skipping steps that hold them). With the
        ``trainer``, an exclusion that covers some rank's whole dataset raises on every rank (called in lockstep)."""
        known = set(self.excluded)
        for i in indices:
            if i not in known:
                known.add(i)
                self.excluded.append(int(i))
        if self._sampler is not None:
            self._sampler.exclude(indices)
            return
        self._set_excluded_device(self._device)
        check_not_all_excluded(trainer, known, self._num_train_samples)

    def _events_path(self, trainer) -> str:
        return self.path or os.path.join(trainer.default_root_dir, "spikes.jsonl")

    def _see_events(self, trainer, lead: str) -> str:
        """``lead`` and the events file, for an error to point at; empty under ``fast_dev_run``, which writes none
        (:meth:`_record`): its errors ended 'See <dir>/spikes.jsonl', a file that was not there."""
        return "" if getattr(trainer, "fast_dev_run", False) else f"{lead}{self._events_path(trainer)}"

    # ---- rollback -----------------------------------------------------------------------------------------------
    def _snapshot_if_due(self, trainer, pending: dict | None) -> None:
        """Take the ``snapshot_every`` cadence's snapshot after a step, also one skipped for an excluded sample alone,
        which moved nothing (before, a later rollback went a whole ``snapshot_every`` further back: NaN at 7 and 25,
        every 4, the batch of 7 again at 23, rolled back to 20, not 24); never after a spike, whose weights may hold
        what caused it."""
        if (pending is None or not pending["counted"]) and "rollback" in self.actions and \
                trainer.global_step % self.snapshot_every == 0:
            self.snapshots.add(trainer)

    def _rollback(self, trainer, step: int) -> int | None:
        """Restore the newest snapshot at least ``rollback_min_age`` steps old; returns its step (None: no snapshot
        fits the optimizers' param groups and the module's state keys now, the step is only dropped)."""
        snap, old_enough = self.snapshots.pick(step, self.rollback_min_age, snapshots.layout(trainer))
        if snap is None:  # (a rollback into it failed in torch: "a different number of parameter groups")
            rank_zero_warn(f"LossSpikeMonitor: no snapshot to roll back to at step {step}: the optimizers' param "
                           "groups or the module's state keys changed since the last one (a BaseFinetuning unfreeze "
                           "adds a group, ModelPruning's first prune adds weight_orig and weight_mask); the spike's "
                           "step is dropped as with 'skip', the weights stay; snapshots start again from the next one")
            return None
        if not old_enough:
            rank_zero_warn(f"LossSpikeMonitor: no snapshot {self.rollback_min_age}+ steps older than step {step}; "
                           f"restoring the oldest one (step {snap['step']})")
        snapshots.restore(trainer, snap)
        return int(snap["step"])
