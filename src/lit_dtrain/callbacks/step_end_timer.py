"""``StepEndTimer``: Lightning's ``Timer`` (``Trainer(max_time=...)``), but it stops a fit only at the end of an
optimizer step. Lightning's checks at every micro-batch, so under ``accumulate_grad_batches`` it stops between them:
the checkpoint holds a step half accumulated, whose gradients are in no file, and the resumed fit's first step is that
many micro-batches short (a project of one's own on ``LMDataModule`` with 2 a step, stopped at micro-batch 3: its resume
ended 0.038 off a straight run's weights; with this timer, bitwise)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import lightning as L
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.trainer.states import RunningStage
from omegaconf import OmegaConf

from lit_dtrain.callbacks._args import check_arg
from lit_dtrain.callbacks._state_keys import note_stage, state_is_for_fit
from lit_dtrain.utils.args import is_flag, is_number
from lit_dtrain.utils.loop import mid_accumulation, reopen_stopped_epoch


class StepEndTimer(Timer):
    """``trainer.max_time``'s ``Timer``, whose check (and so its stop) comes only at the end of an optimizer step.
    Lightning's own checked at every micro-batch: with ``accumulate_grad_batches=4`` it stopped a run at micro-batch 37
    of step 9, the checkpoint threw micro-batch 37 away, and ``resume=auto`` went on from there, its first step one
    micro-batch short (with 2 per step, train/tokens at step 4 was 3584 against a straight run's 4096). The ranks
    still agree: the check is Lightning's (rank 0's clock, broadcast), at the same batch on every rank.

    In a project of one's own, pass it in place of ``Trainer(max_time=...)``:
    ``Trainer(callbacks=[StepEndTimer(duration="00:12:00:00")], accumulate_grad_batches=4)``. Lightning ignores a
    ``Trainer(max_time=...)`` beside it (a ``Timer`` callback wins; an info line says so), and refuses a second
    ``Timer`` in the callbacks (one checkpoint key, ``Timer``). ``duration`` is required: without one Lightning's
    ``Timer`` only measures, and ``Trainer(max_time=...)`` would have been ignored for nothing."""

    def __init__(self, duration, interval: str = "step", verbose: bool = True) -> None:
        if duration is None:
            raise ValueError(
                "StepEndTimer needs a duration (e.g. StepEndTimer(duration='00:12:00:00')): it is the fit's time "
                "limit, and Lightning ignores Trainer(max_time=...) beside it; for a timer that only measures, use "
                "lightning.pytorch.callbacks.Timer()"
            )
        # duration=10 (seconds) was "AttributeError: 'int' object has no attribute 'total_seconds'", and
        # verbose="false" printed the time left at the stop (bool of a string)
        if isinstance(duration, Mapping):  # a config's {hours: 12} (Hydra hands a DictConfig on): Lightning's Timer
            # takes a dict only ("Missing key total_seconds"), and {hour: 12} was timedelta's "'hour' is an invalid
            # keyword argument for __new__()"
            duration = OmegaConf.to_container(duration, resolve=True) if OmegaConf.is_config(duration) \
                else dict(duration)
            # a numpy integer (a value read from an array), taken where the other arguments ask a count, was refused:
            # timedelta takes numpy's floats but not its integers ("unsupported type for timedelta hours component")
            duration = {k: int(v) if is_number(v, integer=True) else v for k, v in duration.items()}
        # a flag: timedelta(hours=True) was an hour, where trainer.max_time's {hours: true} is refused
        check_arg("StepEndTimer", "duration", duration,
                  lambda v: isinstance(v, (str, timedelta)) or (
                      isinstance(v, dict) and not any(map(is_flag, v.values())) and timedelta(**v) is not None),
                  "'DD:HH:MM:SS', a datetime.timedelta or a dict such as {'hours': 12}")
        check_arg("StepEndTimer", "interval", interval, lambda v: v in ("step", "epoch"), "'step' or 'epoch'")
        check_arg("StepEndTimer", "verbose", verbose, is_flag, "True or False")
        super().__init__(duration=duration, interval=interval, verbose=verbose)
        # a negative time ({'hours': -1}, '-01:00:00:00') stopped the fit before its first step without a word, where
        # trainer.max_time refuses it
        check_arg("StepEndTimer", "duration", duration, lambda v: self._duration >= 0, "a time >= 0")
        self._stopped_mid_epoch: int | None = None  # the global step at which this timer stopped the fit mid-epoch

    @property
    def state_key(self) -> str:
        """Lightning's ``Timer``'s key (its class name), so that the training time a checkpoint counted carries over
        between the two: under its own key a ``last.ckpt`` written by Lightning's ``Timer`` (lit_dtrain before this
        class, or ``Trainer(max_time=...)``) resumed from 0 s, and a run that had used up ``max_time=4 s`` at step 3
        trained on to step 8 instead of only validating."""
        return "Timer"

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """A checkpoint of lit_dtrain from 299c398 to the ``state_key`` above holds the time under this class's
        name: read it there (Lightning loads by ``state_key`` only, next)."""
        states = checkpoint.get("callbacks") or {}
        if self.state_key not in states and isinstance(states.get(type(self).__name__), dict):
            self.load_state_dict(states[type(self).__name__])

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """A fit of a new run (another Trainer given this object: a sweep loop, a next stage) counts from 0 s, as a
        fresh timer does; a ``ckpt_path``'s time is loaded after this. Lightning's kept the previous fit's clock: its
        check at fit start counted that fit's seconds (a first fit that used up 1 s left the next Trainer 0 steps)."""
        note_stage(self, stage)
        if stage == "fit" and trainer.global_step == 0:
            self._offset = 0
            self._forget_training_clock()

    def _forget_training_clock(self) -> None:
        self._start_time[RunningStage.TRAINING] = self._end_time[RunningStage.TRAINING] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The same Trainer fitted again (``max_steps`` raised) goes on from the time its fits took. Lightning's kept
        the previous fit's end time, so the elapsed time (that end minus the new start) was negative until the fit
        ended: a 2 s limit let a refit train 38 steps over 27 s."""
        if self._end_time[RunningStage.TRAINING] is not None:
            self._offset = self.time_elapsed()
            self._end_time[RunningStage.TRAINING] = None
        self._stopped_mid_epoch = None
        super().on_train_start(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A fit that raised (Ctrl-C, an error the user then fixes) ends its training time here: Lightning calls no
        ``on_train_end`` then, so a refit of the same Trainer counted the time between as training at its check (a 3 s
        limit, 2 s used, a refit 100 s later: 0 steps) and its start dropped the time of the fit that raised."""
        if self._start_time[RunningStage.TRAINING] is not None and self._end_time[RunningStage.TRAINING] is None:
            super().on_train_end(trainer, pl_module)  # Lightning's end of the training time

    def load_state_dict(self, state_dict: dict) -> None:
        """A fit's checkpoint time replaces this object's count (not that of ``validate``/``test``/``predict``
        with ``ckpt_path=``, which serve no fit)."""
        if state_is_for_fit(self):
            super().load_state_dict(state_dict)
            self._forget_training_clock()

    def on_train_batch_end(self, trainer: L.Trainer, *args, **kwargs) -> None:
        if mid_accumulation(trainer):
            return
        stopping = trainer.should_stop
        super().on_train_batch_end(trainer, *args, **kwargs)
        epoch_loop = trainer.fit_loop.epoch_loop
        if trainer.should_stop and not stopping and not epoch_loop.batch_progress.is_last_batch:
            self._stopped_mid_epoch = trainer.global_step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """A stop of this timer mid-epoch: Lightning closes the epoch, and a fit under ``max_epochs`` resumed from a
        checkpoint written after it (``ModelCheckpoint``'s at the epoch's end, ``last.ckpt``) began the next epoch and
        never trained the rest of the stopped one (stopped at step 6 of 3 epochs of 4 batches, the resume trained 4
        steps, 10 in all, where the straight run trained 12). The file records the stop at its batch's end instead, as
        ``PreemptionCheckpoint``'s does: the resume trains the 6 steps left."""
        if self._stopped_mid_epoch is not None and self._stopped_mid_epoch == trainer.global_step:
            reopen_stopped_epoch(checkpoint)  # (a checkpoint of a later step, or mid-epoch already, is left alone)
