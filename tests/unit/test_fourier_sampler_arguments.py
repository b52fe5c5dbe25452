"""FourierSampler: bad arguments and band configs are refused with their key named; the spectrum script."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from lit_dtrain.callbacks import FourierSamplerCallback
from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.data.samplers import spectral as S
from lit_dtrain.train import ConfigError, train
from tests.unit._fourier_helpers import FOURIER, make


def test_missing_updates_fail_loudly():
    s = make()
    s.global_batch(0, 4)
    s.global_batch(1, 4)
    with pytest.raises(RuntimeError, match="fourier_sampler"):
        s.global_batch(2, 4)
    make(require_updates=False).global_batch(5, 4)


def test_bad_arguments_name_the_key():
    # it was 'log_every_n_steps must be positive, got 0', not naming the class (AdaptiveGradClip takes the key too)
    with pytest.raises(ValueError,
                       match=r"^FourierSamplerCallback: log_every_n_steps must be an integer >= 1 or None, got 0$"):
        FourierSamplerCallback(log_every_n_steps=0)
    with pytest.raises(ValueError, match="score"):
        FourierSampler(score="spectral")
    with pytest.raises(ValueError, match="variant"):
        FourierSampler(variant="adam")
    with pytest.raises(ValueError, match="uniform_floor"):
        FourierSampler(uniform_floor=1.5)
    s = make()
    with pytest.raises(ValueError, match="T=64"):
        s.observe(torch.rand(2, 64), torch.tensor([0, 1]), 1)
        s.observe(torch.rand(2, 32), torch.tensor([0, 1]), 2)



@pytest.mark.parametrize("kw", [{"num_bands": 0}, {"max_freq": 0}, {"num_bands": -3},
                                {"num_bands": -1, "stages": False}, {"max_freq": -5},
                                {"max_freq": 256, "num_bands": 0}])
def test_non_positive_band_config_is_rejected_not_replaced_by_auto(kw):
    """0 is not "auto" (that is None): num_bands=0 used to be silently replaced by the brief's 4 bands."""
    key = next(k for k in ("max_freq", "num_bands") if k in kw and kw[k] <= 0)
    with pytest.raises(ValueError, match=key):
        FourierSampler(**kw)
    s = make(max_freq=None, num_bands=None, stages=False)  # None still picks the brief's default for T
    s.observe(torch.rand(2, 64), torch.tensor([0, 1]), 0)
    assert (s.max_freq, s.num_bands) == (256, 4)




def test_spectrum_script_rejects_non_positive_band_flags(tmp_path, capfd):
    """scripts/spectrum.py --num-bands 0 (or --max-freq 0) used to plot the auto bands as if the flag were absent."""
    from tests.conftest import run_script

    proc = run_script("spectrum.py", [str(tmp_path / "missing.ckpt"), "--num-bands", "0"], tmp_path, capfd)
    assert proc.returncode == 2 and "argument --num-bands: must be >= 1, got 0" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("cap", [-1.0, 0.0, 1e-5])
def test_magnitude_cap_below_min_prob_is_rejected(cap):
    """magnitude_cap=-1 used to give negative sampling probabilities (clamp(min, max) with max < min is max)."""
    with pytest.raises(ValueError, match="magnitude_cap"):
        FourierSampler(variant="magnitude", magnitude_cap=cap)


def test_spectrum_script_measures_the_runs_corpus_length_and_bands(tiny_cfg, corpus, tmp_path, capsys, monkeypatch):
    """`scripts/spectrum.py <ckpt>` took its "held-out" windows from the stdlib corpus whatever the run trained on,
    at the model's block_size rather than the run's data.block_size, and marked the brief's default bands rather
    than the run's sampler bands. It now reads the run's corpus and window length from <run>/config_resolved.yaml
    and the band layout from the checkpoint's sampler state (flags still override)."""
    import importlib.util
    import json
    import tempfile

    from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet

    bands = ["data.sampler.max_freq=64", "data.sampler.num_bands=3", "data.sampler.stages=false"]
    _, run = train(tiny_cfg(*FOURIER, *bands, "data.block_size=16", "trainer.max_steps=2",
                            "trainer.val_check_interval=2", run="spec"))
    ckpt = Path(run["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    assert ckpt.is_file() and run["datamodule"].sampler.seq_len == 16
    script = Path(__file__).parents[2] / "scripts" / "spectrum.py"
    spec = importlib.util.spec_from_file_location("_spectrum_run", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cache = tmp_path / "spectrum_cache"
    mod.main([str(ckpt), "--out", str(tmp_path / "s.png"), "--windows", "1000", "--cache-dir", str(cache)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dm = LMDataModule(sources=[CorpusSource(name="text", kind="files", paths=[str(corpus)])], block_size=16,
                      batch_size=1, val_fraction=run["datamodule"].val_fraction, cache_dir=str(cache), progress=False)
    dm.prepare_data()
    assert out["windows"] == len(WindowSet([dm.splits[0].val], 16))  # the run's held-out windows
    assert out["block_size"] == 16
    assert (out["max_freq"], out["num_bands"]) == (64, 3)
    assert out["band_lower_bins"] == S.band_lower_bins(64, 3, 16).tolist()
    assert (tmp_path / "s.png").stat().st_size > 0
    early = tmp_path / "early.ckpt"  # the docs' `spectrum.py early.ckpt <run>/checkpoints/last.ckpt`: a copy first
    early.write_bytes(ckpt.read_bytes())  # it took the stdlib corpus at the model's 32 tokens and the brief's bands
    mod.main([str(early), str(ckpt), "--out", str(tmp_path / "e.png"), "--windows", "1000", "--cache-dir", str(cache)])
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: both[k] for k in out if k != "checkpoints" and k != "out"} == {
        k: out[k] for k in out if k != "checkpoints" and k != "out"}
    assert [c["mean_loss"] for c in both["checkpoints"]] == [out["checkpoints"][0]["mean_loss"]] * 2
    systmp = tmp_path / "systmp"  # without --cache-dir: the run's token cache (tokenized again under /tmp before)
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))
    mod.main([str(ckpt), "--out", str(tmp_path / "c.png"), "--windows", "1000"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["windows"] == out["windows"]
    assert list(systmp.iterdir()) == []
    mixture = {"sources": [{"name": "stdlib", "kind": "stdlib"}, {"name": "text", "kind": "files", "paths": ["x"]}]}
    capsys.readouterr()
    with pytest.raises(SystemExit):
        mod.run_source(mixture, None)
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]  # the JSON error line
    assert "mixture of sources ['stdlib', 'text']: pick one with --source" in error
    assert mod.run_source(mixture, "text").paths == ["x"] and mod.run_source(None, None) is None
    other = tmp_path / "other" / "checkpoints"
    other.mkdir(parents=True)
    (other / "x.ckpt").write_bytes(ckpt.read_bytes())
    (other.parent / "config_resolved.yaml").write_text("data:\n  sources:\n  - {name: stdlib, kind: stdlib}\n")
    with pytest.raises(SystemExit):  # overlaid runs of two corpora: one corpus, named
        mod.main([str(ckpt), str(other / "x.ckpt"), "--out", str(tmp_path / "t.png"), "--cache-dir", str(cache)])
    assert "compare them on one corpus with --files" in capsys.readouterr().err


@pytest.mark.parametrize("kw", [{"mix_initial": 1.5}, {"mix_final": -0.2}, {"eps": 0.0}, {"eps": -1e-8}])
def test_mix_weights_outside_0_1_and_a_non_positive_eps_are_rejected(kw):
    """The stage table's mix must lie in [0, 1], the cosine schedule's mix_initial/mix_final were not checked
    (mix_initial=1.5 weighted the time score by -0.5); eps=0 made a zero-score sample's moment ratio 0/0: NaN
    probabilities, and the draws came out of a NaN CDF without an error."""
    with pytest.raises(ValueError, match=next(iter(kw))):
        FourierSampler(**kw)


def test_a_block_size_below_the_samplers_minimum_is_refused_before_any_compute(tiny_cfg, tmp_path):
    """data.block_size=1 with the FourierSampler trained step 0 and failed at the first table update ('token_loss
    needs at least 2 positions for a spectrum, got T=1'): a window of T tokens has T // 2 frequency bins besides the
    mean (bin 0), so the spectrum needs T >= 2. Refused when the datamodule is built, before any corpus is read."""
    cfg = tiny_cfg("data/sampler=fourier", "data.block_size=1", "sample.max_new_tokens=0")
    with pytest.raises(Exception, match=r"data.block_size=1 is below FourierSampler's minimum of 2: .*frequency"):
        train(cfg)
    assert not Path(cfg.paths.cache_dir).exists()  # no token cache built: refused before any compute
    assert not Path(cfg.paths.output_dir).exists()
    metrics, _ = train(tiny_cfg("data/sampler=fourier", "data.block_size=2", "sample.max_new_tokens=0", run="two"))
    assert metrics["steps"] == 6 and math.isfinite(metrics["val_loss"])  # the smallest it supports trains
    # RandomSampler has no such minimum: the config checks refuse a window of 1 token (a model without context)
    with pytest.raises(ConfigError, match=r"^data.block_size=1: a window of 1 token trains the model without context"):
        train(tiny_cfg("data.block_size=1", "sample.max_new_tokens=0", run="random"))


@pytest.mark.parametrize("kw", [{"prior": math.inf}, {"eps": math.inf}, {"min_prob": math.inf, "max_prob": math.inf,
                                                                        "magnitude_cap": math.inf}])
def test_an_infinite_prior_eps_or_min_prob_is_rejected(kw):
    """prior=inf passed the `> 0` check and made every probability NaN: the draws then came out of a NaN CDF (all the
    same index) without an error. eps=inf scored every seen sample min_prob; min_prob=inf gave inf weights."""
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a finite number"):
        FourierSampler(**kw)


@pytest.mark.parametrize("kw", [{"num_bands": 2.5}, {"max_freq": 300.7}, {"num_bands": True}, {"max_freq": "256"}])
def test_a_fractional_band_count_or_edge_is_rejected_not_truncated(kw):
    """num_bands=2.5 was truncated to 2 bands (max_freq=300.7 to 300) without a word; a string failed in int()
    with a message naming no option."""
    key = next(iter(kw))
    with pytest.raises(ValueError, match=rf"FourierSampler {key} must be a positive integer or null"):
        FourierSampler(**kw)
    assert FourierSampler(**{key: 4.0}).__dict__[key] == 4  # a whole float is the integer


@pytest.mark.parametrize("kw", [{"num_bands": 0}, {"max_freq": -4}, {"max_freq": float("nan")}])
def test_a_band_count_or_edge_below_one_is_rejected(kw):
    with pytest.raises(ValueError, match=rf"FourierSampler {next(iter(kw))} must be a positive integer or null"):
        FourierSampler(**kw)


def test_an_infinite_step_unit_is_rejected():
    """step_unit=inf passed the `> 0` check and kept the run in the warmup stage (bands 4, LR x 0.1) for good."""
    with pytest.raises(ValueError, match="step_unit must be finite"):
        FourierSampler(step_unit=float("inf"))
    assert FourierSampler(step_unit=1e9).stage(10**6).name == "warmup"  # a large finite unit is kept


@pytest.mark.parametrize("decay_steps", [0.5, 2.5])
def test_a_fractional_decay_steps_is_used_as_given(decay_steps):
    """decay_steps was truncated by int(): 0.5 passed the `> 0` check, became 0, and the first update after the first
    training step raised 'decay_steps must be positive, got 0'; 2.5 ran the cosine over 2 steps."""
    s = make(stages=False, decay_steps=decay_steps)
    stats = s.observe(torch.rand(2, 16), torch.tensor([0, 1]), step=1)
    assert stats["mix"] == pytest.approx(S.mix_schedule(1, 0.3, 0.7, decay_steps))
    assert s.mix_at(2) == pytest.approx(0.3 + 0.4 * (1 - math.cos(math.pi * min(2 / decay_steps, 1))) / 2)


@pytest.mark.parametrize("kw", [{"stages": "false"}, {"async_op": "false"}, {"importance_weights": 1},
                                {"require_updates": None}, {"lag": True}, {"mix_initial": True}, {"eps": True},
                                {"momentum": "0.5"}, {"step_unit": "1000"}])
def test_a_flag_or_number_of_the_wrong_type_is_refused_naming_it(kw):
    """stages="false" and async_op="false" were taken as true (bool of a non-empty string), lag=True as a lag of 1,
    mix_initial=True as 1.0; momentum="0.5" failed with "'<=' not supported between instances of 'float' and
    'str'", naming no argument."""
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=rf"^FourierSampler:? {name} must be .*got {re.escape(repr(value))}"):
        FourierSampler(**kw)
