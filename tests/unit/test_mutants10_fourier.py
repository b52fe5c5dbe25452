"""Exact results of the FourierSampler's draws and table updates (``data/samplers/fourier.py``, its draw/state code;
the band, moment and mixing math is pinned elsewhere) where single-point mutants passed
test_fourier_sampler_lag_and_resume.py, test_fourier_sampler_probabilities.py, test_fourier_sampler_spikes.py,
test_fourier_sampler_padding.py and test_fourier_sampler_arguments.py (tenth hand mutation audit)."""

from __future__ import annotations

import torch

from tests.unit._fourier_helpers import feed, make


def test_lag_one_draws_step_two_after_its_first_update_is_queued_not_applied():
    """lag=1 without a feeder declared (``require_updates`` on): step 1's update is pending, not applied, when step 2
    is drawn (it lands at step 2's observe). A queued update counts as fed: the draw of step 2 is the prior's draw
    (the table is empty still), where counting applied updates alone raised 'never received a training update'."""
    s = make(step_unit=1, lag=1)
    prior = make(step_unit=1, require_updates=False)
    s.observe(torch.rand(4, 64), s.global_batch(1, 4), 1)
    assert s.updates == 0 and [u.step for u in s._pending] == [1]
    assert torch.equal(s.global_batch(2, 16), prior.global_batch(2, 16))


def test_an_update_whose_every_row_is_not_finite_counts_as_an_update_and_learns_nothing():
    """A step whose 4 rows all overflowed (NaN token loss) is an update received (``updates`` 1, ``last_step`` 1):
    the feeder is there, so the ``require_updates`` check is satisfied. Its rows are skipped (``nonfinite_skipped``
    4) and the table is as before. Counted only when a row was kept, it left ``updates`` 0, and the draw of step 2
    raised 'never received a training update' with the callback attached."""
    s = make(step_unit=1)
    s.observe(torch.full((4, 64), float("nan")), torch.tensor([0, 1, 2, 3]), 1)
    assert (s.updates, s.last_step, s.nonfinite_skipped) == (1, 1, 4)
    assert not s.visits.any() and not s.m1.any() and not s.m2.any()
    assert torch.equal(s.global_batch(2, 16), make(step_unit=1, require_updates=False).global_batch(2, 16))


def test_a_second_setup_on_the_same_dataset_keeps_the_learned_table():
    """``setup`` again with the same number of windows (a second fit, or a validate, on the same datamodule) keeps
    the table it learned, as the base keeps its exclusions; emptying it on every setup threw the table away and drew
    step 4 from the prior. A new size starts the table over (its rows would index other windows)."""
    s = make(step_unit=1)
    feed(s, 3)
    m1, visits, draw = s.m1.clone(), s.visits.clone(), s.global_batch(4, 16)
    s.setup(50)
    assert torch.equal(s.m1, m1) and torch.equal(s.visits, visits)
    assert int(visits.sum()) == 21  # 24 draws, 3 of them a repeat within a step
    assert torch.equal(s.global_batch(4, 16), draw)
    s.setup(60)
    assert s.m1.shape == (60,) and not s.visits.any()


def test_stage_bands_off_keeps_a_profile_of_num_bands_alone():
    """``stage_bands=False`` scores with ``num_bands`` at every stage, so the band profile holds 4 bands (fp16), not
    the stage table's finest 8: the table is 4 + 4 + 4 + 2 * 4 + 1 = 21 bytes a sample (m1, m2, visits, profile,
    excluded), where sizing the profile for the stages' bands whenever stages were on made it 29."""
    s = make(num_bands=4, max_freq=16, stage_bands=False)
    s.observe(torch.rand(2, 64), torch.tensor([0, 1]), 1)
    assert s.fine_bands == 4 and s.profile.shape == (50, 4) and s.bytes_per_sample()["table"] == 21.0
    assert make(num_bands=4, max_freq=16).fine_bands == 0  # bound at the first update
