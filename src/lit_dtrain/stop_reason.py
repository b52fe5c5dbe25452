"""Why ``train(cfg)``'s fit ended, for ``summary.json``'s ``stopped`` and the summary line: ``max_steps``,
``max_epochs``, ``early_stopping`` (an ``EarlyStopping`` callback), ``max_time`` (``trainer.max_time``) or
``should_stop`` (another callback, or the module, set ``trainer.should_stop``). A run stopped by a signal or by an error
writes no ``summary.json``; one that diverged says so in ``diverged``. Before, a run that ``EarlyStopping`` stopped at
step 4 of 20 wrote the same ``summary.json`` as a finished one, less ``steps``.

A checkpoint whose ``EarlyStopping`` stopped its run is finished, as one at ``trainer.max_steps`` is:
:class:`KeepEarlyStop` makes its resume (``resume=auto``, a continued sweep, ``ckpt_path=``) train no step and only
validate, as Lightning's ``Timer`` already does for ``max_time`` (it counts the time of earlier starts); a WSD decay
branch from it (``decay_branch.ckpt``) trains its decay. Before, such a
resume trained on to the next validation and stopped again there (2 more steps), or went on where that validation
happened to improve, so re-running a sweep to finish its killed jobs changed its early-stopped ones too."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.train")  # train(cfg)'s logger


def _early_stopped(callback: EarlyStopping) -> bool:
    """Whether ``callback`` stopped its fit (its ``stopping_reason``, in its checkpointed state: ``stopped_epoch`` is
    0 for a stop in the first epoch, which a ``max_steps`` run on lit_dtrain's endless sampler never leaves)."""
    return int(getattr(callback.stopping_reason, "value", callback.stopping_reason)) != 0  # 0: NOT_STOPPED


def agree_on_early_stop(trainer: L.Trainer) -> None:
    """Every rank's ``EarlyStopping`` says it stopped the fit where one rank's did (called by every rank after fit,
    before ``last.ckpt``, rank 0's states, is saved: one gather a fit). Lightning's ``EarlyStopping`` sets its
    ``stopping_reason`` on the rank that decided, before the ranks agree to stop (``reduce_boolean_decision``): on a
    metric that differs between ranks (``monitor=train/loss``), a 2-rank run that rank 1 stopped at step 8 of 20 said
    ``stopped=should_stop``, and its ``resume=auto`` trained on (to step 12)."""
    stoppers = trainer.early_stopping_callbacks
    if trainer.world_size < 2 or not stoppers:
        return
    mine = torch.tensor([int(getattr(c.stopping_reason, "value", c.stopping_reason)) for c in stoppers],
                        device=trainer.strategy.root_device)
    theirs = trainer.strategy.all_gather(mine).reshape(-1, len(stoppers)).amax(0).tolist()  # (any rank's reason)
    for callback, reason in zip(stoppers, theirs):
        if reason and not _early_stopped(callback):
            callback.stopping_reason = EarlyStoppingReason(reason)


def _timer(trainer: L.Trainer) -> Timer | None:
    return next((c for c in trainer.callbacks if isinstance(c, Timer)), None)


def _dd_hh_mm_ss(seconds: float) -> str:
    """``seconds`` rounded up, as ``trainer.max_time`` is typed (``DD:HH:MM:SS``)."""
    minutes, secs = divmod(int(-(-seconds // 1)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours // 24:02d}:{hours % 24:02d}:{minutes:02d}:{secs:02d}"


def stop_reason(trainer: L.Trainer) -> str:
    """Why ``trainer``'s fit ended (called after it): see the module docstring. ``max_steps`` wins where the last step
    was reached whatever else asked to stop there too."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return "max_steps"
    if any(_early_stopped(c) for c in trainer.early_stopping_callbacks):
        return "early_stopping"
    timer = _timer(trainer)
    left = timer.time_remaining() if timer is not None else None
    if left is not None and left <= 0:
        return "max_time"
    if trainer.max_epochs is not None and trainer.max_epochs >= 0 and trainer.current_epoch >= trainer.max_epochs:
        return "max_epochs"
    return "should_stop"


def nothing_trained(reason: str, steps: int, trainer: L.Trainer | None = None) -> str:
    """The line of a resume that trained no step (its checkpoint at ``steps``) because its run had ended for
    ``reason``, with how to train on (for ``max_time``, past the training time ``trainer``'s ``Timer`` counted: a
    run of max_time=4 s whose first step took 11 s, raised to 8 s, trained no step again)."""
    smoke = getattr(trainer, "fast_dev_run", 0) if trainer is not None else 0
    if smoke:  # Lightning runs a fit's first n steps (its max_steps=n): a resume past them trains none
        n = int(smoke)
        return (f"trainer.fast_dev_run runs a fit's first {n} step(s) (Lightning's max_steps={n}), and the "
                f"checkpoint is at step {steps}: nothing to train, only validated; for a smoke test, leave resume and "
                "ckpt_path out (and give it a run_name of its own)")
    if reason == "early_stopping":
        return (f"the checkpoint at step {steps} is of a run that EarlyStopping stopped (summary.json: \"stopped\": "
                "\"early_stopping\"): it is finished, nothing to train, only validated. To train on from it, leave "
                "EarlyStopping out (or give it another monitor or mode); to decay its weights, branch: "
                "decay_branch.ckpt=<its last.ckpt> decay_branch.steps=N")
    if reason == "max_time":
        timer = _timer(trainer) if trainer is not None else None
        used = _dd_hh_mm_ss(timer.time_elapsed("train")) if timer is not None else None
        counted = f"counted {used} of training, earlier starts' included" if used else \
            "counts the time of earlier starts too"
        return (f"the checkpoint at step {steps} is of a run that used up trainer.max_time (Lightning's Timer "
                f"{counted}): nothing to train, only validated. Raise trainer.max_time"
                f"{f' past {used}' if used else ''} to train on")
    if reason == "max_steps":
        return f"the checkpoint is already at step {steps} = trainer.max_steps: nothing to train, only validated"
    return f"the fit trained no step from the checkpoint at step {steps} (stopped: {reason}): only validated"


def _warmup_end(factor, step: int, max_steps: int) -> int | None:
    """The warmup's length under the LR schedule ``factor`` (the first step whose LR rises no more: a checkpoint from
    there on is past the warmup, as ``decay_branch`` asks), where ``step`` lies inside the warmup (the LR still
    rising); None where it does not rise at ``step`` (a stable phase, a decay)."""
    previous = float(factor(step - 1))
    for s in range(step, max_steps):
        current = float(factor(s))
        if current <= previous:
            return s if s > step else None
        previous = current
    return None


class KeepEarlyStop(L.Callback):
    """A resume of a checkpoint whose ``EarlyStopping`` stopped its run trains no step (see the module docstring):
    ``trainer.should_stop`` at train start, once the checkpoint's callback states are restored. Every rank restores
    the same states, so every rank stops."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and any(_early_stopped(c) for c in trainer.early_stopping_callbacks):
            trainer.should_stop = True


def early_stop_kept(callbacks: list[L.Callback], branch: bool) -> list[L.Callback]:
    """``callbacks`` with :class:`KeepEarlyStop`; for a WSD decay branch (``branch``), which trains on from an
    early-stopped checkpoint (decaying it is its point), without it and without ``EarlyStopping``, said in one info
    line: restored from the checkpoint, its ``wait_count`` at ``patience``, it stopped the branch at its first
    validation that did not improve (a real 8-step branch of a run it stopped at step 14 ended at step 18 of 22, at
    0.29 of the peak LR, not decayed)."""
    if not branch:
        return [*callbacks, KeepEarlyStop()]
    if any(isinstance(c, EarlyStopping) for c in callbacks):
        log_once(log, logging.INFO, "decay_branch: EarlyStopping left out: the branch trains its decay_branch.steps "
                 "to the end of the decay (a restored EarlyStopping stopped it mid-decay)")
    return [c for c in callbacks if not isinstance(c, EarlyStopping)]


def warn_if_the_schedule_did_not_end(trainer: L.Trainer, stopped: str, start_step: int, last_ckpt: str) -> None:
    """A fit that stopped before ``trainer.max_steps`` (``stopped``: EarlyStopping, max_time, ...) with its LR above
    where its schedule ends (a WSD run stopped in its stable phase, a cosine one midway) has weights that are not
    annealed: warned once, with the decay branch that decays them. (The ``WSDScheduler`` callback warns itself; the
    scheduler form, ``train.py``'s default, said nothing: a run EarlyStopping stopped at step 4 of 20 ended at the
    peak LR.) Quiet for a start that trained no step, and for a schedule that ends where it is (``constant``)."""
    if stopped == "max_steps" or trainer.global_step <= start_step or trainer.max_steps < 1:
        return
    lambdas = [getattr(c.scheduler, "lr_lambdas", None) for c in trainer.lr_scheduler_configs]
    if not lambdas or not lambdas[0]:
        return
    step, factor = trainer.global_step, lambdas[0][0]
    last, end = float(factor(step - 1)), float(factor(trainer.max_steps - 1))
    if last <= end + 1e-9 * max(1.0, abs(end)):
        return
    timer = _timer(trainer) if stopped == "max_time" else None  # a branch's Timer goes on from this run's time:
    also = f" trainer.max_time=<past {_dd_hh_mm_ss(timer.time_elapsed('train'))}>" if timer else ""  # else no step
    peak = _warmup_end(factor, step, trainer.max_steps)
    if peak is not None:  # the LR still rising: a branch from here is refused, or decays from the peak, above it
        train_on = {"early_stopping": " with EarlyStopping left out", "max_time": also}.get(stopped, "")
        log_once(
            log, logging.WARNING,
            "the fit stopped (%s) after %d of trainer.max_steps=%d optimizer steps, inside its warmup of %d steps "
            "(its last at %.4g of the peak LR): its weights are not annealed, and a decay branch does not take a "
            "checkpoint inside the warmup (refused there, or it decays from the peak LR, above this one). To anneal "
            "them, train on to step %d or later first (resume=auto%s), then branch from a checkpoint there: "
            "decay_branch.ckpt=<that last.ckpt> decay_branch.steps=N", stopped, step, trainer.max_steps, peak, last,
            peak, train_on,
        )
        return
    log_once(
        log, logging.WARNING,
        "the fit stopped (%s) after %d of trainer.max_steps=%d optimizer steps, its last at %.4g of the peak LR, "
        "before its schedule's end (%.4g at step %d): its weights are not annealed. To decay them (scheduler=wsd), "
        "branch: decay_branch.ckpt=%s decay_branch.steps=N%s", stopped, step, trainer.max_steps, last, end,
        trainer.max_steps - 1, last_ckpt, also,
    )
