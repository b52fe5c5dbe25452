"""Whether the optimizer step now running is the last of the fit, for a local-update rule's final synchronization.

Under local SGD / DiLoCo the ranks' parameters differ between syncs. ``CompressedDDPStrategy`` synchronizes at the
fit's last optimizer step (``sync_on_last_step``), before the callbacks of that step run, so that the checkpoints
written at its end (``ModelCheckpoint``'s ``last.ckpt``, written in ``on_train_epoch_end`` or after the step's
validation) hold the synchronized model. The strategy's ``on_train_end`` synchronizes too, but after every
checkpoint of the fit is written: the in-memory model then differs from the files.

The last step is known ahead when the fit ends by ``max_steps`` or by ``max_epochs``. Only ``max_steps`` was
checked, so a project of one's own that trains by epochs (Lightning's default ``max_steps=-1``) wrote a
``last.ckpt`` holding rank 0's unsynchronized parameters (DiLoCo: without its last outer step). A stop that
is decided after the step (``EarlyStopping``, ``max_time``, ``trainer.should_stop``) cannot be known ahead; there
only ``on_train_end`` synchronizes. Lightning validates after such a stop when the fit has validation data, and that
validation synchronizes first (below; the checkpoints written after it keep every rank's state from before that sync,
which a fit that did not stop never makes, for a resume: ``_comm_state.kept_for_a_resume``); without one,
a checkpoint written at the stop's step (``ModelCheckpoint`` at the epoch's end) holds rank 0's parameters, which
:func:`warn_checkpoint_before_final_sync` says.

A validation inside the fit sees the synchronized model the same way (``sync_before_validation``): the optimizer step
after which Lightning's epoch loop will validate (its own ``_should_check_val_fx``, asked during the step: the batch
counters it reads are already this batch's) synchronizes early, before that step's callbacks and checkpoints; a
validation that comes after a batch without an optimizer step (mid gradient accumulation) synchronizes after that
batch's backward (:func:`sync_before_a_validation_mid_accumulation`; one asked by a stop later in the batch, in the
strategy's ``on_validation_start``). A validation by time (``val_check_interval`` as a duration) is refused: each rank
reads its own clock, so the ranks would sync after different steps. Without it each rank validated its own parameters:
``val/loss`` was a mean over different models and the checkpoint written after it held rank 0's.

Every rank must run as many training batches per epoch (:func:`check_epoch_lengths`, run by every strategy that
mixes in :class:`EpochLengthCheck`: ``CompressedDDPStrategy`` and the plain DDP / FSDP of ``strategy=ddp`` /
``strategy=fsdp``): the rank whose epoch ends first stops stepping while the others go on, so their next collectives
(Lightning's per-batch SIGTERM broadcast, a gradient all-reduce, a local-update sync) have no partner.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_dtrain.strategies._comm_state import kept_for_a_resume
from lit_dtrain.utils.words import counted


def _reached(count: int, limit: Any) -> bool:
    return isinstance(limit, int) and limit >= 0 and count >= limit


def is_last_optimizer_step(trainer: Any, by_steps: bool = True) -> bool:
    """Whether the optimizer step in progress ends the fit: the ``max_steps``-th step, or the last step of the
    ``max_epochs``-th epoch (Lightning steps on an epoch's final batch even mid-accumulation)."""
    if trainer is None:
        return False
    if by_steps and _reached(trainer.global_step + 1, trainer.max_steps) and trainer.max_steps > 0:
        return True
    if not _reached(trainer.current_epoch + 1, trainer.max_epochs) or trainer.max_epochs == 0:
        return False
    # what Lightning's epoch loop reads to end the epoch (its _num_ready_batches_reached)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch or progress.current.ready == trainer.num_training_batches)


def validates_after_this_step(trainer: Any, stop_counts: bool = True) -> bool:
    """Whether Lightning's epoch loop validates after the training batch whose optimizer step is in progress (by
    ``val_check_interval`` in batches, ``check_val_every_n_epoch``, an epoch's last batch or, with ``stop_counts``,
    an early stop already requested that ``min_steps``/``min_epochs`` do not hold off). False outside a fit's training
    loop, and for a ``val_check_interval`` in time: each rank reads its own clock, so a guess here could differ across
    ranks (one rank in a sync's all-reduce, the other not); a fit under a local-update rule refuses it
    (:func:`refuse_validation_by_time`)."""
    if trainer is None or not trainer.training or trainer.sanity_checking:
        return False
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return False
    return not trainer.fit_loop.epoch_loop._skip_next_val and _lightning_validates(trainer, stop_counts)


def _lightning_validates(trainer: Any, stop_counts: bool) -> bool:
    """Lightning's own rule for a validation after the training batch in progress (its ``_should_check_val_fx``);
    without ``stop_counts``, as if no stop had been asked: a fit going on past this step validates here too."""
    epoch_loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    if fetcher is None:
        return False
    if stop_counts or not trainer.should_stop:
        return bool(epoch_loop._should_check_val_fx(fetcher))
    trainer.should_stop = False  # the one input of Lightning's rule a stop changes
    try:
        return bool(epoch_loop._should_check_val_fx(fetcher))
    finally:
        trainer.should_stop = True


def refuse_validation_by_time(strategy: Any, trainer: Any) -> None:
    """A ConfigError for a fit under a local-update rule whose ``val_check_interval`` is a duration. Lightning lets each
    rank decide from its own clock, so the ranks decide after different steps to sync and validate, and one rank's
    validation sync pairs with another collective of the other rank (Lightning's per-batch broadcast or a periodic
    sync): a 2-rank local SGD run (one rank 50 ms per batch slower, 0.5 s interval) hung until
    ``collective_timeout_s``."""
    seconds = getattr(trainer, "_val_check_time_interval", None)
    if strategy.local_update is None or seconds is None or getattr(trainer.state, "fn", None) != "fit":
        return
    from lit_dtrain.errors import ConfigError

    raise ConfigError(f"val_check_interval is a duration ({seconds:g} s), which each rank measures on its own clock: "
                      f"under {strategy.local_update.name} the ranks would decide after different steps to sync and "
                      "validate, and their collectives would not match (a hang until "
                      "collective_timeout_s); set val_check_interval in batches")


def warn_if_the_period_cannot_adapt(strategy: Any, trainer: Any) -> None:
    """Rank 0's warning for adaptive local SGD whose validations (``val_check_interval`` in batches) come before its
    first period ends, with ``sync_before_validation``: every sync is then forced early, and an early sync does not
    adapt (its drift is that of fewer steps), so the period never changes and ``adaptive=True`` does nothing (a 2-rank
    run, period 4, validation every 3 steps: 6 syncs in 18 steps, all early, the period 4 throughout)."""
    rule, interval = strategy.local_update, getattr(trainer, "val_check_interval", None)
    if not (getattr(rule, "adaptive", False) and strategy.sync_before_validation and isinstance(interval, int)):
        return
    if getattr(trainer.state, "fn", None) != "fit" or interval >= rule.sync_period or interval <= 0:
        return
    rank_zero_warn(f"{rule.name}: a validation every {counted(interval, 'step')} comes before its period of "
                   f"{rule.sync_period} ends, and each one syncs first (sync_before_validation): every sync is "
                   "early, and an early sync does not adapt the period, so it stays at sync_period. Validate less "
                   "often than the period "
                   "(trainer.val_check_interval) or use the fixed local_sgd")


def force_sync_this_step(strategy: Any, trainer: Any, manual: bool = False) -> bool:
    """Whether the optimizer step in progress synchronizes early: it is the fit's last (``sync_on_last_step``) or a
    validation follows it (``sync_before_validation``). Under manual optimization (``manual``) never: which of a
    batch's steps is its last is not known here, so the batch's reasons (the fit's last batch, a validation after it)
    wait for :func:`force_sync_after_batch`. Before, each of a batch's steps synced (two optimizers: two syncs at the
    last batch, one of them wasted), and with ``max_steps`` odd the ``max_steps``-th step and the one after it did."""
    if strategy.local_update is None:
        return False
    if manual:  # the batch's sync, after its training_step (force_sync_after_batch)
        return False
    return bool((strategy.sync_on_last_step and is_last_optimizer_step(trainer))
                or (strategy.sync_before_validation and validates_after_this_step(trainer)))


def only_ends_the_fit(strategy: Any, trainer: Any, counting: bool) -> bool:
    """Whether an early sync forced now (:func:`force_sync_this_step`, :func:`force_sync_after_batch`) is one that a
    fit going on past this step would not make: no validation follows and the period is not over (``counting``: the
    step in progress is not counted yet). A resume from a checkpoint written after it (an extension of a finished
    fit) goes on from the state before it (``_comm_state.kept_for_a_resume``)."""
    lu = strategy.local_update
    # a validation only because of a stop asked before this step's end (in training_step, a callback's
    # on_before_optimizer_step) is not one: its sync was not kept, and a resume went on from it (0.0029 off)
    if strategy.sync_before_validation and validates_after_this_step(trainer, stop_counts=False):
        return False
    return lu.steps_since_sync + counting < lu.period


def force_sync_after_batch(strategy: Any, trainer: Any) -> bool:
    """Whether a manual-optimization batch whose ``training_step`` just returned ends in an early sync: it is the
    fit's last batch (``sync_on_last_step``) or a validation follows it (``sync_before_validation``)."""
    if strategy.local_update is None or trainer is None or not trainer.training:
        return False
    # the batch's steps are counted already: global_step + 1 (is_last_optimizer_step's step in progress) synced the
    # batch before the max_steps-th one too (max_steps=5, one optimizer: a sync after steps 4 and 5)
    ends_by_steps = trainer.max_steps > 0 and _reached(trainer.global_step, trainer.max_steps)
    return bool((strategy.sync_on_last_step and (ends_by_steps or is_last_optimizer_step(trainer, by_steps=False)))
                or (strategy.sync_before_validation and validates_after_this_step(trainer)))


def sync_or_warn_before_validation(strategy: Any) -> None:
    """At a validation's start with the ranks between syncs: synchronize (``sync_before_validation``; the bytes are
    accounted as the fit end's sync) or warn once (:func:`warn_validation_between_syncs`)."""
    lu, module = strategy.local_update, strategy.lightning_module
    trainer = module.trainer if module is not None and module._trainer is not None else None
    if validation_between_syncs_message(lu, trainer) is None or strategy.session.comm is None:
        return
    if strategy.sync_before_validation:
        # a validation that runs only because of a stop: a resume goes on from the state before its sync. A stop
        # that min_steps / min_epochs hold off trains on, and a validation until then is one the fit makes anyway
        # (what Lightning's _should_check_val_fx reads); so is one that falls here anyway (val_check_interval), whose
        # sync was kept as if the fit stopped (a stop after batch 5 of accumulation 2: 0.011 off)
        stop = (trainer.should_stop and getattr(trainer.fit_loop, "_can_stop_early", True)
                and not _lightning_validates(trainer, stop_counts=False))
        with kept_for_a_resume(strategy, trainer.global_step if stop else None):
            strategy.session.final_sync(strategy.session.named_params(module))
    else:
        warn_validation_between_syncs(strategy)


def sync_before_a_validation_mid_accumulation(strategy: Any) -> None:
    """After the backward of a batch without an optimizer step (mid gradient accumulation) that Lightning validates
    after: synchronize now, before the batch's callbacks and the validation's ``on_validation_start`` hooks. The
    strategy's own ``on_validation_start``, which synchronized there, runs after the callbacks' and the module's
    (Lightning calls the strategy's hook last), so those saw each rank's own parameters (2 gloo ranks, local SGD
    period 4, ``accumulate_grad_batches=2``, validating after batch 5: parameter sums -2.669 and -3.219). A stop
    asked later in the batch still synchronizes there, as before."""
    module = strategy.lightning_module
    trainer = module.trainer if module is not None and module._trainer is not None else None
    if (strategy.local_update is None or not strategy.sync_before_validation or trainer is None
            or not module.automatic_optimization or not trainer.training):
        return
    if trainer.fit_loop.epoch_loop._should_accumulate() and validates_after_this_step(trainer, stop_counts=False):
        sync_or_warn_before_validation(strategy)  # a validation the fit makes anyway: nothing kept for a resume


def validation_between_syncs_message(local_update: Any, trainer: Any) -> str | None:
    """The warning for a validation inside a fit that starts while the ranks' parameters differ (a local-update rule
    between syncs), or None. Such a validation evaluates each rank's own parameters on that rank's share of the
    validation data, so ``val/loss`` is the mean over ranks of losses of different models (none of them the model of
    the last sync, DiLoCo's outer parameters, nor their average), and a checkpoint written there (``ModelCheckpoint``
    after the validation) holds rank 0's parameters beside that figure."""
    if local_update is None or trainer is None or local_update.steps_since_sync == 0 or trainer.sanity_checking:
        return None
    return (f"CompressedDDPStrategy: validating at step {trainer.global_step}, "
            f"{counted(local_update.steps_since_sync, 'step')} after the last {local_update.name} sync: each rank "
            "evaluates its own parameters, so val metrics are the mean over ranks of different models, and a "
            "checkpoint written now holds rank 0's. Set strategy.sync_before_validation=true (the default) to "
            "evaluate the synchronized model")


def warn_validation_between_syncs(strategy: Any) -> str | None:
    """Warn (rank 0, once per strategy) with :func:`validation_between_syncs_message`; returns the message."""
    module = strategy.lightning_module
    trainer = module.trainer if module is not None and module._trainer is not None else None
    message = validation_between_syncs_message(strategy.local_update, trainer)
    if message is None or getattr(strategy, "_warned_validation_between_syncs", False):
        return None
    strategy._warned_validation_between_syncs = True
    rank_zero_warn(message)
    return message


def uneven_epochs_message(lengths: list[float], batch_idx: int, global_step: int, max_steps: int,
                          accumulate: int) -> str | None:
    """The error for ranks whose epochs hold different numbers of training batches (``lengths``, per rank; ``inf``
    for a loader without a length), or None when they are equal or the fit stops by ``max_steps`` at or before the
    shortest epoch's last batch (then every rank runs the same batches). ``batch_idx``: the epoch's batches already
    run (a multiple of ``accumulate``: the epoch's first batch, or where a resume starts)."""
    if len(set(lengths)) <= 1:
        return None
    # Lightning steps every `accumulate` batches and at the epoch's last batch; every batch broadcasts (SIGTERM)
    if 0 < max_steps and (max_steps - global_step + batch_idx // accumulate) * accumulate <= min(lengths):
        return None
    ends = {n: global_step + math.ceil(n / accumulate) - batch_idx // accumulate for n in lengths if math.isfinite(n)}
    parts = []
    for n in sorted(set(lengths)):
        ranks = [r for r, m in enumerate(lengths) if m == n]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:8]))}" + (
            ", ..." if len(ranks) > 8 else "")
        parts.append(f"{who}: {n:.0f} batches, its epoch ends after step {ends[n]}" if math.isfinite(n)
                     else f"{who}: a loader without a length")
    return (f"the ranks' training epochs differ in length ({'; '.join(parts)}): the rank whose epoch ends first would "
            "leave the others in a collective until collective_timeout_s; every rank must run the same number of "
            "training batches per epoch (a DataLoader of one's own under use_distributed_sampler=False: shard it "
            "evenly, drop or pad the remainder, or set limit_train_batches)")


def check_epoch_lengths(strategy: Any, trainer: Any, batch_idx: int) -> None:
    """A ConfigError (on every rank at once) at an epoch's first training batch when the ranks' epochs differ in
    length (:func:`uneven_epochs_message`). One all-gather of ``world_size`` numbers per epoch."""
    key = (id(trainer.fit_loop), trainer.current_epoch)
    if trainer.world_size < 2 or getattr(strategy, "_epoch_lengths_checked", None) == key:
        return
    strategy._epoch_lengths_checked = key
    lengths = _all_gather_number(float(trainer.num_training_batches), trainer.world_size, strategy.root_device)
    message = uneven_epochs_message(lengths, batch_idx, trainer.global_step, trainer.max_steps,
                                    trainer.accumulate_grad_batches)
    if message is not None:
        from lit_dtrain.errors import ConfigError

        raise ConfigError(message)


def note_checkpoint(strategy: Any, checkpoint: dict) -> None:
    """Remember the step of a checkpoint written between syncs (for :func:`warn_checkpoint_before_final_sync`)."""
    lu = strategy.local_update
    strategy._unsynced_checkpoint_step = (checkpoint.get("global_step") if lu is not None and lu.steps_since_sync
                                          else None)


def warn_checkpoint_before_final_sync(strategy: Any) -> str | None:
    """At a fit's end between syncs (a stop decided after its step with no validation after it): warn on rank 0 when
    a checkpoint was written at this very step, before the final sync about to run; returns the message.

    That file's ``state_dict`` is rank 0's own parameters (a 2-rank local SGD project stopped by a callback 2 steps
    after a sync: 0.011 off the synchronized mean, weights of mean size 0.22), not the model the module holds after
    the fit; a resume from it is right (every rank gets its own parameters back and it continued bit for bit as a
    run that never stopped), but loading its weights to evaluate or sample was not the final model, silently."""
    lu, module = strategy.local_update, strategy.lightning_module
    trainer = module.trainer if module is not None and module._trainer is not None else None
    step = getattr(strategy, "_unsynced_checkpoint_step", None)
    if lu is None or trainer is None or not lu.steps_since_sync or step != trainer.global_step:
        return None
    message = (f"CompressedDDPStrategy: the fit stopped at step {step}, {counted(lu.steps_since_sync, 'step')} after "
               f"the last {lu.name} sync, and a checkpoint was written at that step before the final sync that runs "
               "now: its state_dict holds rank 0's own parameters, not the synchronized model the module holds after "
               "the fit (a resume from it continues exactly, every rank from its own parameters); call "
               "trainer.save_checkpoint(...) after fit for a file of the synchronized model")
    rank_zero_warn(message)
    return message


class EpochLengthCheck:
    """Mixin for a Lightning strategy of several processes (put it before the strategy class): every rank raises
    :func:`check_epoch_lengths`'s ConfigError at an epoch's first training batch when the ranks' epochs differ in
    length. Under Lightning's plain ``DDPStrategy`` 10 batches on rank 0 and 12 on rank 1 ended with rank 0 exiting 0
    after 10 steps and rank 1 failing in its 11th step's gradient all-reduce (gloo's 'Connection closed by peer')."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        check_epoch_lengths(self, self.lightning_module.trainer, batch_idx)  # once an epoch, on every rank
        super().on_train_batch_start(batch, batch_idx)


def _all_gather_number(value: float, world_size: int, device: Any) -> list[float]:
    """Every rank's ``value``, in rank order (``world_size`` values)."""
    import torch

    from lit_dtrain.utils.distributed import all_gather_stacked, naming_peer_failures

    with naming_peer_failures():
        return all_gather_stacked(torch.tensor([value], dtype=torch.float64, device=device)).reshape(-1).tolist()
