"""The callbacks that ``train(cfg)`` adds to the configured ones: :class:`TrainClock` (when training proper starts,
for ``tokens_per_sec``), :class:`LogStepSync` (the step loggers see, after a resume) and :class:`ValLimitCheck`
(a fractional ``trainer.limit_val_batches`` that leaves a val loader no batch, refused before the first step) and
:class:`StepEndTimer` (``trainer.max_time``, checked at optimizer-step ends only; public as
``lit_dtrain.callbacks.StepEndTimer``).
``lit_dtrain.sigterm_exit.HoldSigtermInValidate`` is the fourth."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Timer

from lit_dtrain.callbacks.step_end_timer import StepEndTimer
from lit_dtrain.errors import ConfigError
from lit_dtrain.stop_reason import nothing_trained
from lit_dtrain.utils.loop import mid_accumulation
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.train")  # train(cfg)'s logger: its lines in train.log read as before the split


class TrainClock(L.Callback):
    """When training proper starts (``on_train_start``): after the DDP launch, the process-group rendezvous,
    data setup and a checkpoint restore. ``tokens_per_sec`` is measured from here, so it does not charge a run
    with other processes' start-up (in a multirun with DDP only job 0 launches rank 1 and waits for it).

    :meth:`fit_started` marks when ``trainer.fit`` is called, for ``wall_seconds``.

    Its state in a checkpoint (``train_loss``, ``train_seconds``, ``wall_seconds``, ``start_step`` of the fit that
    wrote it) gives the summary of a resume that only validates (stopped by SIGTERM after the last step) the training
    figures of the run that got there, which wrote no ``summary.json``: ``train_loss`` and ``tokens_per_sec`` were
    null, then the killed fit's ``tokens_per_sec`` stood beside the validating start's own ``wall_seconds``
    (:meth:`carried_figures`)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.fit_start: float | None = None
        self.carried: dict = {}  # the restored checkpoint's state
        self._trainer: L.Trainer | None = None
        self._start_step = 0
        # the tokens this fit trained, all ranks (None: a batch without input_ids), and those of the optimizer step
        # under way: they count once it steps (a stop mid-accumulation leaves its micro-batches untrained)
        self.tokens: int | None = 0
        self._step_tokens = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()
        self._trainer, self._start_step = trainer, trainer.global_step
        self.tokens, self._step_tokens = 0, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        """Count the tokens of each optimizer step's micro-batches when it steps. Every step counted as
        ``accumulate_grad_batches`` full micro-batches, but an epoch's last step has fewer where its batch count is no
        multiple of them (Lightning steps on an epoch's final batch): with ``limit_train_batches=5`` and 2, 6 steps
        trained 5120 tokens and tokens/s counted 6144, 20 % over."""
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if self.tokens is None or ids is None:
            self.tokens = None
            return
        self._step_tokens += int(ids.numel()) * trainer.world_size  # every rank a batch of one shape
        if not mid_accumulation(trainer):  # the step's last micro-batch
            self.tokens, self._step_tokens = self.tokens + self._step_tokens, 0

    def fit_started(self) -> float:
        """Mark (and return) the time ``trainer.fit`` is called: ``wall_seconds`` counts from here."""
        self.fit_start = time.perf_counter()
        return self.fit_start

    def state_dict(self) -> dict:
        trainer = self._trainer
        if trainer is None or self.start is None or trainer.global_step == self._start_step:
            return dict(self.carried)  # this fit trained no step: the figures of the one that did
        loss = trainer.callback_metrics.get("train/loss")
        now = time.perf_counter()
        state = {"train_loss": None if loss is None else float(loss), "start_step": self._start_step,
                 "train_seconds": now - self.start, "wall_seconds": now - (self.fit_start or self.start)}
        return state if self.tokens is None else {**state, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict) -> None:
        self.carried = dict(state_dict)

    def carried_figures(self, steps: int, tokens_per_step: int) -> dict:
        """``train_loss``, ``tokens_per_sec`` and ``wall_seconds`` of the fit that wrote the restored checkpoint (at
        ``steps``), with its ``tokens`` and ``start_step``. The times together or neither (a checkpoint written before
        ``wall_seconds`` was kept): one run's tokens/s beside another start's wall time do not describe one fit."""
        state, figures = self.carried, {}
        if isinstance(state.get("train_loss"), float):
            figures["train_loss"] = state["train_loss"]
        seconds, wall, start = state.get("train_seconds"), state.get("wall_seconds"), state.get("start_step")
        if (isinstance(seconds, float) and seconds > 0 and isinstance(wall, float) and isinstance(start, int)
                and steps > start):
            tokens = state.get("tokens")  # a checkpoint written before they were counted: full steps
            tokens = tokens if isinstance(tokens, int) and tokens > 0 else (steps - start) * tokens_per_step
            figures.update(tokens_per_sec=tokens / seconds, wall_seconds=wall, tokens=tokens, start_step=start)
        return figures


def figures_of_the_fit_that_trained(trainer: L.Trainer, out_dir: Path, clock: TrainClock, tokens_per_step: int,
                                    reason: str = "max_steps", restored_last: bool = True) -> dict:
    """``summary.json``'s training figures (``train_loss``, ``tokens_per_sec``, ``wall_seconds``, and the ``tokens`` and
    ``start_step`` they are of) for a start that resumed a finished checkpoint (``reason``: at ``trainer.max_steps``,
    stopped by ``EarlyStopping`` or ``max_time``) and only validated: those of the fit that trained the steps, from the
    run's ``summary.json`` where it got that far, else from the checkpoint (:meth:`TrainClock.carried_figures`; a stop
    after the last step wrote no ``summary.json``). Says why, once, on rank 0: every rank validates (a max_time stop
    said 'already at step 2 = trainer.max_steps' of a run with max_steps=200). The validating start's own ``tokens`` 0
    and ``start_step`` (the last step) stood beside the fit's times: ``compare_runs.py`` gave a sweep job continued with
    ``resume=auto``, which trained all 16 steps in one start, a wall time of 51.8 s '(since step 16)'."""
    steps = trainer.global_step
    if trainer.is_global_zero:
        log.info(nothing_trained(reason, steps, trainer))
    previous = None
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads((out_dir / "summary.json").read_text())
    # restored_last: the fit restored this run dir's own last.ckpt, which its summary.json is of; not after `rm -r
    # checkpoints` and ckpt_path=<another run's step-3 checkpoint>, where the old summary's tokens/s, wall time and
    # entropy stood for the other run's weights, and no sample of them was drawn ('the start ... drew it')
    if restored_last and isinstance(previous, dict) and previous.get("steps") == steps:
        # and on rank 0, which writes summary.json, its unigram_entropy (not counted again) and whether it sampled
        kept = ("tokens_per_sec", "wall_seconds", "train_loss", "tokens", "start_step")
        kept += ("unigram_entropy", "sample_drawn", "sample_settings", "peak_rss_mib") * trainer.is_global_zero
        return {k: previous[k] for k in kept if k in previous}
    return clock.carried_figures(steps, tokens_per_step)  # a summary.json of another end is not this run's


def max_time_timer(cfg_trainer, callbacks: list[L.Callback]) -> Timer | None:
    """The :class:`StepEndTimer` of ``trainer.max_time`` (to pass ``max_time=None`` to the Trainer for), or None
    where none is set or the configured callbacks hold a ``Timer`` of their own (Lightning ignores max_time then);
    a ``ConfigError`` where that ``Timer`` has no duration (the run would have no time limit at all)."""
    max_time = cfg_trainer.get("max_time")
    own = [c for c in callbacks if isinstance(c, Timer)]
    if max_time is not None and own and all(c._duration is None for c in own):  # Lightning's private (2.6)
        # Lightning keeps the callbacks' Timer and drops max_time with an info line: a measuring Timer() beside
        # trainer.max_time=00:00:00:06 trained on for 10 minutes (167 steps) until killed
        raise ConfigError(
            f"trainer.max_time={max_time!r} would be ignored: the callbacks hold a {type(own[0]).__name__} of their "
            "own without a duration, and Lightning keeps that Timer only (no time limit); give it the limit "
            "(its duration) in place of trainer.max_time, or leave it out (max_time's timer measures the time too)")
    if max_time is None or own:
        return None
    # (a {days: .., hours: ..} mapping: StepEndTimer resolves it, as {hours: ${x}} handed '${x}' on to timedelta)
    return StepEndTimer(duration=max_time, interval="step")


class LogStepSync(L.Callback):
    """Keeps the step that loggers see equal to ``global_step`` after a resume.

    Lightning logs at its own counter of stepped batches, restored from the checkpoint and bumped by one on
    restart, on the assumption that the checkpoint was saved inside a training batch. The final ``last.ckpt``
    that :func:`train` writes after ``fit`` is not, so continuing a finished run (``resume=auto`` with a larger
    ``trainer.max_steps``) logged every later point one step late (val at 9, 12, 13 instead of 8, 11, 12) and its
    curves did not line up with a straight run's. With one optimizer (LitLLM) the two counters are equal by
    construction; this puts them back in line at the first batch, after Lightning's restart bookkeeping."""

    def __init__(self) -> None:
        self._checked = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if self._checked:
            return
        self._checked = True
        self._sync(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # train()'s final validation: a resume at max_steps trains no batch, and from a checkpoint saved inside the
        # last step (a stop signal's, ModelCheckpoint's) it logged at step N - 1, a second point beside fit's
        if trainer.state.fn == "validate":
            self._sync(trainer)

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        loop = trainer.fit_loop.epoch_loop
        if getattr(loop, "_batches_that_stepped", trainer.global_step) != trainer.global_step:
            log.debug("logging step %d -> global_step %d", loop._batches_that_stepped, trainer.global_step)
            loop._batches_that_stepped = trainer.global_step


class ValLimitCheck(L.Callback):
    """A fractional ``trainer.limit_val_batches`` that leaves a val loader 0 batches: Lightning finds out at the
    first validation, ``val_check_interval`` steps into the run and before any checkpoint, and stops the run there
    (0.1 of a 1-batch loader trained 15 steps, then failed and saved nothing). The loaders' sizes are known once
    the datamodule is set up, so this checks them when the fit starts, before the first step."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loaders = trainer.datamodule.val_dataloader() if trainer.datamodule is not None else []
        names = getattr(pl_module, "val_names", None) or [str(i) for i in range(len(loaders))]
        sizes = {name: len(loader) for name, loader in zip(names, loaders)}
        empty = {name: n for name, n in sizes.items() if int(n * self.limit) < 1}
        if empty:
            raise ConfigError(
                f"trainer.limit_val_batches={self.limit} leaves no validation batch: it is a fraction of each val "
                f"loader, and int({self.limit} x batches) is 0 for {empty} (batches per source and rank: {sizes}). "
                f"Give a fraction >= {_fraction_for_one_batch(min(sizes.values()))}, a number of batches (an int >= "
                "1), or null for all"
            )


def _fraction_for_one_batch(batches: int) -> str:
    """The smallest fraction, to 3 significant digits, that leaves a loader of ``batches`` one batch by Lightning's
    count ``int(batches * fraction)``: 1 / batches rounded up (0.334 of 3; 0.333 gives 0, as 1 / 49 does of 49)."""
    decimals = max(0, 2 - math.floor(math.log10(1 / batches)))
    units = -(-(10**decimals) // batches)  # ceil(10**decimals / batches)
    while int(batches * float(text := f"{units / 10**decimals:.{decimals}f}")) < 1:
        units += 1
    return text.rstrip("0").rstrip(".") if "." in text else text  # 0.5 of 2, not 0.500


def add_required_callbacks(callbacks: list[L.Callback], sampler) -> None:
    """Append the callbacks ``sampler`` needs (``required_callbacks()``; a sampler is inert without them) that
    ``callbacks`` lacks. Every rank adds them; rank 0 says so."""
    for cb in getattr(sampler, "required_callbacks", lambda: [])():
        if not any(isinstance(c, type(cb)) for c in callbacks):
            log_once(log, logging.INFO, "adding %s (required by %s)", type(cb).__name__, type(sampler).__name__)
            callbacks.append(cb)
