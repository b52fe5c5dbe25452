"""WSDScheduler's own step logic, from the fifth hand mutation audit: results the suite did not pin down."""

from __future__ import annotations

import logging
import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins import MixedPrecision

from lit_dtrain.callbacks import WSDScheduler
from tests.unit._user_project_helpers import fit as foreign_fit
from tests.unit.test_user_project_lr import LRAtEachStepCall, OverflowAtBatch
from tests.unit.test_wsd_callback import LRRecorder, Toy, expected, fit


class OverwritesLRAtBatchEnd(L.Callback):
    """A callback after WSDScheduler that writes an LR at batch end, as one that takes back its own per-step scaling
    there does (``restore_lrs`` after a step the GradScaler skipped writes the scaled step's LR back)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 123.0


def test_the_lr_is_set_again_at_batch_start_after_another_callback_wrote_over_it():
    kw = dict(total_steps=6, warmup_steps=2, decay_steps=2, min_lr_factor=0.1)
    rec = LRRecorder()
    fit(Toy(), [WSDScheduler(**kw), OverwritesLRAtBatchEnd(), rec], max_steps=6)
    assert rec.at_step == expected(range(6), **kw)


def test_a_fit_that_stops_exactly_where_the_decay_starts_is_told_it_ends_in_the_stable_phase(caplog):
    # total_steps=10 with decay_steps=4: the decay is steps 6..9, and a 6-step fit ends at the peak LR, not inside it
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        fit(Toy(), [WSDScheduler(total_steps=10, decay_steps=4)], max_steps=6)
    assert "before the decay starts at step 6" in caplog.text
    assert not [w for w in caught if "inside the decay" in str(w.message)]


def test_a_fit_that_stops_one_step_into_the_decay_is_warned_with_that_steps_lr():
    with pytest.warns(UserWarning, match=r"inside the decay \(steps 6\.\.9.*its last step runs at 0\.75 of the peak"):
        fit(Toy(), [WSDScheduler(total_steps=10, decay_steps=4, decay_type="linear")], max_steps=7)


def fit_accumulating(max_epochs: int, max_steps: int, batches: int) -> tuple[WSDScheduler, L.Trainer]:
    wsd = WSDScheduler(decay_steps=2)
    trainer = L.Trainer(max_epochs=max_epochs, max_steps=max_steps, limit_train_batches=batches, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[wsd, GradientAccumulationScheduler({1: 2})])
    trainer.fit(Toy())
    return wsd, trainer


def test_a_horizon_from_the_trainer_under_an_accumulation_schedule_stops_at_max_steps():
    # epochs of 6 batches at accumulation 1, 2, 2 would take 6 + 3 + 3 = 12 steps; max_steps=5 ends the fit first
    wsd, trainer = fit_accumulating(max_epochs=3, max_steps=5, batches=6)
    assert (wsd.total_steps, trainer.global_step) == (5, 5)


def test_a_horizon_from_the_trainer_counts_an_epochs_short_last_accumulation_as_a_step():
    # 5 batches at accumulation 1, then 2: 5 + ceil(5 / 2) = 8 steps (the epoch's last batch steps alone)
    wsd, trainer = fit_accumulating(max_epochs=2, max_steps=-1, batches=5)
    assert (wsd.total_steps, trainer.global_step) == (8, 8)


class SkippedThenTakenInOneBatch(OverflowAtBatch):
    """Two ``step`` calls of one foreach optimizer per batch; at batch ``bad`` the first overflows, and the GradScaler
    skips it (no post-hook), before the second is taken in the same batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        for call in range(2):
            scale = math.inf if (batch_idx, call) == (self.bad, 0) else 1.0
            self.manual_backward(F.mse_loss(self(x), y) * scale)
            opt.step()
            opt.zero_grad()


def test_manual_optimization_counts_a_skipped_call_followed_by_a_taken_one_in_the_same_batch(tmp_path):
    wsd, record = WSDScheduler(total_steps=8, warmup_steps=2, decay_steps=3, decay_type="linear"), LRAtEachStepCall()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    foreign_fit(tmp_path, [wsd, record], SkippedThenTakenInOneBatch(bad=1, fused=False), max_steps=8, plugins=[plugin])
    assert record.scales[3] == record.scales[2] / 2  # batch 1's first call was skipped
    assert record.lrs == [1e-2 * wsd.lr_factor(k) for k in range(8)] and wsd.updates == [8]
