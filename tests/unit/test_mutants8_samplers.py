"""Exact results of the step-indexed samplers' base (``data/samplers/base.py``) where single-point mutants passed
test_data_resume_and_exclusions.py, test_data_batches.py and test_loss_spike_records.py (eighth hand mutation
audit)."""

from __future__ import annotations

import torch

from lit_dtrain.data.samplers.base import draw_from_cdf


def test_a_draw_at_a_cdf_step_takes_the_window_after_it_never_a_zero_weight_one():
    """Window 0 excluded (weight 0: the CDF starts at 0.0): ``u = 0`` must not draw it. The draw is the index ``i``
    with ``cdf[i-1] <= u * total < cdf[i]``, so a ``u * total`` equal to a CDF value goes to the next window of
    positive weight (``searchsorted(right=True)``; ``right=False`` drew the excluded window 0 at u = 0 and window 1
    at u = 0.5)."""
    cdf = torch.tensor([0.0, 0.5, 0.5, 1.0], dtype=torch.float64)  # windows 0 and 2 excluded
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    assert draw_from_cdf(cdf, u).tolist() == [1, 1, 3, 3, 3]


def test_a_sampler_of_ones_own_with_per_step_probabilities_never_draws_an_excluded_window():
    """``IndexSampler``'s contract for a subclass that overrides ``probabilities`` (a distribution per step, drawn by
    ``multinomial``): excluded windows are never drawn again. Its probabilities know nothing of the exclusions, so
    ``global_batch`` masks them; unmasked, the excluded windows came back at their share (here half the draws)."""
    from lit_dtrain.data.samplers.base import IndexSampler

    class Ramp(IndexSampler):
        def probabilities(self, step: int) -> torch.Tensor:
            return torch.full((self.num_samples,), 1.0 / self.num_samples, dtype=torch.float64)

    sampler = Ramp()
    sampler.setup(8, seed=3)
    sampler.exclude([0, 1, 2, 3])
    drawn = torch.cat([sampler.global_batch(step, 64) for step in range(5)])
    assert drawn.min() >= 4 and set(drawn.tolist()) == {4, 5, 6, 7}
