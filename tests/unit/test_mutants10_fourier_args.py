"""Exact results of the FourierSampler's argument checks (``data/samplers/_fourier_args.py``) where single-point
mutants passed test_fourier_sampler_arguments.py (tenth hand mutation audit)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.data.samplers import FourierSampler


@pytest.mark.parametrize("name", ["momentum", "beta"])
def test_an_ema_rate_of_one_is_refused_as_a_table_that_never_learns(name):
    """``momentum`` and ``beta`` are the EMA rates of the score's moments: at 1.0 an update keeps the old moment
    whole, so ``m1``/``m2`` stay 0 forever and the sampler never leaves its prior. [0, 1) is the range (a ``<= 1.0``
    check took 1.0); 0.999 is taken and learns."""
    with pytest.raises(ValueError, match=rf"FourierSampler {name} must be in \[0, 1\), got 1.0"):
        FourierSampler(**{name: 1.0})
    s = FourierSampler(stages=False, **{name: 0.999})
    s.setup(8)
    s.observe(torch.full((2, 16), 2.0), torch.tensor([0, 1]), 1)
    assert s.m1[0] > 0 and s.m2[0] > 0 and s.m1[2] == s.m2[2] == 0


def test_a_uniform_floor_of_one_is_taken_and_samples_the_prior_alone():
    """``uniform_floor=1.0``: every draw from the uniform (prior) share, whatever the table learned, a control run of
    the sampler with its importance off. [0, 1] is the documented range (a ``< 1.0`` check refused it); after an
    update that scores window 0 far above the rest every probability is still exactly 1/8."""
    s = FourierSampler(stages=False, uniform_floor=1.0)
    s.setup(8)
    loss = torch.ones(2, 16)
    loss[0] += 50 * torch.rand(16, generator=torch.Generator().manual_seed(0))
    s.observe(loss, torch.tensor([0, 1]), 1)
    assert s.visits[:2].tolist() == [1, 1]
    assert torch.equal(s.probabilities(2), torch.full((8,), 1 / 8, dtype=torch.float64))
