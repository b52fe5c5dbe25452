"""A SIGTERM or SIGHUP before training starts: one line that says so, and the exit status of the signal.

From the trainer's build to ``on_train_start`` (the process group's set-up, the fit's ``setup`` hooks, the checkpoint's
load) no handler of Lightning's or lit_dtrain's own takes a stop signal: its default action ended the process with
-15 (a shell's 143) and no line, on every rank of a fresh start and on every rank but rank 0 of a resume, whose
:class:`~lit_dtrain.logs_kept.LogsKeptUntilTraining` said why. :class:`StopsBeforeTraining` turns it into
:class:`StoppedBeforeTraining`, a ``SystemExit`` of the same status (128 + the signal: what Slurm's and torchrun's
logs read for a stopped task), and :func:`stopped_before_training` says what was stopped, that nothing trained, and
how to run it again.
"""

from __future__ import annotations

import logging
import signal
import threading

import lightning as L

from lit_dtrain.callbacks.preemption import STOP_SIGNALS

log = logging.getLogger("lit_dtrain.logs_kept")  # the logger these lines had on rank 0 of a resume


class StoppedBeforeTraining(SystemExit):
    """A SIGTERM or SIGHUP before training started: exit status 128 + the signal, as its default action's, once the
    logs are put back (a ``SystemExit``, so that no ``except Exception`` takes it for an error)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.said = False  # its line was logged (by the innermost StopsBeforeTraining it left)
        self.world_size: int | None = None  # the launch's, where it is known but may be gone when the line is said

    def __reduce__(self):  # the other ranks raise it too (strategies/_setup_refusals.py): built from the signal
        return type(self), (self.signum,)


class StopsBeforeTraining(L.Callback):
    """A callback and context manager, on every rank: inside it SIGTERM and SIGHUP, where their action is the default,
    raise :class:`StoppedBeforeTraining` until training starts (``on_train_start``), and leaving it by that exception
    logs :func:`stopped_before_training`. Lightning's own handler, once registered, calls this one too (it composes the
    handler it finds): there this one leaves the stop to Lightning's flag. ``resumed_step``: the checkpoint's step, on
    a resume. ``looked_for``: False while a start that may resume (``resume=auto``, ``ckpt_path``) has not yet found
    out whether it does (``train()``'s config checks)."""

    keeps_logs = False  # LogsKeptUntilTraining's: the line says the logs are as they were

    def __init__(self, resumed_step: int | None = None) -> None:
        self.resumed_step = resumed_step
        self.looked_for = True
        self.training_started = False
        self.signalled: int | None = None  # the stop signal its handler raised for (dropped where Python drops it)
        self._agreed = False  # the ranks agreed on their dropped signals (on_train_start)
        self._previous_handlers: dict[int, object] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(trainer, "world_size", 1) > 1 and not self.training_started and not self._agreed:
            # one rank's dropped signal: all stop. Once per fit, for every such callback of this rank together: rank
            # 0 of a resume has two (LogsKeptUntilTraining beside this), the others one; a gather each hung the
            # resume of 2 srun ranks (tests/e2e/test_slurm.py)
            mine = [c for c in trainer.callbacks if isinstance(c, StopsBeforeTraining)]
            agreed = self._agreed_signal(pl_module, max(c.signalled or 0 for c in mine))
            for c in mine:
                c.signalled, c._agreed = agreed, True
        self.cut_stands()

    @staticmethod
    def _agreed_signal(pl_module: L.LightningModule, signum: int) -> int | None:
        """The highest stop signal whose exception Python dropped on any rank (one all-gather per fit): rank 1's alone
        stopped it with 143 while rank 0 trained into a collective that failed, 'error: rank 0: rank 1 was
        interrupted before training (SIGTERM); this rank's next collective then failed at step 0 (...). Resume with
        resume=auto.', exit status 1."""
        import torch

        from lit_dtrain.utils.distributed import all_gather_stacked

        mine = torch.tensor(int(signum), device=getattr(pl_module, "device", "cpu"))
        return int(all_gather_stacked(mine).max()) or None

    def cut_stands(self) -> None:
        """Training started, or the fit returned: a stop signal is no longer this object's. One whose exception Python
        dropped (its handler ran inside a finalizer, 'Exception ignored in: <finalize object ...>': the garbage of a
        sweep's previous job collected as the next started) stops the start here, before training: it was lost, and
        the sweep trained on and exited 0."""
        if self.signalled is not None and not self.training_started:
            raise StoppedBeforeTraining(self.signalled)
        self.training_started = True
        self._restore_handlers()

    def put_back(self) -> None:
        """What a start that ends before training undoes (nothing here)."""

    def __enter__(self) -> StopsBeforeTraining:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if s != signal.SIGINT and signal.getsignal(s) is signal.SIG_DFL:  # (SIGINT raises KeyboardInterrupt)
                    self._previous_handlers[s] = signal.signal(s, self._on_stop_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._restore_handlers()
        if exc_type is not None and not self.training_started:
            self.put_back()
            if isinstance(exc, StoppedBeforeTraining) and not exc.said:
                exc.said = True
                stopped_before_training(exc.signum, self.resumed_step, logs_kept=self.keeps_logs,
                                        looked_for=self.looked_for, world_size=exc.world_size)

    def _on_stop_signal(self, signum, frame) -> None:
        if signal.getsignal(signum) != self._on_stop_signal:  # within Lightning's handler: its flag stops the fit
            return
        if self.training_started:  # put back by Lightning's teardown after the fit: the default action
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signalled = signum
        raise StoppedBeforeTraining(signum)

    def _restore_handlers(self) -> None:
        """Only where this object's handler is still the one installed (Lightning's composes it: left as it is)."""
        if threading.current_thread() is threading.main_thread():
            for s, previous in self._previous_handlers.items():
                if signal.getsignal(s) == self._on_stop_signal:
                    signal.signal(s, previous)


def stopped_before_training(signum: int, resumed_step: int | None, logs_kept: bool = False,
                            looked_for: bool = True, world_size: int | None = None) -> None:
    """The line of a start that a stop signal ended before training (:class:`StoppedBeforeTraining`). Rank 0: what
    was stopped, that nothing trained (on a resume, ``logs_kept``: its logs put back), what to run (the same command;
    a multirun's job: the same -m arguments with its sweep dir), then its labelled exit line, as a stop in training
    has them. Another rank: one line of its own, labelled, that says the same (it keeps no logs): it exited with -15
    and no line while rank 0 said why. Not ``looked_for``: a start that may resume, stopped before it looked for its
    checkpoint, is neither told it is a new run nor which step it resumes from (a resume=auto of a run dir with a
    checkpoint, stopped in the config checks, was told '(a new run) ... run the same command again to start it').
    ``world_size``: the launch's where the process group and ``WORLD_SIZE`` may be gone (a stop while the ranks
    connected: Lightning's teardown deletes ``WORLD_SIZE``, and rank 0's exit line lost its ``[rank: 0]``)."""
    from lightning.pytorch.utilities import rank_zero_only

    from lit_dtrain.sigterm_exit import train_resume_hint
    from lit_dtrain.sweeps import in_multirun
    from lit_dtrain.utils.rank_zero import launched_world_size, rank_labelled

    name = signal.Signals(signum).name
    if not looked_for:
        what, again = " (before it looked for the checkpoint to resume from)", "run the same command again"
    elif resumed_step is not None:
        what, again = f", resuming from step {resumed_step}", f"run the same command again to resume from step " \
            f"{resumed_step}"
    else:
        what, again = " (a new run)", "run the same command again to start it"
    if in_multirun():
        again = f"resume with {train_resume_hint(None)}"
    world = world_size or launched_world_size()
    status = 128 + signum
    if rank_zero_only.rank != 0:
        log.warning(rank_labelled(f"stopped by {name} before training{what}: nothing trained; {again}; exiting with "
                                  f"status {status} (not finished)", world))
        return
    kept = "the logs are as they were" if logs_kept else "no checkpoint written"
    log.warning("stopped by %s before training%s: nothing trained, %s; %s", name, what, kept, again)
    log.info(rank_labelled("exiting with status %d (stopped by %s, not finished)", world), status, name)


def may_resume(cfg) -> bool:
    """Whether a start of ``cfg`` may resume a checkpoint: ``resume``, ``ckpt_path`` or ``decay_branch.ckpt`` set, read
    as written (an interpolation not resolved: the config checks report one that fails)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False)
    branch = raw.get("decay_branch")
    branch_ckpt = branch.get("ckpt") if isinstance(branch, dict) else branch
    return any(value is not None for value in (raw.get("resume"), raw.get("ckpt_path"), branch_ckpt))
