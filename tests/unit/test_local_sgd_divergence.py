"""Adaptive local SGD's drift at a sync is ``mean_r ||theta_r - theta_mean||^2 / ||theta_mean||^2``: the sum of the
ranks' squared distances is divided by the number of ranks (left out, 2 ranks read twice the drift, and the period
shrank at half the documented threshold; one rank cannot show it)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.strategies.local_updates import LocalSGD
from tests.unit._compressor_helpers import TwoRankComm, make_params


def test_the_drift_at_a_sync_is_the_ranks_mean_squared_distance_over_the_mean_squared_norm():
    params = make_params()
    flat = torch.cat([p.reshape(-1) for _, p in params]).double()
    gap = 0.3  # the other rank sits 0.3 higher in every coordinate; its squared distance is this rank's
    comm = TwoRankComm(lambda t: t + gap if t.numel() > 1 else t.clone())
    rule = LocalSGD(sync_period=1, adaptive=True, min_period=1, max_period=4, divergence_threshold=1.0)
    assert rule.after_optimizer_step(params, comm)
    mean = flat + gap / 2
    expected = float(((flat - mean).pow(2).sum() + (flat + gap - mean).pow(2).sum()) / 2 / mean.pow(2).sum())
    assert rule.last_divergence == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(torch.cat([p.reshape(-1) for _, p in params]).double(), mean, atol=1e-6)  # averaged
