"""Exact horizons of ``WSDScheduler(total_steps=None)`` beside a ``GradientAccumulationScheduler``
(``callbacks/_wsd_horizon.py``) where single-point mutants passed test_wsd_trainer_horizon.py,
test_own_project_reload_dataloaders.py and test_user_project_edges.py (eighth hand mutation audit): an epoch whose
batches do not divide by its accumulation, and a fit bounded by max_steps alone (max_epochs=-1)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lit_dtrain.callbacks import WSDScheduler
from tests.unit._user_project_helpers import UpdateLRs, fit


def test_an_epoch_of_batches_that_do_not_divide_by_the_accumulation_counts_its_last_short_step(tmp_path: Path):
    """{1: 3} over 3 epochs of 8 batches: 8 + ceil(8 / 3) + ceil(8 / 3) = 14 steps (each epoch's last batch steps
    with 2 micro-batches); a horizon of 8 + 2 + 2 = 12 ended the decay two steps before the fit did."""
    wsd, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, record, GradientAccumulationScheduler({1: 3})], max_steps=-1, max_epochs=3)
    assert trainer.global_step == wsd.total_steps == 14 and wsd.decay_steps == 4
    assert record.used[0][-1] == 0.0 and record.used[0][-5] == 1e-2


def test_a_fit_bounded_by_max_steps_alone_takes_it_as_the_horizon_beside_an_accumulation_schedule(tmp_path: Path):
    """``max_epochs=-1`` (no epoch bound): the horizon is ``max_steps``, as Lightning's estimate says; counting the
    schedule's epochs over ``range(-1)`` planned 0 steps and refused the fit as one with no end."""
    wsd, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, record, GradientAccumulationScheduler({1: 2})], max_steps=10, max_epochs=-1)
    assert trainer.global_step == wsd.total_steps == 10
    assert record.used[0] == [1e-2 * wsd.lr_factor(k) for k in range(10)] and record.used[0][-1] == 0.0


def test_a_max_steps_below_the_accumulation_schedules_steps_is_the_horizon(tmp_path: Path):
    """{1: 2} over 3 epochs of 8 batches plans 16 steps; ``max_steps=10`` stops the fit first, so the horizon is 10
    and the decay ends on its last step (a horizon of 16 left the fit at the peak LR, never decayed)."""
    wsd, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, record, GradientAccumulationScheduler({1: 2})], max_steps=10, max_epochs=3)
    assert trainer.global_step == wsd.total_steps == 10 and record.used[0][-1] == 0.0
