"""The warnings ``LMDataModule.load_state_dict`` gives when a resumed checkpoint's run drew its data otherwise than this
run will: another data seed, other validation windows, another global batch, another mixture, another dataset. Each
says what differs and how to continue the interrupted run exactly; none refuses the resume."""

from __future__ import annotations

import logging

from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lit_dtrain.data._mixture_resume import mixture_shares, warn_if_the_mixture_changed
from lit_dtrain.data.windows import WindowSet
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.corpus")  # the data's logger (token caches, splits, a resume's data)


def val_counts(datamodule, cap: int) -> list[int]:
    """The windows each source validates on under ``max_val_windows=cap`` (:meth:`LMDataModule.val_dataloader`)."""
    return [min(len(WindowSet([split.val], datamodule.block_size)), cap) for split in datamodule.splits]


def warn_if_the_global_batch_changed(datamodule, state: dict) -> None:
    """A step's batch is ``data.batch_size x ranks x accumulate_grad_batches`` windows: another one warns, another
    split of it (4 x 2 after 8 x 1, an OOM's answer) does not. A checkpoint without one had this run's."""
    saved_windows = state.get("global_batch")  # data.batch_size x ranks of the checkpoint's run
    if saved_windows is None or not int(state.get("micro_step", 1)):
        # a checkpoint that drew no batch has none to keep: Tuner.scale_batch_size restores its step-0 file with
        # the batch size it found, which was told 'this run's are 8 ... (data.batch_size=4 keeps its batch)'
        return
    ranks, accumulation = datamodule._world()[1], datamodule._accumulation()
    accumulation = scheduled_accumulation(datamodule.trainer, state.get("epoch")) or accumulation
    saved = int(saved_windows) * int(state.get("accumulate_grad_batches", accumulation))
    now = datamodule.batch_size * ranks * accumulation
    if saved == now:
        return
    per_rank, rest = divmod(saved, ranks * accumulation)
    log_once(
        log, logging.WARNING,
        "the checkpoint trained on global batches of %d windows (data.batch_size x ranks x "
        "trainer.accumulate_grad_batches), and this run's are %d (data.batch_size=%d on %d rank(s), "
        "accumulate_grad_batches=%d): from here on each step trains on another batch size at the same learning "
        "rate, so the run is not the interrupted one's continuation%s", saved, now, datamodule.batch_size, ranks,
        accumulation, f" (data.batch_size={per_rank} keeps its batch)" if per_rank and not rest else "")


def scheduled_accumulation(trainer, epoch) -> int | None:
    """The accumulation a ``GradientAccumulationScheduler`` of this run gives the checkpoint's ``epoch`` (None without
    one, or for a checkpoint that does not record its epoch). At load the trainer still holds its constructor's value
    (the scheduler sets its own at the next epoch start), so a resume of an epoch it trained at 2 compared 4 x 2 saved
    with 4 x 1 and was told to set data.batch_size=8, though it continued bitwise."""
    schedulers = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, GradientAccumulationScheduler)]
    return schedulers[0].get_accumulate_grad_batches(int(epoch)) if schedulers and epoch is not None else None


def restore_scheduled_accumulation(datamodule) -> None:
    """At the first training batch after a resume: the accumulation a ``GradientAccumulationScheduler`` gives the
    current epoch. Lightning calls no ``on_train_epoch_start`` in an epoch resumed mid-way, where the scheduler sets
    it, so the rest of that epoch ran at the trainer's constructor value: a SIGTERM in epoch 1 of ``{1: 3}`` resumed
    with steps of 1 micro-batch (12 steps where the straight run takes 10, other weights), without a word. (Set at
    the batch, not at the state's load: the scheduler refuses a value other than 1 at train start.)"""
    datamodule._resumed = False
    trainer = datamodule.trainer
    scheduled = scheduled_accumulation(trainer, trainer.current_epoch) if trainer is not None else None
    if scheduled is not None:
        trainer.accumulate_grad_batches = scheduled


def warn_if_the_data_changed(datamodule, state: dict) -> None:
    """The warnings given before the state is applied: another data seed, other validation windows, another global
    batch, another mixture."""
    saved_seed = state.get("seed")
    if saved_seed is not None and int(saved_seed) != datamodule.seed:
        log_once(
            log, logging.WARNING,
            "the checkpoint was trained with data seed %d, and this run's data.seed is %d: from here on the "
            "batches are not those the interrupted run would have drawn (set data.seed=%d, or seed=%d, to "
            "continue it exactly)", int(saved_seed), datamodule.seed, int(saved_seed), int(saved_seed))
    saved_windows = state.get("max_val_windows")  # other windows only where a source has more than the smaller
    if saved_windows is not None and (
        val_counts(datamodule, int(saved_windows)) != val_counts(datamodule, datamodule.max_val_windows)
    ):
        log_once(
            log, logging.WARNING,
            "the checkpoint validated on up to %d windows per source, and this run's data.max_val_windows is %s: "
            "from here on val/loss is measured on other windows, so it is not comparable with the values logged "
            "before, nor with the best checkpoint's score that ModelCheckpoint ranks new ones against",
            int(saved_windows), datamodule.max_val_windows)
    warn_if_the_global_batch_changed(datamodule, state)
    warn_if_the_mixture_changed(state.get("mixture_shares"), mixture_shares(datamodule.sources))


def warn_if_the_dataset_changed(saved_key, key) -> None:
    """Another dataset key (given once the sampler holds the checkpoint's state, which refuses per-window state of other
    data): the corpus, ``data.block_size`` or ``data.val_fraction`` changed since."""
    if saved_key is not None and key is not None and saved_key != key:
        log_once(
            log, logging.WARNING,
            "the checkpoint was trained on dataset %s, and this run's is %s: the corpus (its files or their "
            "contents), data.block_size or data.val_fraction changed since, so from here on the batches are not "
            "those the interrupted run would have drawn, and val/loss is measured on other windows", saved_key, key)
