"""scripts/bench_fourier.py: the oracle references draw the mixture's random windows at the stated share; lag
variants, the library token loss, the split warning once, and the timing lines."""

from __future__ import annotations

import logging
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


def _old_step_token_loss(model, batch) -> torch.Tensor:
    """bench_fourier.train_step's token loss before it used lit_dtrain.module.token_loss (the reference figures)."""
    logits = model(batch["input_ids"])
    B, T, V = logits.shape
    return torch.nn.functional.cross_entropy(logits.float().view(B * T, V), batch["labels"].view(B * T),
                                             reduction="none").view(B, T)


TINY = type("Args", (), {"n_layer": 1, "d_model": 16, "n_head": 2, "n_kv_head": 1, "device": "cpu"})


def _step(bench, batch, seed: int = 0):
    from lit_dtrain.schedules.lr import cosine_scheduler

    model = bench.model_for(8, seed, TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = cosine_scheduler(opt, warmup_steps=1, total_steps=10)
    return model, bench.train_step(model, opt, sched, batch, 1.0)


def test_train_step_and_evaluate_use_the_library_token_loss(bench):
    """The benchmark's loss is LitLLM's: bitwise the same figures for ids in the vocabulary, and a -100 label fails
    (cross_entropy's default ignore_index made it a token of loss 0, which LitLLM no longer does)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(257, (3, 9), generator=g)
    batch = {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}
    expected = _old_step_token_loss(bench.model_for(8, 0, TINY), batch)
    _, got = _step(bench, batch)
    assert torch.equal(got, expected.detach())
    vals = [("a", ids)]
    model = bench.model_for(8, 0, TINY)
    with torch.no_grad():
        logits = model(ids[:, :-1])
        old_sum = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                          reduction="sum"))
    assert bench.evaluate(model, vals, batch=len(ids))[0] == old_sum / ids[:, 1:].numel()
    bad = {k: v.clone() for k, v in batch.items()}
    bad["labels"][1, 3] = -100
    with pytest.raises((IndexError, RuntimeError)):
        _step(bench, bad)
    with pytest.raises((IndexError, RuntimeError)):
        bench.evaluate(model, [("a", torch.cat([ids[:, :5], torch.full((3, 1), -100), ids[:, 6:]], 1))], batch=3)


def test_a_source_without_a_val_window_is_named_not_divided_by_zero(bench):
    """A val stream shorter than one window gave the source no val windows and evaluate a ZeroDivisionError (its
    tokens counted 0). LMDataModule holds out at least one window per source, so only a caller of val_set with
    another datamodule reached it; the source is named now, before any training."""
    import types

    import numpy as np

    short = types.SimpleNamespace(val=np.arange(10, dtype=np.uint16))
    enough = types.SimpleNamespace(val=np.arange(40, dtype=np.uint16))
    dm = types.SimpleNamespace(sources=[types.SimpleNamespace(name="code"), types.SimpleNamespace(name="prose")],
                               splits=[enough, short], block_size=16)
    with pytest.raises(ValueError, match=r"^data source 'prose': its val split has 10 tokens, no window of "
                                         r"block_size\+1 = 17 to evaluate on$"):
        bench.val_set(dm, "mixture", 8)


def test_the_mixture_split_warning_is_printed_once_a_benchmark(bench, tmp_path, caplog):
    """Every run (and each sampler of the interleaved timing) builds its own LMDataModule, and each load of the small
    mixture's token cache warned its tail split again (each of 2 sources: 3 times for the timing and once per run)."""
    from types import SimpleNamespace

    args = SimpleNamespace(corpora=["mixture"], block_sizes=[64], variants=["uniform", "mag_freq"], long_variants=[],
                           seeds=[0], steps=2, tokens_per_step=128, eval_every=1, val_windows=4, eval_batch=4,
                           mixture_kb=48, n_layer=1, d_model=16, n_head=2, n_kv_head=1, lr=1e-3, timing_steps=1,
                           timing_rounds=1, timing_lags=[0, 1], threads=1, device="cpu",
                           cache_dir=str(tmp_path / "cache"), out=None)
    filters = list(logging.getLogger("lit_dtrain.data.corpus").filters)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.corpus"):
        runs, timing = bench.train_all(args)
    assert [r["variant"] for r in runs] == ["uniform", "mag_freq"] and "mixture" in timing
    split = [r.getMessage() for r in caplog.records if "too few documents for a by-document" in r.getMessage()]
    assert [m.split(":")[0] for m in split] == ["data source 'boilerplate'", "data source 'random'"], split
    assert logging.getLogger("lit_dtrain.data.corpus").filters == filters  # the filter ends with the benchmark


def test_the_timing_lines_name_each_ms_figure_in_the_ratios_order(bench, capsys):
    """The line read 'ratio fourier/uniform: 0.8793 (...; 21.7 vs 19.1 ms/step': uniform's ms first, beside a
    fourier/uniform ratio, so the slower side read as the sampler's. Each figure is named now, numerator first."""
    import argparse

    timing = {"mixture": {"uniform_ms": 21.7, "fourier_ms": 19.1, "wall_ratio": 0.8793, "round_ratios": [0.8793],
                          "num_samples": 646, "pipelined_uniform_ms": 20.0, "pipelined_fourier_ms": 25.0,
                          "pipelined_ratio": 1.25, "pipelined_round_ratios": [1.25]}}
    bench.summarize([], timing, argparse.Namespace(steps=4, block_sizes=[32], timing_steps=2))
    out = capsys.readouterr().out
    assert "ratio fourier/uniform: 0.8793 (rounds [0.8793]; fourier 19.1 vs uniform 21.7 ms/step, N=646)" in out
    assert "ratio fourier/uniform: 1.2500 (rounds [1.25]; fourier 25.00 vs uniform 20.00 ms/step)" in out
