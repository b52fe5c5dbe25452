"""``WSDScheduler(total_steps=None)``: the schedule's horizon is the trainer's planned optimizer steps.

Lightning's ``trainer.estimated_stepping_batches`` is ``min(max_steps, max_epochs x ceil(batches / accumulate))``, with
``limit_train_batches`` and the ``DistributedSampler``'s share of each rank counted: the number of optimizer steps the
fit will take, which a ``max_epochs`` user otherwise computed by hand. It is taken at each train start, so a resume with
a larger ``max_epochs``/``max_steps`` extends the schedule (as a larger ``total_steps`` does), and an identical resume
takes the same value (the callback's state records it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import lightning as L
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_dtrain.errors import ConfigError
from lit_dtrain.schedules.lr import wsd_lr_factor

FROM_TRAINER = "WSDScheduler(total_steps=None) takes its horizon from trainer.estimated_stepping_batches"


def planned_steps(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
    """The optimizer steps the fit will take; a one-line ``ConfigError`` where the trainer's estimate is not that."""
    give = "give total_steps=<optimizer steps>"
    if not pl_module.automatic_optimization:
        raise ConfigError(
            f"{FROM_TRAINER}, which under manual optimization counts every optimizer.step call (2 a batch with two "
            f"optimizers), not one optimizer's updates; {give.replace('optimizer steps', 'updates of each optimizer')}"
        )
    planned = estimated_steps(trainer)
    if math.isfinite(planned) and planned >= 1:
        return int(planned)
    unsized = trainer.num_training_batches == math.inf if trainer.max_epochs != -1 else False
    why = " and the train DataLoader has no length" if unsized else ""
    raise ConfigError(
        f"{FROM_TRAINER}, which is {planned} here (max_steps={trainer.max_steps}, max_epochs={trainer.max_epochs}"
        f"{why}): the trainer knows no end of training; {give}, or set the Trainer's max_steps"
    )


def estimated_steps(trainer: L.Trainer) -> float:
    """``trainer.estimated_stepping_batches``, with each epoch counted at the accumulation a
    ``GradientAccumulationScheduler`` gives it: Lightning's counts every epoch at the trainer's accumulation when it is
    read (the first epoch's), so ``GradientAccumulationScheduler({1: 2})`` over 3 epochs of 6 batches planned 18 steps
    for the fit's 12. An epoch's last batch steps whatever the count (``ceil``)."""
    planned = trainer.estimated_stepping_batches  # (sets up the train DataLoader, so num_training_batches is known)
    schedulers = [c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)]
    batches = trainer.num_training_batches
    if not schedulers or trainer.max_epochs in (None, -1) or not math.isfinite(planned) or not math.isfinite(batches):
        return planned
    per_epoch = (math.ceil(batches / schedulers[0].get_accumulate_grad_batches(e)) for e in range(trainer.max_epochs))
    steps = sum(per_epoch)
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps


def warn_if_the_horizon_moves_the_lr(saved: dict, step: int, horizon: int, factor: Callable[[int], float],
                                     source: str = "the checkpoint's run", warmup_steps: int = 0,
                                     given: bool = False) -> None:
    """A resume whose schedule is not the checkpoint's run's (``saved``: its schedule) and so gives the checkpoint's
    next ``step`` another LR than its run would have (``factor``: this fit's schedule) warns with both, as ``train.py``
    warns about such a resume. ``given`` false: the horizon is the trainer's, which plans another number of steps (an
    extension in the stable phase gives the same LR and stays quiet; a decayed checkpoint extended jumps up, and a
    horizon that shrank (another ``limit_train_batches``, more processes, a shorter dataset) can drop it). ``given``:
    the constructor's arguments changed (a larger ``total_steps`` on a decayed checkpoint; an info line said only
    'resuming with a changed schedule'); a ``warmup_steps`` past the step, a deliberate re-warm, is only logged.
    ``source``: whose schedule ``saved`` is (a checkpoint's, or the previous ``fit`` of the same Trainer's)."""
    keys = ("total_steps", "warmup_steps", "decay_steps", "decay_type", "min_lr_factor")
    if any(k not in saved for k in keys) or (not given and saved.get("total_steps") in (None, horizon)):
        return
    before, now = wsd_lr_factor(step, **{k: saved[k] for k in keys}), factor(step)
    if math.isclose(before, now, rel_tol=1e-9, abs_tol=1e-12):
        return
    moves = f"(the LR {'jumps up' if now > before else 'drops'})"
    if not given:
        rank_zero_warn(
            f"{FROM_TRAINER}: this fit plans {horizon} optimizer steps, {source} planned "
            f"{saved['total_steps']} (max_steps/max_epochs, limit_train_batches, the number of processes or the data's "
            f"length changed), so its next step {step} runs at {now:.4g} of the peak LR, not the {before:.4g} its run "
            f"would have used {moves}. To keep its schedule, pass total_steps={saved['total_steps']}"
        )
        return
    head = f"WSDScheduler: its next step {step} runs at {now:.4g} of the peak LR, not the {before:.4g} " \
           f"{source} would have used {moves}"
    if now < before and step < warmup_steps:
        rank_zero_info(f"{head}: warmup_steps={warmup_steps} lies past the step, so the resumed steps warm up again")
        return
    theirs = ", ".join(f"{k}={saved[k]}" for k in keys)
    rank_zero_warn(
        f"{head}: this schedule is not {source}'s ({theirs}); to go on with that one, pass its arguments"
    )


def warn_past_the_horizon(step: int, total_steps: int, min_lr_factor: float, planned: float | None,
                          reload_every: int = 0) -> None:
    """The fit trains step ``step``, at or past ``total_steps``, though the check at train start saw no such step
    (``planned``, Lightning's estimate then; the message gave the estimate at this step, 16 for a train-start 8 under
    ``reload_dataloaders_every_n_epochs``): every step from here runs at ``min_lr_factor``. Lightning's estimate
    counts every epoch at the current epoch length, also those trained before a resume that changed it (another
    ``limit_train_batches``, more processes), and every later epoch at the first's under ``reload_every``
    (``reload_dataloaders_every_n_epochs``); a DataLoader without a length has none."""
    counts = "every epoch at the current epoch length, also those trained before a resume that changed it"
    if reload_every:
        counts = (f"every epoch at the first one's length, and reload_dataloaders_every_n_epochs={reload_every} "
                  "reloaded the train DataLoader with more batches")
    rank_zero_warn(
        f"WSDScheduler: the fit goes on past total_steps={total_steps} (step {step}; at train start "
        f"trainer.estimated_stepping_batches was {planned}, which counts {counts}): its remaining steps run at "
        f"min_lr_factor={min_lr_factor} of the peak LR. Pass total_steps=<the fit's last step + 1>, or stop the "
        f"trainer at max_steps={total_steps}"
    )


def warn_if_stopped_before_the_decay(trainer: L.Trainer, total_steps: int, decay_steps: int,
                                     factor: Callable[[int], float], advice: str | None = None,
                                     warmup_steps: int = 0, planned_at_start: float | None = None) -> None:
    """A fit that stopped before the steps it planned (``EarlyStopping``, ``max_time``, ``trainer.should_stop``, an
    unsized DataLoader that ran out) and before the decay's end: its weights are not the decayed ones, and nothing
    said so (the check at train start saw the planned steps). A signal's stop raises and never gets here. ``advice``:
    how to decay them where a resume would not (under ``train.py`` an early-stopped checkpoint's resume trains no
    step, and told to 'resume with WSDScheduler(total_steps=4 + D, ...)' one trained none: its decay branch);
    None: resume with the decay's horizon. Inside the warmup (``warmup_steps``) neither takes the checkpoint (a decay
    branch is refused there, a resume with a horizon inside the warmup too): train past it first.
    ``planned_at_start``: the trainer's estimate at train start, which the fit is held to (the estimate now counts every
    epoch at the last one's length: under ``reload_dataloaders_every_n_epochs`` a train DataLoader reloaded shorter
    made the fit's 12 steps look planned, and one that ended at 0.5x the peak LR went without a word)."""
    step, now = trainer.global_step, estimated_steps(trainer)
    planned = now if planned_at_start is None else planned_at_start
    known = math.isfinite(planned) and planned >= 0  # (inf: an unsized DataLoader, the data decides)
    if step == 0 or step >= total_steps or (known and int(planned) <= step):
        return
    why = "EarlyStopping, max_time or trainer.should_stop"
    if known and now != planned and trainer.reload_dataloaders_every_n_epochs:
        why = (f"reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs} reloaded the train "
               f"DataLoader with fewer batches than the plan counted for every epoch at train start; for epochs "
               f"that change length, give WSDScheduler the fit's steps, total_steps={step}")
    of = f"of the {int(planned)} it planned ({why})" if known else f"(a DataLoader without a length ran out, {why})"
    advice = advice or f"resume from its last checkpoint with WSDScheduler(total_steps={step} + D, decay_steps=D)"
    if step < warmup_steps:  # the LR still rising: the branch, or the horizon, above is refused here
        advice = (f"train on to step {warmup_steps} or later first, past the warmup (warmup_steps={warmup_steps}), "
                  f"then {advice.replace(f'total_steps={step} + D', 'total_steps=<that step> + D')}")
    rank_zero_warn(
        f"WSDScheduler: the fit stopped after {step} optimizer steps {of}, before the decay ends (steps "
        f"{total_steps - decay_steps}..{total_steps - 1}): its last step ran at {factor(step - 1):.4g}x the peak "
        f"LR and its weights are not decayed. To decay them, {advice}"
    )


def warn_optimizers_left_behind(updates: list[int], total_steps: int, decay_steps: int,
                                factor: Callable[[int], float]) -> None:
    """Manual optimization, at train end: some optimizers took ``total_steps`` updates, others fewer (one stepped every
    other batch, a GAN's 2:1), so the schedule of those ended at the peak LR or inside the decay. (It went without a
    word: the fit as a whole reached its horizon, and only a fit whose optimizers all fell short was told.)"""
    decay_start = total_steps - decay_steps
    short = [f"optimizer {i}: {n} updates, its last at {factor(n - 1) if n else 1.0:.4g} of the peak LR"
             for i, n in enumerate(updates) if n < total_steps]
    rank_zero_warn(
        f"WSDScheduler counts each optimizer's own updates (manual optimization), and not every optimizer took "
        f"total_steps={total_steps} in this fit ({'; '.join(short)}; the decay is updates {decay_start}.."
        f"{total_steps - 1}): their schedule ended short, their weights not decayed. To decay every optimizer, step "
        "each of them total_steps times (or leave WSDScheduler out for a schedule of your own per optimizer)"
    )


def note_short_fit(wsd, planned: int, manual: bool = False) -> None:
    """The trainer of ``WSDScheduler`` ``wsd`` stops before the schedule's end: before its decay (a WSD stable run, to
    branch decays from later, or a ``max_steps`` set too low: either way this fit ends at the peak LR, said once), or
    inside it (its last step above ``min_lr_factor``, a decay cut short: warned). ``manual``: said at train end, when
    the updates are counted (``planned``: those of the optimizer that took most)."""
    decay_start = wsd.total_steps - wsd.decay_steps
    if manual:
        stops, runs = f"the fit ended after {planned} updates of its optimizer(s) (manual optimization)", "ran"
        fix = f"total_steps={planned} (with k optimizers that step every batch, max_steps / k)"
        or_else = ""
    else:
        stops, runs = f"the trainer stops after {planned} optimizer steps", "runs"
        fix, or_else = f"total_steps={planned}", f" (or let the trainer run to max_steps={wsd.total_steps})"
    if planned <= decay_start:
        rank_zero_info(
            f"WSDScheduler: {stops}, before the decay starts at step {decay_start} (total_steps="
            f"{wsd.total_steps}, decay_steps={wsd.decay_steps}): this fit ends at the peak LR, in the stable "
            f"phase (a stable run to branch a decay from later). For the decay in this fit, set {fix}"
        )
        return
    rank_zero_warn(
        f"WSDScheduler: {stops}, inside the decay (steps {decay_start}..{wsd.total_steps - 1}, total_steps="
        f"{wsd.total_steps}): its last step {runs} at {wsd.lr_factor(planned - 1):.4g} of the peak LR, not "
        f"min_lr_factor={wsd.min_lr_factor}. Set {fix}{or_else}"
    )
