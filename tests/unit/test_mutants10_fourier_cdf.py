"""Exact results of the FourierSampler's two-level sampling CDF (``data/samplers/fourier_cdf.py``) where single-point
mutants passed test_fourier_sampler_probabilities.py, test_fourier_sampler_spread.py and
test_fourier_sampler_spikes.py (tenth hand mutation audit). The reference is the flat one: the probabilities of
``spectral.importance`` and ``spectral.sampling_probabilities`` over the whole table, and inverse-CDF draws from the
flat prefix sums of its two parts (the target for ``u < uniform_floor``, the weights for the rest)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.data.samplers import spectral as S
from tests.unit._fourier_helpers import feed, make


def _reference(s):
    """(probabilities, target, weights) of ``s``'s table, from the whole-table functions (no blocks, no cache)."""
    raw = S.importance(s.m1, s.m2, s.visits, s.variant, momentum=s.momentum, min_prob=s.min_prob,
                       max_prob=s.max_prob, magnitude_cap=s.magnitude_cap, prior=s.prior, eps=s.eps,
                       excluded=s.excluded if s.num_excluded else None)
    p = S.sampling_probabilities(raw, s.uniform_floor, s.excluded, s.base_weights)
    base = torch.ones(s.num_samples, dtype=torch.float64) if s.base_weights is None else s.base_weights.clone()
    target = base.masked_fill(s.excluded, 0.0)
    target = target / target.sum()
    return p, target, raw * target


def _reference_draws(s, u):
    """Inverse-CDF draws by the flat prefix sums: ``u < f`` from the target at ``u / f``, the rest from the weights
    at ``(u - f) / (1 - f)``."""
    _, target, w = _reference(s)
    f = s.uniform_floor
    t_cdf, w_cdf = target.cumsum(0), w.cumsum(0)
    from_target = torch.searchsorted(t_cdf, (u / f) * t_cdf[-1], right=True)
    from_w = torch.searchsorted(w_cdf, ((u - f) / (1 - f)) * w_cdf[-1], right=True)
    return torch.where(u < f, from_target, from_w).clamp_(max=s.num_samples - 1)


def _mixture_sampler(variant, **kw):
    """600 windows (three blocks, the last partial), a mixture prior of 3:1 on the first 200, windows 7, 300 and
    599 excluded before any update, then 12 steps of updates (each rescans only the blocks it touched); ``max_prob``
    10 so that moment_ratio's weights are not all clamped to 1 (the target itself)."""
    n = 600
    s = make(num_samples=n, variant=variant, stages=False, score="time", uniform_floor=0.25,
             max_prob=10.0, **kw)
    s.setup(n, torch.where(torch.arange(n) < 200, 3.0, 1.0), seed=0)
    s.exclude([7, 300, 599])
    feed(s, 12, batch=32, hot=set(range(0, n, 11)))
    return s


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_probabilities_and_draws_under_a_mixture_prior_equal_the_flat_reference(variant):
    """With a mixture prior and exclusions, the sampler's probabilities are the flat reference's to 1e-12, its
    draws of step 12 are the flat inverse CDF's, index for index, and an excluded window has probability 0 and is
    never drawn. Weights of the updated samples refreshed without their target share (moment_ratio's incremental
    path), or magnitude weights read without it, drew from importance alone; the floor drawn at ``u`` rather
    than ``u / f`` took its whole share from the first quarter of the target's CDF."""
    s = _mixture_sampler(variant)
    ref, target, _ = _reference(s)
    p = s.probabilities(12)
    torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-15)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12) and not p[[7, 300, 599]].any()
    assert 0.5 * float((p - target).abs().sum()) > 0.03  # the table moved it away from the target
    u = torch.rand(4096, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    draws = s._draw(u.clone())
    assert torch.equal(draws, _reference_draws(s, u))
    assert not torch.isin(draws, torch.tensor([7, 300, 599])).any()
    floor = u < s.uniform_floor
    assert int(floor.sum()) > 900 and int((draws[floor] >= 450).sum()) > 100  # the floor reaches the last windows


def test_the_incremental_moment_ratio_weights_keep_the_target_share():
    """The rows an update touched are reweighted as importance times target (the 3:1 prior, 0 excluded), exactly
    what a rebuild from scratch computes: after updates the cached weights ``w`` equal ``elem * target``."""
    s = _mixture_sampler("moment_ratio")
    c = s._distribution()
    w = c["w"][: s.num_samples].clone()
    ref_w = _reference(s)[2]
    torch.testing.assert_close(w, ref_w, rtol=1e-15, atol=0)
    s._touch(raw=True)
    assert torch.equal(s._distribution()["w"][: s.num_samples], w)


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_the_uniform_floor_share_under_a_mixture_prior_is_the_target_not_one_over_n(variant):
    """``uniform_floor=1``: every draw and probability is the target's: 3/1000 for the first 200 windows and
    1/1000 for the others with none excluded (not ``1/N`` = 1/600 everywhere), 0 for an excluded one."""
    n = 600
    s = make(num_samples=n, variant=variant, stages=False, score="time", uniform_floor=1.0)
    s.setup(n, torch.where(torch.arange(n) < 200, 3.0, 1.0), seed=0)
    feed(s, 3, batch=16)
    p = s.probabilities(3)
    expected = torch.where(torch.arange(n) < 200, 3.0, 1.0).double() / 1000
    torch.testing.assert_close(p, expected, rtol=1e-12, atol=0)
    u = torch.rand(2048, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    draws = s._draw(u.clone())
    assert torch.equal(draws, _reference_draws(s, u)) and 0.55 < float((draws < 200).double().mean()) < 0.65
    s.exclude([0])
    p = s.probabilities(3)
    assert p[0] == 0.0 and float(p[1]) == pytest.approx(3 / 997, rel=1e-12)


def test_distribution_stats_leave_out_excluded_windows():
    """``prob_max_ratio`` / ``prob_min_ratio`` are over the drawable windows: with windows excluded they are the
    reference's finite max and min of ``p / target`` over the others (not NaN from an excluded window's 0 / 0)."""
    s = _mixture_sampler("magnitude")
    ref, target, _ = _reference(s)
    stats = s.distribution_stats()
    keep = target > 0
    ratio = ref[keep] / target[keep]
    assert stats["prob_max_ratio"] == pytest.approx(float(ratio.max()), rel=1e-12)
    assert stats["prob_min_ratio"] == pytest.approx(float(ratio.min()), rel=1e-12)
    assert stats["prob_min_ratio"] >= s.uniform_floor and stats["prob_max_ratio"] > 1.0
    assert stats["entropy"] == pytest.approx(-float((ref[keep] * ref[keep].log()).sum()), rel=1e-12)


def test_a_magnitude_block_no_update_touched_is_rescanned_when_the_mean_lifts_its_largest_sample_past_the_cap():
    """Two blocks; step 1 scores window 0 (block 0) 1.4 and window 300 (block 1) 1.0: mean 1.2, window 0 at
    1.4 / 1.2 = 1.17 inside the cap 1.5. Step 2 scores windows 301-310 (block 1 only) 0.5: the mean falls to
    7.4 / 12 = 0.617 and window 0 is at 2.27, clamped to 1.5, though no update touched block 0. Its total must be
    rescanned: window 0 then weighs 1.5 of the table's 1.5 + 1.5 (window 300, 1.62 clamped) + 10 * 0.81 + 500 * 1
    (unseen, the prior), as the reference. Rescanning a block only when its smallest mid sample or its low or high
    ones crossed an edge kept block 0 at 2.27 in the total and 1.5 in the draw: probabilities summing to 0.99865."""
    s = make(num_samples=512, variant="magnitude", stages=False, score="time", magnitude_cap=1.5)
    s.observe(torch.tensor([[1.4] * 64, [1.0] * 64]), torch.tensor([0, 300]), 1)
    s.probabilities(1)  # the blocks' clamp classes at mean 1.2
    s.observe(torch.full((10, 64), 0.5), torch.arange(301, 311), 2)
    assert not s.visits[:256].sum() - 1  # block 0: window 0 alone was seen, at step 1
    p, ref = s.probabilities(2), _reference(s)[0]
    assert float(s._distribution()["mean"]) == pytest.approx(7.4 / 12, rel=1e-6)
    torch.testing.assert_close(p, ref, rtol=1e-12, atol=0)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)
    w = torch.tensor([1.5, 1.5] + [0.5 / (7.4 / 12)] * 10 + [1.0] * 500, dtype=torch.float64)
    assert float(p[0]) == pytest.approx(0.9 * 1.5 / float(w.sum()) + 0.1 / 512, rel=1e-6)
