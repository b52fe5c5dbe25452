"""``lit_dtrain.strategies.fit_end`` where the thirteenth hand mutation audit left holes (fourteenth audit): a
resume from a checkpoint written after a validation (the one case where Lightning sets ``_skip_next_val``), the
8-rank cut of the uneven-epochs error, a checkpoint noted between syncs and then synced at the same step, and a
strategy stepped without a trainer."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lit_dtrain.strategies.fit_end import (
    force_sync_this_step,
    is_last_optimizer_step,
    note_checkpoint,
    uneven_epochs_message,
    validates_after_this_step,
    warn_checkpoint_before_final_sync,
)
from tests.unit.test_fit_end_checkpoint import _strategy
from tests.unit.test_mutants13_fit_end import Model, Predict, _rule


class _SkipSeen(Predict):
    """``Predict``, plus Lightning's ``_skip_next_val`` as each optimizer step sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.skip_in_a_step: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.skip_in_a_step.append(trainer.fit_loop.epoch_loop._skip_next_val)
        super().on_before_optimizer_step(trainer, pl_module, optimizer)


def _fit(tmp_path, ckpt_path=None) -> tuple[_SkipSeen, int]:
    predict = _SkipSeen()
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, filename="{step}")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[predict, saves], max_steps=8,
                        val_check_interval=2, check_val_every_n_epoch=None)
    trainer.fit(Model(6), ckpt_path=ckpt_path)
    return predict, trainer.global_step


def test_a_resume_from_a_checkpoint_written_after_a_validation_is_predicted_and_never_skips_inside_a_step(
        tmp_path, monkeypatch):
    """A checkpoint written after step 2's validation (``ModelCheckpoint`` at the validation's end), resumed: Lightning
    sets ``_skip_next_val`` for the restored batch 2 (no validation again) and clears it in the same iteration, which
    runs no training step. The predictions match Lightning's validations after steps 4, 6 and 8 and its last step 8,
    and no optimizer step sees the flag set, so ``validates_after_this_step`` without its ``_skip_next_val`` term
    answers the same (an equivalent mutant under Lightning 2.6; this test says so if Lightning changes)."""
    straight, steps = _fit(tmp_path)
    assert steps == 8 and straight.validated_after == straight.validates == [2, 4, 6, 8]
    advance_end, skipped_at = _TrainingEpochLoop.on_advance_end, []

    def on_advance_end(loop, data_fetcher):
        if loop._skip_next_val:
            skipped_at.append(loop.trainer.global_step)
        return advance_end(loop, data_fetcher)

    monkeypatch.setattr(_TrainingEpochLoop, "on_advance_end", on_advance_end)
    resumed, steps = _fit(tmp_path / "again", ckpt_path=tmp_path / "ckpt" / "step=2.ckpt")
    assert skipped_at == [2]  # the restored batch: Lightning skipped its validation
    assert steps == 8 and resumed.skip_in_a_step == [False] * 6  # steps 3 to 8
    assert resumed.validates == resumed.validated_after == resumed.forced_val == [4, 6, 8]
    assert resumed.last == resumed.forced_last == [8]


def test_the_uneven_epochs_error_names_8_ranks_of_a_length_and_cuts_the_rest():
    """Up to 8 ranks of one length are named in full; a 9th and later are ', ...' (a cut at 9 ranks, or '>= 8',
    passed the 2- and 3-rank tests)."""
    eight = uneven_epochs_message([10] * 8 + [12], batch_idx=0, global_step=0, max_steps=-1, accumulate=1)
    assert "(ranks 0, 1, 2, 3, 4, 5, 6, 7: 10 batches, its epoch ends after step 10; rank 8: 12 batches" in eight
    nine = uneven_epochs_message([10] * 9 + [12] * 2, batch_idx=0, global_step=0, max_steps=-1, accumulate=1)
    assert ("(ranks 0, 1, 2, 3, 4, 5, 6, 7, ...: 10 batches, its epoch ends after step 10; ranks 9, 10: 12 batches, "
            "its epoch ends after step 12)") in nine


def test_a_checkpoint_noted_between_syncs_then_synced_at_the_same_step_is_not_warned_about():
    """``note_checkpoint`` at step 6, 2 steps after a sync, then a sync at step 6 (the fit's last step or a
    validation's) before the fit's end: the model the module ends with is the synchronized one, and so is every file
    written after it, so nothing is said (the earlier test noted its checkpoint after the sync, where either check
    alone gives None)."""
    strategy = _strategy(2, 6)
    note_checkpoint(strategy, {"global_step": 6})
    strategy.local_update.steps_since_sync = 0
    assert warn_checkpoint_before_final_sync(strategy) is None


def test_a_strategy_stepped_without_a_trainer_forces_no_sync():
    """``CompressedDDPStrategy.optimizer_step`` asks with ``trainer=None`` for a module outside a fit: no last step,
    no validation after it, no early sync (without the None check: AttributeError on ``None.global_step``)."""
    assert is_last_optimizer_step(None) is False
    assert validates_after_this_step(None) is False
    assert force_sync_this_step(_rule(True, True), None) is False



def test_a_duration_is_refused_only_for_a_fit_under_a_local_update_rule():
    """``trainer.validate`` (no steps, no syncs) under local SGD with ``val_check_interval`` a duration goes on; a fit
    is refused (dropping the ``fn == 'fit'`` check refused the validate too)."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import LocalSGD
    from lit_dtrain.strategies.fit_end import refuse_validation_by_time

    strategy = SimpleNamespace(local_update=LocalSGD(sync_period=4))
    trainer = SimpleNamespace(_val_check_time_interval=30.0, state=SimpleNamespace(fn="validate"))
    assert refuse_validation_by_time(strategy, trainer) is None
    trainer.state.fn = "fit"
    with pytest.raises(ConfigError, match=r"^val_check_interval is a duration \(30 s\)"):
        refuse_validation_by_time(strategy, trainer)


def test_a_forced_sync_in_the_step_that_ends_the_period_is_no_extra_sync():
    """At the fit's last step, 3 steps after a sync of period 4, the step in progress (not counted yet) ends the
    period: its sync is one a fit going on makes too, so nothing is kept for a resume; after the batch (counted) 3
    steps are 3 (without the count, a keep at the period's own sync: the resume went on from before it)."""
    from lit_dtrain.strategies.fit_end import only_ends_the_fit

    strategy = _strategy(3, 8)
    strategy.sync_before_validation = False
    assert only_ends_the_fit(strategy, None, counting=True) is False
    assert only_ends_the_fit(strategy, None, counting=False) is True
    strategy.local_update.steps_since_sync = 2
    assert only_ends_the_fit(strategy, None, counting=True) is True


def _validating_trainer(only_because_of_a_stop: bool) -> SimpleNamespace:
    """A trainer in a training step after which Lightning validates: always, or only because a stop was asked."""
    trainer = SimpleNamespace(training=True, sanity_checking=False, _val_check_time_interval=None,
                              should_stop=only_because_of_a_stop)
    epoch_loop = SimpleNamespace(_skip_next_val=False,
                                 _should_check_val_fx=lambda fetcher: trainer.should_stop or not only_because_of_a_stop)
    trainer.fit_loop = SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher=object())
    return trainer


def test_a_sync_before_a_validation_the_fit_makes_anyway_is_not_kept_but_one_for_a_stop_is():
    """2 steps after a sync of period 4, the step in progress forced to sync: before a validation that a fit going on
    makes too (sync_before_validation) it is no extra sync (False); before a validation Lightning runs only because a
    stop was asked it is (True: without stop_counts=False the stop's validation counted as one the fit makes); without
    sync_before_validation a validation is no reason, and the period decides (True: the sync_before_validation check
    dropped gave False)."""
    from lit_dtrain.strategies.fit_end import only_ends_the_fit

    strategy = _strategy(2, 6)
    strategy.sync_before_validation = True
    assert only_ends_the_fit(strategy, _validating_trainer(False), counting=True) is False
    stopped = _validating_trainer(True)
    assert only_ends_the_fit(strategy, stopped, counting=True) is True
    assert stopped.should_stop is True  # the stop stays asked
    strategy.sync_before_validation = False
    assert only_ends_the_fit(strategy, _validating_trainer(False), counting=True) is True
