"""scripts/bench_fourier.py's oracle references draw the mixture's random windows at the stated share."""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_fourier", "_bench_fourier_oracle")


def random_share(bench, tmp_path, variant: str, steps: int = 150, batch: int = 8) -> float:
    dirs = bench.make_mixture(tmp_path / "mixture", total_kb=48, seed=0)
    sampler = bench.make_sampler(variant, steps)
    dm = bench.make_datamodule("mixture", dirs, 64, batch, 0, sampler, str(tmp_path / "cache"),
                               random_scale=bench.ORACLE_RANDOM_SCALE.get(variant, 1.0))
    names = [s.name for s in dm.sources]
    offsets = dm.train_windows.offsets
    lo, hi = offsets[names.index("random")], offsets[names.index("random") + 1]
    drawn = torch.cat([dm.batch_for_step(step)["index"] for step in range(steps)])
    return float(((drawn >= lo) & (drawn < hi)).double().mean())


def test_the_oracles_scale_the_random_share_of_the_draws(bench, tmp_path):
    uniform = random_share(bench, tmp_path, "uniform")
    half = random_share(bench, tmp_path, "oracle_halfrandom")
    assert 0.12 < uniform < 0.18  # the mixture's 15 % of random characters
    assert random_share(bench, tmp_path, "oracle_norandom") == 0.0
    assert 0.4 * uniform < half < 0.6 * uniform
    assert "oracle_norandom" not in bench.LONG_VARIANTS  # T=1024 runs the grid's long variants only


def test_lag_variants_and_the_timing_of_each_lag(bench, tmp_path):
    """``*_lag1`` variants build the same sampler with lag=1, and the interleaved timing reports a ratio per lag."""
    from types import SimpleNamespace

    a, b = bench.make_sampler("mag_freq", 100), bench.make_sampler("mag_freq_lag1", 100)
    assert (a.lag, b.lag) == (0, 1) and (a.variant, a.score) == (b.variant, b.score) == ("magnitude", "frequency")
    assert "mag_freq_lag1" in bench.LAG_VARIANTS and "uniform_lag1" not in bench.LAG_VARIANTS
    dirs = bench.make_mixture(tmp_path / "mixture", total_kb=48, seed=0)
    args = SimpleNamespace(tokens_per_step=128, seeds=[0], cache_dir=str(tmp_path / "cache"), device="cpu", lr=1e-3,
                           steps=50, timing_lags=[0, 1], timing_rounds=2, timing_steps=2, n_layer=1, d_model=16,
                           n_head=2, n_kv_head=1)
    t = bench.interleaved_timing("mixture", dirs, 64, args)
    for key in ("wall_ratio", "wall_ratio_lag1"):  # the median of the rounds' ratios (no bound on a timing itself)
        rounds = t[key.replace("wall_ratio", "round_ratios")]
        assert len(rounds) == 2 and all(r > 0 for r in rounds)
        assert t[key] == pytest.approx(statistics.median(rounds), abs=1e-4)
    assert t["fourier_ms"] > 0 and t["fourier_lag1_ms"] > 0
