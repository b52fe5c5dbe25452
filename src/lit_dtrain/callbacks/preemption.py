"""Save a checkpoint and stop cleanly on SIGTERM, so a preempted or cancelled job can be requeued; on SIGINT
(Ctrl-C) and SIGHUP (a closed terminal or ssh session) alike.

Lightning catches SIGTERM (its signal connector sets ``trainer.received_sigterm``; after the current batch it
raises ``SIGTERMException``, a clean ``SystemExit``) but saves nothing outside SLURM's auto-requeue. This
callback writes ``last.ckpt`` at the end of the optimizer step during which the signal came, then lets
Lightning exit, so ``resume=auto`` continues exactly from there (after a validation that ends that step, which
runs in full: ``ModelCheckpoint`` saves that step's file). The file is ``ModelCheckpoint(save_last=True)``'s own
last checkpoint.

- **The validation that ends an epoch.** A signal during it (after the epoch's last step, another epoch to follow)
  is saved at its end (``on_validation_end``, where ``ModelCheckpoint`` saves: Lightning resumes that state at the
  epoch's boundary), agreed by the ranks as at a step's end. It was saved at the next epoch's first step, mid-epoch,
  which Lightning does not resume exactly on a plain ``DataLoader`` (it restarts the epoch's data): 0.013 off.
- **Gradient accumulation.** A checkpoint in the middle of an optimizer step would lose the grads accumulated
  so far, so a signal that comes mid-accumulation is acted on at the step's last micro-batch (at most
  ``accumulate_grad_batches - 1`` micro-batches later).
- **Manual optimization.** A module that accumulates by hand (``manual_backward`` every batch, ``opt.step()`` every
  ``k``-th) holds gradients of no update yet between its steps, and Lightning knows nothing of its windows: a save
  there lost them (the resumed run's next update had only the batches after the resume; its weights then differed
  from a straight run's). After a ``manual_backward`` that no ``optimizer.step`` has followed yet, in a batch without
  a step, the save waits for the batch whose step takes them (on every rank, agreed as the signal is).
- **Last of the callbacks.** Other callbacks finish the step in their ``on_train_batch_end`` (``LossSpikeMonitor``
  undoes a dropped step in the compressor's residual, excludes its samples, rolls back; ``FourierSamplerCallback``
  feeds the step's losses to the sampler), so the save must come after them. Lightning calls callbacks in list
  order, and ``callbacks=[default,loss_spike]`` puts this one first: at ``setup`` it moves itself to the end of
  ``trainer.callbacks`` (before, a SIGTERM during a skipped spike's step saved the step unfinished, and the
  resumed run applied the spike's gradient from the error-feedback residual and trained on its samples again).
- **Several ranks.** Saving is collective, so every rank must decide at the same batch. The signal reaches the ranks
  at different moments (or only some of them), and Lightning's own handler runs a broadcast inside the signal
  handler, which can interleave with the ranks' other collectives and hang them. So while training (from the first
  callback's ``on_train_start``: it puts a companion first of the callbacks at ``setup``; a SIGTERM in an earlier
  callback's hook ran Lightning's handler on both ranks, twice on rank 1, and they waited in unlike collectives
  until ``collective_timeout_s``), this callback's handler replaces Lightning's: it only records the signal (and
  forwards it to child ranks, as Lightning does); at the last micro-batch of every optimizer step the ranks agree
  with one tiny all-reduce (any rank signalled; mid-accumulation a signal is only noted, as a save must wait for the
  step's end anyway), save at the same step, and then set Lightning's flag
  (``trainer._signal_connector.received_sigterm``, which has no public setter) on every rank, so all ranks leave the
  loop at the same batch.
- **Ctrl-C and a closed terminal.** SIGINT and SIGHUP are handled as SIGTERM during training, and ``train()`` exits
  with 128 + the signal (130, 129). Before, Ctrl-C went to Lightning's ``KeyboardInterrupt`` path (exit status 1,
  nothing saved: every step since the last validation was lost without a word) and SIGHUP killed the process. A
  second Ctrl-C while the save is pending raises ``KeyboardInterrupt`` at once, Lightning's hard stop. SIGINT is not
  forwarded to the child ranks: a terminal sends it to the whole process group, and a forwarded copy would be that
  rank's "second Ctrl-C"; a rank that did not get it stops anyway, as the ranks agree on "any rank signalled".
  SIGQUIT keeps its default (a core dump at once), the conventional hard stop. A signal that is ignored when
  training starts stays ignored: SIGHUP under ``nohup``, SIGINT in a background job of a non-interactive shell.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, is_path
from lit_dtrain.utils.distributed import all_gather_stacked
from lit_dtrain.utils.loop import epoch_ends_and_fit_goes_on, lightnings_timer_splits_steps, mid_accumulation

# the signals that stop a run at the end of the current optimizer step, with last.ckpt saved
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)  # (no SIGHUP on Windows)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM (SIGINT, SIGHUP), save ``<dirpath>/<filename>`` (default ``last.ckpt``) at the end of the current
    optimizer step. Its log line says how to resume: ``resume_hint`` (``train()`` gives the ones built from its
    config its own, ``resume=auto``), by default ``trainer.fit(..., ckpt_path=<the file>)``."""

    def __init__(self, dirpath: str, filename: str = "last.ckpt", resume_hint: str | None = None) -> None:
        # checked now: a bad one failed only when SIGTERM came, in os.path.join, and saved nothing
        check_arg("PreemptionCheckpoint", "dirpath", dirpath, is_path, "a directory path (where SIGTERM saves)")
        check_arg("PreemptionCheckpoint", "filename", filename, is_path, "a file name such as 'last.ckpt'")
        if resume_hint is not None:
            check_arg("PreemptionCheckpoint", "resume_hint", resume_hint, lambda v: isinstance(v, str), "a string")
        self.dirpath, self.filename, self.resume_hint = dirpath, filename, resume_hint
        self.saved_step: int | None = None
        self.signalled = False  # this process (or, after the agreement, any rank) got a stop signal
        self.signum: int | None = None  # the first stop signal this process got (None: none, or another rank's)
        self._previous_handlers: dict | None = None  # None: no fit's handlers in (take_signals puts them in)
        self._trainer: L.Trainer | None = None
        self._holding = False  # Lightning's flag, held back during the validation that ends the saved step
        self._manual = False  # the module optimizes by hand (read at train start)
        self._unstepped = False  # manual optimization: a backward ran since the last optimizer step (grads in flight)
        self._stepped = False  # manual optimization: an optimizer step ran in this batch

    def _on_sigterm(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without waiting for the save
        if not self.signalled and signum != signal.SIGINT:
            launcher = self._trainer.strategy.launcher if self._trainer is not None else None
            if launcher is not None:
                launcher.kill(signum)  # forward to the child ranks this process launched, as Lightning does
        if self.signum is None:
            self.signum = signum
        self.signalled = True

    @override
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        # A new list, not an in-place move: Lightning is iterating over the current one to call this hook.
        others = [c for c in trainer.callbacks if c is not self and getattr(c, "owner", None) is not self]
        # the handler goes in once Lightning has registered its own (_RegistersThenTakes), else at the first
        # on_sanity_check_start or on_train_start (_TakesSignalsFirst): Lightning's, registered before it,
        # broadcasts inside the handler on several ranks; a SIGTERM in an earlier callback's on_train_start reached
        # it once on rank 0 and twice on rank 1 (its own and rank 0's forwarded copy), an extra broadcast that the
        # next collective met: the ranks waited in unlike collectives until collective_timeout_s, 1800 s by default
        trainer.callbacks = ([_TakesSignalsFirst(self)] if stage == "fit" else []) + others + [self]
        if stage == "fit":
            _take_signals_once_registered(self, trainer)
        if stage == "fit" and (accumulate := lightnings_timer_splits_steps(trainer)):
            rank_zero_warn(
                f"PreemptionCheckpoint saves at an optimizer step's end, but Lightning's Timer (Trainer(max_time=...)) "
                f"checks at every micro-batch: with accumulate_grad_batches={accumulate} it stops between them, and "
                "the checkpoint of that stop holds a step half accumulated (the resumed fit's first step is short). "
                "Pass callbacks=[lit_dtrain.callbacks.StepEndTimer(duration=...)] in place of max_time"
            )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self._manual, self._unstepped = not pl_module.automatic_optimization, False
        self.take_signals(trainer)  # (done already by _TakesSignalsFirst, first of the callbacks)

    @override
    def on_sanity_check_end(self, trainer: L.Trainer, pl_module) -> None:
        """A stop signal in the sanity check (only recorded, from its start) stops every rank here, together, before
        training: Lightning's handler broadcast inside the handler there, once on rank 0 and twice on rank 1 (its own
        signal and rank 0's forwarded copy), and 2 gloo ranks waited in unlike collectives until collective_timeout_s,
        then exited with 1. One all-reduce per fit."""
        signum = self.signum or (signal.SIGTERM if self.signalled else 0)  # (Lightning's flag: SIGTERM)
        if trainer.world_size > 1:  # the highest signal of the ranks that got one
            mine = torch.tensor(int(signum), device=getattr(pl_module, "device", "cpu"))
            signum = int(all_gather_stacked(mine).max())
        if signum:
            self.signalled, self.signum = True, signum
            raise SIGTERMException

    def take_signals(self, trainer: L.Trainer) -> None:
        """From here on a stop signal is only recorded, once per fit (as soon as Lightning has registered its handler:
        :class:`_RegistersThenTakes`; else at the first callback's ``on_sanity_check_start`` or ``on_train_start``)."""
        if self._trainer is trainer and self._previous_handlers is not None:
            return
        self._trainer = trainer
        # a new fit (this object reused): a signal of an earlier fit is not this one's
        self.signalled, self.saved_step, self.signum, self._holding = False, None, None, False
        # one that Lightning's handler took before this (its flag) is this one's: on several ranks the flag of rank
        # 0 stopped every rank at the first batch's start (Lightning's broadcast of it), with no checkpoint
        if trainer.received_sigterm:
            self.signalled = True
            trainer._signal_connector.received_sigterm = False
        self._previous_handlers = {}
        if threading.current_thread() is threading.main_thread():
            # an ignored signal stays ignored: `nohup python train.py` asked a logout's SIGHUP not to stop the run
            # (it stopped it, with 129), a background job of a non-interactive shell ignores the terminal's SIGINT
            self._previous_handlers = {
                s: signal.signal(s, self._on_sigterm) for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN
            }
        else:  # (a fit in a thread took a SIGTERM with the process's default: killed, 143, no file and no word)
            rank_zero_warn(
                f"PreemptionCheckpoint: this fit runs in thread {threading.current_thread().name!r}, not the main "
                "thread, and Python installs signal handlers only from the main thread: a SIGTERM (SIGINT, SIGHUP) "
                f"is not caught here and saves nothing in {self.dirpath}; call trainer.fit from the main thread"
            )

    def _restore_handler(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s, previous in (self._previous_handlers or {}).items():
                if previous is not None:
                    signal.signal(s, previous)
        self._previous_handlers = None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._restore_handler()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module) -> None:
        # The validation that ends the step just saved runs in full, and the fit stops after it (Lightning reads its
        # flag there). The flag cut it after its first batch, and the resumed run did not do it again (Lightning
        # takes the step as validated): no val/loss at that step, and no ModelCheckpoint file of it, a best missed.
        if trainer.state.fn == "fit" and self.saved_step == trainer.global_step and trainer.received_sigterm:
            self._holding = True
            trainer._signal_connector.received_sigterm = False

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module) -> None:
        if self._holding:
            self._holding = False
            trainer._signal_connector.received_sigterm = True
        elif trainer.state.fn == "fit" and not trainer.sanity_checking and epoch_ends_and_fit_goes_on(trainer):
            # A signal during the validation that ends an epoch (after the epoch's last step, when another epoch
            # follows): saved here, at the epoch's boundary, where Lightning's own ModelCheckpoint saves. It was
            # saved at the next epoch's first step: mid-epoch, which a plain DataLoader does not resume exactly
            # (the resumed fit ended 0.013 off the straight one). Lightning then ends the epoch and stops.
            self._agree_and_save(trainer, pl_module, self.signalled or trainer.received_sigterm)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._restore_handler()
        if isinstance(exception, SIGTERMException) and self.signum in (signal.SIGINT, getattr(signal, "SIGHUP", None)):
            # Lightning's SystemExit, status 0: in a project of one's own, Ctrl-C (exit status 1 from Lightning's
            # KeyboardInterrupt path before this callback handled it) would read as a finished run
            exception.code = 128 + self.signum

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        self._stepped = False

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module) -> None:
        self._unstepped = True  # (under automatic optimization Lightning's own accumulation count is read instead)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module, optimizer) -> None:
        self._unstepped, self._stepped = False, True

    def _wait(self, trainer: L.Trainer) -> None:
        """Keep the signal for a later batch end: Lightning's flag would stop the loop after this batch."""
        self.signalled = True
        trainer._signal_connector.received_sigterm = False

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        signalled = self.signalled or trainer.received_sigterm  # Lightning's flag: a signal before on_train_start
        if mid_accumulation(trainer):  # mid-accumulation: finish the optimizer step first
            if signalled:  # kept for the step's last micro-batch, where the ranks agree (one all-reduce per step)
                self._wait(trainer)
            return
        self._agree_and_save(trainer, pl_module, signalled)

    def _agree_and_save(self, trainer: L.Trainer, pl_module, signalled: bool) -> None:
        """At an optimizer step's end (or the validation that ends an epoch), on every rank: agree on whether any
        rank got a signal and, if one did, save and set Lightning's flag."""
        if trainer.world_size > 1:
            signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
        # a signal whose handler ran during the all-reduce (it waits for the slowest rank) is kept for the next step's
        # agreement; assigning the agreed value dropped it, and that run trained on to its end without a checkpoint
        self.signalled = signalled or self.signalled
        if not signalled or self.saved_step == trainer.global_step:
            return
        if self._manual:  # accumulating by hand: save after the step that takes the grads
            # (a batch that stepped is an update's end, also where the backward comes after the step: a module that
            # steps the previous batches' grads first would otherwise never reach a save)
            unstepped = self._unstepped and not self._stepped
            if trainer.world_size > 1:  # (every rank is here: the signal was agreed)
                unstepped = trainer.strategy.reduce_boolean_decision(unstepped, all=False)
            if unstepped:
                self._wait(trainer)
                return
        if trainer.world_size > 1:  # and on the signal: a rank that got none exits with the others' 130, not 143
            mine = torch.tensor(self.signum or 0, device=getattr(pl_module, "device", "cpu"))
            self.signum = int(all_gather_stacked(mine).max()) or None
        path = os.path.join(self.dirpath, self.filename)
        name = signal.Signals(self.signum or signal.SIGTERM).name  # None: another rank's signal
        if getattr(trainer, "fast_dev_run", False):  # Lightning suppresses checkpointing (a smoke test's file
            # replaced a real run's last.ckpt in the same dirpath)
            trainer._signal_connector.received_sigterm = True
            rank_zero_info(f"{name} received: fast_dev_run saves no checkpoint ({path} left as it is); exiting.")
            return
        _adopt_as_last(trainer, path)  # before the save: the ModelCheckpoint state in the file says so too
        before = _file_identity(path)
        trainer.save_checkpoint(path, weights_only=False)  # every rank calls it; rank 0 writes; full state
        self.saved_step = trainer.global_step
        trainer._signal_connector.received_sigterm = True  # every rank leaves the loop after this batch
        # (train()'s resume=auto is no setting in a project of one's own, where this line named it all the same)
        if rank_zero_only.rank == 0 and _file_identity(path) == before:  # AtomicCheckpointIO skipped the save
            resumes = what_resumes(self.dirpath, self.resume_hint)
            rank_zero_info(f"{name} received: no checkpoint saved at step {trainer.global_step} (its weights are not "
                           f"finite: see the warning above); exiting cleanly. {resumes}")
            return
        hint = self.resume_hint if self.resume_hint is not None else f"trainer.fit(..., ckpt_path={path!r})"
        rank_zero_info(
            f"{name} received: saved {path} at step {trainer.global_step}; exiting cleanly. Resume with {hint}."
        )


class _TakesSignalsFirst(L.Callback):
    """First of the callbacks (``PreemptionCheckpoint`` puts it there at ``setup``): its owner takes the stop signals
    before any other callback's ``on_train_start`` runs."""

    def __init__(self, owner: PreemptionCheckpoint) -> None:
        self.owner = owner

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module) -> None:
        self.owner.take_signals(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.owner.take_signals(trainer)


class _RegistersThenTakes:
    """Lightning's ``register_signal_handlers``, then its owner takes the signals: Lightning registers its handler just
    before the strategy's ``barrier("run-stage")`` and the data's setup, where no callback hook runs; a SIGTERM to rank
    0 there ran Lightning's handler, which broadcasts inside itself, once on rank 0 and twice on rank 1 (its own and
    rank 0's forwarded copy): 2 gloo ranks waited in unlike collectives until collective_timeout_s and exited 1."""

    def __init__(self, register, owner: PreemptionCheckpoint, trainer: L.Trainer) -> None:
        self.register, self.owner, self.trainer = register, owner, trainer

    def __call__(self) -> None:
        self.register()
        if self.trainer.state.fn == "fit":  # (a later validate or test of this trainer registers its handler too)
            self.owner.take_signals(self.trainer)


def _take_signals_once_registered(owner: PreemptionCheckpoint, trainer: L.Trainer) -> None:
    connector = getattr(trainer, "_signal_connector", None)  # (Lightning's, private; a stand-in trainer has none)
    register = getattr(connector, "register_signal_handlers", None)
    if register is None:
        return
    if isinstance(register, _RegistersThenTakes):  # an earlier fit's (this trainer fitted again)
        register = register.register
    connector.register_signal_handlers = _RegistersThenTakes(register, owner, trainer)


def _file_identity(path: str) -> tuple | None:
    """What changes when a file is written at ``path`` (an atomic write renames a new inode over it); None: none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def what_resumes(dirpath: str, resume_hint: str | None) -> str:
    """Which checkpoint of ``dirpath`` a resume continues where the stop saved none: the newest with finite weights
    (``resume=auto``'s choice; ``resume_hint``: train()'s, None in a project of one's own)."""
    from lit_dtrain.checkpoint import checkpoint_global_step
    from lit_dtrain.resume import newest_step_checkpoint  # (it imports the config machinery: only when needed)

    newest = newest_step_checkpoint(Path(dirpath)) if os.path.isdir(dirpath) else None
    if newest is None:
        return f"{dirpath} holds no resumable checkpoint: a resume has nothing to continue"
    step = checkpoint_global_step(newest, verify=False)
    newest_is = f"The newest finite checkpoint is {newest} (step {step})"
    if resume_hint is None:
        return f"{newest_is}: resume with trainer.fit(..., ckpt_path={str(newest)!r})"
    return f"{newest_is}, which resume=auto continues: resume with {resume_hint}"


def _adopt_as_last(trainer: L.Trainer, path: str) -> None:
    """Make ``path`` the ``last_model_path`` of each ``ModelCheckpoint(save_last=True)`` whose last checkpoint is that
    file. ModelCheckpoint overwrites only a last checkpoint it wrote itself and versions any other: after a stop
    before the first validation (or in a step that ends with one), it wrote ``last-v1.ckpt`` at every later
    validation of the resumed run (``last-v2.ckpt`` after another stop), a full copy each time, beside this
    callback's ``last.ckpt``, and left the step file of a validation the resumed run did again behind."""
    for c in trainer.checkpoint_callbacks:
        if not isinstance(c, ModelCheckpoint) or c.save_last is not True or not c.dirpath:
            continue
        if os.path.abspath(os.path.join(c.dirpath, c.CHECKPOINT_NAME_LAST + c.FILE_EXTENSION)) == os.path.abspath(path):
            c.last_model_path = path
