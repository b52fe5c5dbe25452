"""How ``train(cfg)`` ends when SIGTERM stops it: with exit status 143 (:data:`PREEMPTED_EXIT_STATUS`), not
Lightning's 0, on every rank together.

``lit_dtrain.callbacks.PreemptionCheckpoint`` saves a checkpoint during ``fit``; this module is ``train()``'s side:
the exit status and its log lines (:func:`stopped_by_sigterm`), a signal that came during the last validation,
which nothing acted on (:func:`sigterm_after_the_last_step`), the callback that holds a SIGTERM back during
``train()``'s final ``trainer.validate`` until every rank has finished it (:class:`HoldSigtermInValidate`), and
the handler that records one between ``fit`` and that validation (:class:`SigtermRecorder`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only

from lit_dtrain.callbacks.preemption import STOP_SIGNALS, PreemptionCheckpoint, what_resumes
from lit_dtrain.checkpoint import checkpoint_global_step
from lit_dtrain.resume import newest_step_checkpoint
from lit_dtrain.utils.distributed import all_gather_stacked
from lit_dtrain.utils.launcher_watch import kill_launched_ranks
from lit_dtrain.utils.rank_zero import launched_world_size, log_once, rank_labelled

log = logging.getLogger("lit_dtrain.train")  # train(cfg)'s logger: its lines in train.log read as before the split


PREEMPTED_EXIT_STATUS = 128 + signal.SIGTERM  # 143: what a shell reports for a process that SIGTERM ended
INTERRUPTED_EXIT_STATUS = 128 + signal.SIGINT  # 130: Ctrl-C


TRAIN_RESUME_HINT = (  # train(cfg) outside Hydra: its caller chose the run dir
    "resume=auto (same run_name; a multirun job: the same -m arguments with hydra.sweep.dir=<its sweep dir>) or "
    "ckpt_path=<that file>"
)


def train_resume_hint(run_name) -> str:
    """How to resume this run, with its own names: a multirun job ``the same -m arguments and resume=auto
    'hydra.sweep.dir=<this sweep's dir>'``, a single run ``resume=auto run_name=<its name>`` (the default names are
    start times, which the line gave as '<its sweep dir>' and 'same run_name' to look up); outside Hydra
    :data:`TRAIN_RESUME_HINT`."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    from lit_dtrain.sweeps import in_multirun, sweep_dir_of

    if in_multirun():  # job N trains in <sweep dir>/N, or deeper (sweeps.pin_sweep_dir reads it the same way)
        sweep = sweep_dir_of(HydraConfig.get())
        return f"the same -m arguments and resume=auto {shlex.quote(f'hydra.sweep.dir={sweep}')}"
    if HydraConfig.initialized() and run_name is not None:
        return f"resume=auto {shlex.quote(f'run_name={run_name}')} or ckpt_path=<that file>"
    return TRAIN_RESUME_HINT


def hint_train_resume(callbacks: list[L.Callback], run_name=None) -> None:
    """Give each ``PreemptionCheckpoint`` that has no ``resume_hint`` of its own ``train()``'s way to resume,
    ``resume=auto`` (its default names ``trainer.fit(..., ckpt_path=...)``, a project of one's own):
    :func:`train_resume_hint`."""
    for c in callbacks:
        if isinstance(c, PreemptionCheckpoint) and c.resume_hint is None:
            c.resume_hint = train_resume_hint(run_name)


def stop_signal(trainer: L.Trainer) -> signal.Signals:
    """The signal that stopped the fit: the one ``PreemptionCheckpoint`` got (SIGINT for Ctrl-C, SIGHUP for a
    closed terminal), else the one :class:`SigtermRecorder` got after fit (a SIGHUP while last.ckpt was saved or in
    the final validation was named SIGTERM, exit 143), else SIGTERM (Lightning's flag, or another rank's signal)."""
    for c in trainer.callbacks:
        if isinstance(c, PreemptionCheckpoint) and c.signum is not None:
            return signal.Signals(c.signum)
    for c in trainer.callbacks:
        if isinstance(c, SigtermRecorder) and c.signalled:
            return signal.Signals(c.signum)
    return signal.SIGTERM


def stopped_by_sigterm(trainer: L.Trainer, saved_last: bool = False, run_name=None, ckpt_dir: str | None = None) -> int:
    """The exit status of a fit that SIGTERM stopped (Lightning raises ``SIGTERMException``, a ``SystemExit`` with
    status 0): 143, or 128 + the signal for SIGINT and SIGHUP, which ``PreemptionCheckpoint`` handles alike. A
    preempted run has not finished: status 0 let ``train.py && next`` and SLURM's ``afterok`` go on as if it had,
    and a multirun stopped mid-sweep looked complete. Says whether a checkpoint was saved (``saved_last``: train()
    saved the final ``last.ckpt``; never under ``fast_dev_run``, which saves none) and how to resume this run
    (``run_name``: train()'s, for :func:`train_resume_hint` where no ``PreemptionCheckpoint`` holds the hint); without
    a checkpoint of the stop, which file of ``ckpt_dir`` (train()'s ``paths.checkpoint_dir``) a resume continues
    from."""
    name = stop_signal(trainer).name
    if getattr(trainer, "fast_dev_run", False):  # train() saves no last.ckpt of a smoke test: the line said it did
        saved_last = False
        ckpt_dir = ckpt_dir or next((c.dirpath for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
    # with this run's names, as PreemptionCheckpoint's line: a multirun job's bare resume=auto is refused (it needs
    # hydra.sweep.dir), and a single run's starts a fresh run under a new default name
    hints = [c.resume_hint for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint) and c.resume_hint]
    hint = hints[0] if hints else train_resume_hint(run_name)
    if saved_last:  # facts of the run, the same on every rank (they agree on the signal): rank 0 says them
        log_once(
            log, logging.WARNING,
            "stopped by %s after the last step (%d), whose last.ckpt is saved: resume with %s to validate it and "
            "write summary.json",
            name,
            trainer.global_step,
            hint,
        )
    elif not any(isinstance(c, PreemptionCheckpoint) and c.saved_step is not None for c in trainer.callbacks):
        if ckpt_dir is not None and rank_zero_only.rank == 0:  # names the file before the hint's ckpt_path=<that
            resumes = what_resumes(ckpt_dir, hint)  # file>, which came first and named none (rank 0 reads the files)
        else:
            resumes = f"to continue from the last validation's checkpoint, if any, resume with {hint}"
        log_once(
            log, logging.WARNING,
            "stopped by %s at step %d without a checkpoint (%s): %s",
            name,
            trainer.global_step,
            _why_no_checkpoint(trainer),
            resumes,
        )
    status = 128 + stop_signal(trainer)
    # each process's own exit, labelled with its rank: under torchrun the workers write to one train.log (a stand-in
    # trainer in a unit test may have no world_size)
    line = rank_labelled("exiting with status %d (stopped by %s, not finished)", getattr(trainer, "world_size", 1))
    log.info(line, status, name)
    return status


def _why_no_checkpoint(trainer: L.Trainer) -> str:
    """Why a signal stop saved no checkpoint: a PreemptionCheckpoint among the callbacks saved none under
    ``fast_dev_run`` or when no training step ended after the signal (one in the sanity check), which the line called
    '(no PreemptionCheckpoint among the callbacks)' all the same."""
    if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
        return "no PreemptionCheckpoint among the callbacks"
    if getattr(trainer, "fast_dev_run", False):
        return "fast_dev_run: PreemptionCheckpoint saves none"
    return "PreemptionCheckpoint saves at a training step's end, and none ended after the signal"


def sigterm_after_the_last_step(trainer: L.Trainer) -> bool:
    """Whether a SIGTERM came during fit's last validation, which nothing acted on: ``PreemptionCheckpoint``'s
    handler only records it (it saves at the end of a batch, and none ends after the last validation), and
    Lightning's flag is read before validation batches but the last; or during ``train()``'s final validation,
    which :class:`HoldSigtermInValidate` lets finish; or between them (:class:`SigtermRecorder`). The ranks agree
    (one all-reduce), so that all of them stop, or none."""
    pending = trainer.received_sigterm or any(
        isinstance(c, (PreemptionCheckpoint, HoldSigtermInValidate, SigtermRecorder)) and c.signalled
        for c in trainer.callbacks
    )
    stop = bool(trainer.strategy.reduce_boolean_decision(pending, all=False))
    if stop and trainer.world_size > 1:
        _agree_on_the_signal(trainer, stop_signal(trainer) if pending else 0)
    return stop


def _agree_on_the_signal(trainer: L.Trainer, signum: int) -> None:
    """Give every rank's ``PreemptionCheckpoint`` the highest signal of the ranks that got one (``signum``: this
    rank's, 0 for none), as the callback's own agreement in training does: after Ctrl-C to one rank in fit's last
    validation that rank exited with 130 and the others, which got no signal, with 143 (SIGTERM's)."""
    mine = torch.tensor(int(signum), device=trainer.strategy.root_device)
    agreed = int(all_gather_stacked(mine).max())
    for c in trainer.callbacks:
        if isinstance(c, PreemptionCheckpoint):
            c.signum = agreed


class HoldSigtermInValidate(L.Callback):
    """During ``train()``'s final ``trainer.validate`` a SIGTERM is only recorded (``signalled``): the validation
    finishes on every rank, then ``train()`` has the ranks agree (:func:`sigterm_after_the_last_step`) and exit with
    143 together. Lightning's own handler broadcasts from inside the handler, and its evaluation loop stops the
    signalled rank alone at its next batch: under DDP the other ranks waited for it in the epoch-end metric
    reduction until ``strategy.collective_timeout_s`` (30 min by default) and failed with a timeout, exit status 1.
    Inert in fit's validations (``PreemptionCheckpoint`` handles a SIGTERM there) and in a single process, where
    Lightning's early stop involves no other rank."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        self.signalled = True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        main_thread = threading.current_thread() is threading.main_thread()
        if trainer.state.fn != "validate" or trainer.world_size == 1 or not main_thread:
            return
        self.signalled = trainer.received_sigterm  # one before this hook: Lightning's flag would stop this rank alone
        trainer._signal_connector.received_sigterm = False
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)  # after Lightning registered its own

    def _restore_handler(self) -> None:
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handler()  # after the epoch-end metric reduction

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handler()


def interrupted_by_ctrl_c(checkpoint_dir: str, ckpt_path=None, key: str = "ckpt_path") -> int:
    """The exit status (130) of a run that ``KeyboardInterrupt`` (Ctrl-C) stopped where nothing saves: before training,
    in the token cache build, in setup, at a second Ctrl-C, in the final validation or the sample (a traceback, or
    Lightning's "Detected KeyboardInterrupt" and status 1, did not say what was kept). One line says which checkpoint
    ``resume=auto`` continues from (in a multirun's job, with its ``hydra.sweep.dir``), or the ``ckpt_path`` (``key``:
    ``decay_branch.ckpt``) the same command starts from (it said 'a new start trains from step 0' of another run's)."""
    ckpt_dir = Path(checkpoint_dir)
    newest = newest_step_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    if newest is None and ckpt_path and Path(str(ckpt_path)).expanduser().is_file():  # '~/r1.ckpt' too
        kept = f"no checkpoint in {ckpt_dir}: the same command starts again from {key}={ckpt_path}"
    elif newest is None:
        kept = f"no checkpoint in {ckpt_dir}: a new start trains from step 0"
    else:
        kept = f"resume=auto continues from {newest} (step {checkpoint_global_step(newest, verify=False)})"
    from lit_dtrain.sweeps import in_multirun

    if in_multirun():  # a job's bare resume=auto is refused (it needs the sweep dir), as the SIGTERM lines say
        kept += f"; resume with {train_resume_hint(None)}"
    # rank 0's: Ctrl-C reaches every rank, and each torchrun worker wrote this line alike (the exit line is labelled)
    log_once(log, logging.WARNING, "interrupted by SIGINT (Ctrl-C); %s", kept)
    status = INTERRUPTED_EXIT_STATUS  # '[rank: N]' under several processes (each worker's line was unlabelled)
    log.info(rank_labelled("exiting with status %d (interrupted, not finished)", launched_world_size()), status)
    return INTERRUPTED_EXIT_STATUS


@contextlib.contextmanager
def keyboard_interrupt_kept(trainer: L.Trainer):
    """Raise ``KeyboardInterrupt`` again where Lightning turned it into ``sys.exit(1)`` (``trainer.fit``/``validate``
    catch it, run the ``on_exception`` hooks, tear down and kill the child ranks), for ``train()`` to report it
    with :func:`interrupted_by_ctrl_c`. :class:`SigtermRecorder` notes it in its ``on_exception``."""
    try:
        yield
    except SystemExit as e:
        if type(e) is SystemExit and any(isinstance(c, SigtermRecorder) and c.interrupted for c in trainer.callbacks):
            raise KeyboardInterrupt from None
        raise


class SigtermRecorder(L.Callback):
    """From the end of ``fit`` on, a SIGTERM is only recorded (``signalled``), for :func:`sigterm_after_the_last_step`
    to act on. Lightning handles SIGTERM only inside ``fit``/``validate``, and when they end it puts back the handler
    from before them, the default, which ends the process: a SIGTERM while ``on_fit_end`` hooks ran, the final
    ``last.ckpt`` was written or the ranks agreed ended that rank with -15 and left the others to fail in their next
    collective (gloo's "Connection reset", exit status 1). At ``on_train_start``, after Lightning registered its
    handler, this callback becomes the handler Lightning puts back at the end of ``fit``; inside the final
    ``validate`` Lightning composes its own with it, as before. ``train()`` restores the handler from before it when
    it returns or raises. Inert outside the main thread, where no handler can be set."""

    def __init__(self) -> None:
        self.signalled = False
        self.signum = signal.SIGTERM  # the first signal recorded (SIGHUP: a closed terminal)
        self.interrupted = False  # Lightning caught a KeyboardInterrupt (see keyboard_interrupt_kept)
        self.smoke_test = False  # a fast_dev_run: no summary.json, no checkpoint (see stop_after_a_late_sigterm)
        self.world_size = 1  # the run's, for the labelled exit line of each rank (see agree_on_a_late_sigterm)
        self.cutting = False  # the end-of-run sample is drawn: a signal cuts it (see a_stop_signal_cuts_this)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.signalled:
            self.signum = signal.Signals(signum)
        self.signalled = True
        if self.cutting:
            self.cutting = False
            raise SampleCut(signum)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.interrupted = isinstance(exception, KeyboardInterrupt)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.smoke_test = bool(trainer.fast_dev_run)
        self.world_size = trainer.world_size
        handlers = getattr(trainer._signal_connector, "_original_handlers", None)  # what its teardown puts back
        if threading.current_thread() is threading.main_thread() and handlers and signal.SIGTERM in handlers:
            handlers[signal.SIGTERM] = self._on_sigterm
            # SIGHUP (a closed terminal) too, as PreemptionCheckpoint takes it in training: in a sweep job's sample it
            # killed the process (status -1, no line, no summary.json); one ignored (nohup) stays ignored
            hup = getattr(signal, "SIGHUP", None)
            if hup in handlers and handlers[hup] is not signal.SIG_IGN:
                handlers[hup] = self._on_sigterm


class SampleCut(Exception):
    """A stop signal came while the end-of-run sample was drawn, or before (:func:`a_stop_signal_cuts_this`):
    ``SampleCut(signum, when)``, ``when`` for the line that says so."""

    def __init__(self, signum: int, when: str = "while it was drawn") -> None:
        super().__init__(signum, when)


@contextlib.contextmanager
def a_stop_signal_cuts_this():
    """Around the end-of-run sample's generation: a SIGTERM or SIGHUP that :class:`SigtermRecorder` records in it
    (or before it, after the ranks' last agreement) raises :class:`SampleCut` there, so that the run goes on to its
    ``summary.json`` and exit at once. The sample was drawn to its end first: 37 s for 1500 tokens of ``nano`` on a
    CPU, past Slurm's default 30 s between SIGTERM and SIGKILL, which then killed the finished run before it wrote
    ``summary.json`` (a multirun's other ranks wait for it too). Inert where the recorder is not the handler."""
    main = threading.current_thread() is threading.main_thread()
    recorder = getattr(signal.getsignal(signal.SIGTERM), "__self__", None) if main else None
    if not isinstance(recorder, SigtermRecorder):
        yield
        return
    if recorder.signalled:  # while unigram_entropy counted the train split, say: not drawn at all
        raise SampleCut(recorder.signum, "before it was drawn")
    recorder.cutting = True
    try:
        yield
    finally:
        recorder.cutting = False


@contextlib.contextmanager
def sigterm_handler_kept():
    """Put the SIGTERM handler from before back on exit (in the main thread): :class:`SigtermRecorder` leaves its
    own in place when ``fit`` ends. SIGINT's and SIGHUP's too: Lightning ignores SIGINT from the moment it caught a
    ``KeyboardInterrupt`` on, so Ctrl-C no longer stopped anything in the process (a notebook) that called train().
    A SIGTERM that the recorder took after :func:`sigterm_after_the_last_step` is acted on then
    (:func:`stop_after_a_late_sigterm`)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS} if main else {}
    try:
        yield
    finally:
        recorder = getattr(signal.getsignal(signal.SIGTERM), "__self__", None) if main else None
        for s, handler in previous.items():
            if handler is not None:
                signal.signal(s, handler)
    if isinstance(recorder, SigtermRecorder) and recorder.signalled:  # a run that returned: none acted on it
        stop_after_a_late_sigterm(recorder.signum, smoke_test=recorder.smoke_test, world_size=recorder.world_size)


def agree_on_a_late_sigterm(trainer: L.Trainer) -> None:
    """In a job of a multirun with several ranks, after rank 0's end-of-run sample and report: the ranks agree on a
    SIGTERM (or SIGHUP) that :class:`SigtermRecorder` recorded since :func:`sigterm_after_the_last_step`, so that
    every rank stops before the next job (:func:`stop_after_a_late_sigterm`), not rank 0 alone. Only rank 0 draws the
    sample, so only it got the signal there: rank 1 went on to the next job, made its dir, and failed in its first
    collective, its ``error: rank 1: a collective failed at step 0 ... Another rank probably died or hung`` the
    sweep's last line, under rank 0's 143 (a 3-job gloo sweep). Rank 1 waits here for rank 0's sample, as it waited
    in the next job's first collective (the jobs run in lockstep). Rank 0 then takes the ranks Lightning's launcher
    started off its observer's list (one that exits with 143 would get rank 0 SIGKILLed) and waits for them to end, up
    to 5 s, so that the sweep's process ends after its ranks."""
    from lit_dtrain.sweeps import in_multirun

    recorder = next((c for c in trainer.callbacks if isinstance(c, SigtermRecorder)), None)
    if recorder is None or trainer.world_size == 1 or not in_multirun() or _the_sweeps_last_job():
        return  # a single run or the last job: each rank ends by itself (rank 0's line says the signal came)
    from lit_dtrain.strategies._connect import waiting_as_for_a_connection

    mine = torch.tensor(int(recorder.signum) if recorder.signalled else 0, device=trainer.strategy.root_device)
    with waiting_as_for_a_connection(trainer.strategy):  # rank 1 waits here for rank 0's sample
        agreed = int(all_gather_stacked(mine).max())
    if not agreed:
        return
    if not recorder.signalled:
        recorder.signalled, recorder.signum = True, signal.Signals(agreed)
    launcher = getattr(trainer.strategy, "launcher", None)
    if trainer.is_global_zero and launcher is not None and hasattr(launcher, "kill"):
        kill_launched_ranks(launcher, grace_s=5.0)  # each exits 143 itself; its interpreter's teardown took 2-4 s here


def stop_after_a_late_sigterm(signum: signal.Signals = signal.SIGTERM, smoke_test: bool = False,
                              world_size: int = 1) -> None:
    """A SIGTERM that came to a finished run after :func:`sigterm_after_the_last_step` (in the end-of-run sample or
    report, where :class:`SigtermRecorder` only records it): in a job of a multirun, ``SystemExit`` 143, so that the
    process stops before Hydra starts the next job; nothing read the record, and the signal was lost (a sweep sent
    SIGTERM in job 0's text sample ran its 2 other jobs to the end, 6 more minutes, and exited 0; under Slurm the
    grace period's SIGKILL would have stopped a later job wherever it was). A single run has finished, so it keeps
    its status 0, and a line says the signal came. SIGHUP alike, with 129. A ``fast_dev_run`` (``smoke_test``) writes
    neither ``summary.json`` nor a checkpoint, which the line said was written."""
    from lit_dtrain.sweeps import in_multirun

    name = signal.Signals(signum).name
    written = "fast_dev_run: no summary.json" if smoke_test else "summary.json is written"
    if not in_multirun():
        log.warning("%s came after the run finished (%s): nothing was left to stop", name, written)
        return
    if _the_sweeps_last_job():  # the sweep has finished: 143 and 'later jobs do not start' said otherwise
        log.warning("%s came after the sweep's last job finished (%s): nothing was left to stop", name, written)
        return
    again = "its finished jobs run again" if smoke_test else "its finished jobs are only validated again"
    log_once(log, logging.WARNING, "stopped by %s after this job finished (%s): the sweep's later jobs do not start; "
             "resume with %s (%s)", name, written if smoke_test else f"its {written}", train_resume_hint(None), again)
    log.info(rank_labelled("exiting with status %d (stopped by %s, not finished)", world_size), 128 + signum, name)
    raise SystemExit(128 + signum)


def _the_sweeps_last_job() -> bool:
    """Whether this multirun job is its sweep's last (Hydra's basic sweeper and launcher, one job after another:
    :func:`~lit_dtrain.sweep_grid.sweep_job_count`); False where that is not known."""
    from hydra.core.hydra_config import HydraConfig

    from lit_dtrain.sweep_grid import sweep_job_count

    if not HydraConfig.initialized():
        return False
    hc = HydraConfig.get()
    jobs = sweep_job_count(hc)
    return jobs is not None and hc.job.get("num") == jobs - 1
