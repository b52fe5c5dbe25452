"""``lit_dtrain.strategies.fit_end``'s predictions against what Lightning then does, in real one-process fits
(thirteenth hand mutation audit: its rules ran only in 2-rank gloo fits, and 14 of its first 17 single-point mutants
passed its unit tests). During each optimizer step (``on_before_optimizer_step``: the counters the strategy reads there)
``is_last_optimizer_step`` must be True exactly at the fit's last step, and ``validates_after_this_step`` exactly
at the steps Lightning validates after; ``force_sync_this_step`` / ``force_sync_after_batch`` follow them under
``sync_on_last_step`` / ``sync_before_validation``, and a manual-optimization batch's reasons wait for its end."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset
from torch.utils.data import DataLoader

from lit_dtrain.strategies import LocalSGD
from lit_dtrain.strategies.fit_end import (
    force_sync_after_batch,
    force_sync_this_step,
    is_last_optimizer_step,
    note_checkpoint,
    validates_after_this_step,
    warn_checkpoint_before_final_sync,
)


def _rule(last: bool, validation: bool) -> SimpleNamespace:
    return SimpleNamespace(local_update=LocalSGD(sync_period=4), sync_on_last_step=last,
                           sync_before_validation=validation)


class Predict(L.Callback):
    """Records, at each optimizer step (numbered from 1), the rules' answers; and the steps Lightning validated after
    and ended at."""

    def __init__(self) -> None:
        self.last, self.validates, self.forced_last, self.forced_val, self.going_on = [], [], [], [], []
        self.validated_after: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step + 1
        if is_last_optimizer_step(trainer):
            self.last.append(step)
        if validates_after_this_step(trainer):
            self.validates.append(step)
        stop = trainer.should_stop
        if validates_after_this_step(trainer, stop_counts=False):  # as if no stop were asked
            self.going_on.append(step)
        assert trainer.should_stop == stop  # a stop asked stays asked
        if force_sync_this_step(_rule(True, False), trainer):
            self.forced_last.append(step)
        if force_sync_this_step(_rule(False, True), trainer):
            self.forced_val.append(step)
        assert not force_sync_this_step(_rule(True, True), trainer, manual=True)  # a manual batch waits its end

    def on_validation_start(self, trainer, pl_module) -> None:
        assert not validates_after_this_step(trainer)  # no training batch in progress: asked there, it was True
        if not trainer.sanity_checking:
            self.validated_after.append(trainer.global_step)


class Model(BoringModel):
    def __init__(self, batches: int, iterable: bool = False, stop_in_step: int | None = None) -> None:
        super().__init__()
        self.batches, self.iterable, self.stop_in_step = batches, iterable, stop_in_step

    def training_step(self, batch, batch_idx):
        if self.stop_in_step is not None and self.trainer.global_step + 1 >= self.stop_in_step:
            self.trainer.should_stop = True  # asked inside each step from then (as EarlyStopping asks again)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        data = RandomIterableDataset(32, self.batches) if self.iterable else RandomDataset(32, self.batches)
        return DataLoader(data, batch_size=1)

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 2), batch_size=1)


def _fit(batches: int, iterable: bool = False, stop_in_step: int | None = None, **trainer_kw) -> tuple[Predict, int]:
    predict = Predict()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[predict], **trainer_kw)
    trainer.fit(Model(batches, iterable, stop_in_step))
    return predict, trainer.global_step


CASES = {
    "max_steps_mid_epoch": (5, {"max_steps": 7}),
    "max_steps_at_an_epoch_end": (2, {"max_steps": 4, "max_epochs": 10}),
    "max_epochs_under_max_steps": (3, {"max_epochs": 2, "max_steps": 100}),
    "max_epochs_accumulating": (5, {"max_epochs": 2, "accumulate_grad_batches": 2}),  # the epoch's 5th batch steps
    "one_epoch_accumulating_3": (7, {"max_epochs": 1, "accumulate_grad_batches": 3}),
    "val_every_2_batches": (6, {"max_epochs": 2, "val_check_interval": 2}),
    "val_every_2nd_epoch": (3, {"max_epochs": 4, "check_val_every_n_epoch": 2}),
    "val_across_epochs": (3, {"max_steps": 8, "val_check_interval": 5, "check_val_every_n_epoch": None}),
    "limit_train_batches": (10, {"max_epochs": 2, "limit_train_batches": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_last_step_and_the_validations_are_predicted_during_the_step(case):
    batches, kw = CASES[case]
    predict, steps = _fit(batches, **kw)
    assert predict.last == [steps], case
    assert predict.forced_last == [steps]
    assert predict.validates == predict.validated_after == predict.forced_val == predict.going_on, case
    assert predict.validated_after  # every case validates at least once


def test_an_iterable_loader_without_a_length_ends_its_epoch_at_its_last_batch():
    """``num_training_batches`` is inf: the epoch's last batch is the data fetcher's ``is_last_batch``."""
    predict, steps = _fit(5, iterable=True, max_epochs=2, accumulate_grad_batches=2)
    assert steps == 6 and predict.last == [6]
    assert predict.validates == predict.validated_after == [3, 6]


@pytest.mark.parametrize(("min_steps", "steps", "validated", "last"), [(None, 3, [3], []), (5, 10, [], [10])])
def test_a_stop_asked_inside_the_step_validates_after_it_unless_min_steps_holds_it_off(min_steps, steps, validated,
                                                                                      last):
    """A stop asked in ``training_step`` from step 3 of 10 on: Lightning validates after step 3 and ends the fit (an
    early stop is no last step known ahead). With ``min_steps=5`` (and the ``min_epochs=1`` Lightning adds) it is
    held off to the epoch's end, so no step validates (``val_check_interval=100``) and step 10 is the last."""
    predict, fit_steps = _fit(10, stop_in_step=3, max_epochs=1, min_steps=min_steps, check_val_every_n_epoch=None,
                              val_check_interval=100)
    assert fit_steps == steps
    assert predict.validates == predict.validated_after == predict.forced_val == validated
    assert predict.last == predict.forced_last == last
    assert predict.going_on == []  # a fit going on would validate at batch 100


class ManualModel(Model):
    """``steps`` optimizer steps a batch (manual optimization): ``force_sync_after_batch`` asked at the end of each
    ``training_step``, where ``CompressedDDPStrategy.training_step`` asks it."""

    def __init__(self, batches: int, steps: int) -> None:
        super().__init__(batches)
        self.automatic_optimization = False
        self.steps, self.forced_last, self.forced_val, self.validated_at = steps, [], [], []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(self.steps):
            opt.zero_grad()
            self.manual_backward(self.step(batch))
            opt.step()
        trainer = self.trainer
        if force_sync_after_batch(_rule(True, False), trainer):
            self.forced_last.append(batch_idx)
        if force_sync_after_batch(_rule(False, True), trainer):
            self.forced_val.append(batch_idx)

    def on_validation_start(self) -> None:
        self.validated_at.append(self.trainer.global_step)


@pytest.mark.parametrize(("steps", "kw", "last_batch", "val_batches"), [
    (2, {"max_steps": 6, "val_check_interval": 2, "check_val_every_n_epoch": None}, 2, [1]),
    (2, {"max_epochs": 1, "val_check_interval": 2}, 4, [1, 3]),  # the epoch's 5th batch: no validation (5 % 2)
    (1, {"max_steps": 3, "val_check_interval": 100, "check_val_every_n_epoch": None}, 2, []),  # not after step 2
])
def test_a_manual_batch_syncs_after_its_last_step_at_the_fits_end_and_before_a_validation(steps, kw, last_batch,
                                                                                         val_batches):
    module = ManualModel(5, steps)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
    trainer.fit(module)
    assert module.forced_last == [last_batch]
    assert module.forced_val == val_batches
    assert module.validated_at == [steps * (b + 1) for b in val_batches]
    assert not force_sync_after_batch(_rule(True, True), SimpleNamespace(training=False))  # outside training


def test_a_checkpoint_one_step_after_a_sync_is_warned_about():
    """``steps_since_sync`` 1 is between syncs too (``> 1`` in ``note_checkpoint`` passed the 2-step test)."""
    from tests.unit.test_fit_end_checkpoint import _strategy

    strategy = _strategy(1, 5)
    note_checkpoint(strategy, {"global_step": 5})
    with pytest.warns(UserWarning, match=r"stopped at step 5, 1 step after the last local_sgd sync"):
        assert warn_checkpoint_before_final_sync(strategy) is not None
