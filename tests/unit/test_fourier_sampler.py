"""FourierSampler: spectral core values, schedules, valid probabilities, determinism, exact resume, callback."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import open_dict

from lit_dtrain.callbacks import FourierSamplerCallback, LossSpikeMonitor
from lit_dtrain.data.samplers import FourierSampler, RandomSampler
from lit_dtrain.data.samplers import spectral as S
from lit_dtrain.errors import ConfigError
from lit_dtrain.sweeps import user_error
from lit_dtrain.train import train

# ---- spectral core -------------------------------------------------------------------------------------------


def test_compute_bands_values():
    assert S.compute_bands(256, 4) == [16, 32, 64, 128]
    assert S.compute_bands(1024, 6) == [16, 32, 64, 128, 256, 512]
    assert S.compute_bands(256, 8) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert S.compute_bands(100, 3) == [12, 25, 50]  # int() truncates, as in the brief
    with pytest.raises(ValueError, match="num_bands"):
        S.compute_bands(256, 0)
    with pytest.raises(ValueError, match="max_freq"):
        S.compute_bands(0, 4)


def test_band_edges_map_onto_rfft_bins_of_actual_length():
    # max_freq is the Nyquist bin T//2; the lowest band reaches down to bin 1 (DC is the time score)
    assert S.band_lower_bins(256, 4, 512).tolist() == [1, 32, 64, 128]
    assert S.band_lower_bins(256, 4, 256).tolist() == [1, 16, 32, 64]
    assert S.band_lower_bins(1024, 6, 2048).tolist() == [1, 32, 64, 128, 256, 512]
    assert S.band_lower_bins(256, 8, 512).tolist() == [1, 2, 4, 8, 16, 32, 64, 128]  # exact octaves
    band = S.bin_to_band(256, 4, 256)
    assert band[0] == -1 and band[1] == 0 and band[15] == 0 and band[16] == 1 and band[64] == 3 and band[128] == 3
    assert len(band) == 129


@pytest.mark.parametrize("T", [256, 255, 1024])
def test_band_energies_split_the_variance(T):
    x = torch.randn(5, T, generator=torch.Generator().manual_seed(T)) * 2 + 3
    E = S.band_energies(x, 256, 4)
    assert E.shape == (5, 4) and bool((E >= 0).all())
    torch.testing.assert_close(E.sum(1), x.var(1, unbiased=False), rtol=1e-4, atol=1e-5)  # Parseval


@pytest.mark.parametrize("T", [256, 512, 1024])
def test_sines_land_in_their_band(T):
    t = torch.arange(T, dtype=torch.float32)
    low = torch.sin(2 * math.pi * 2 * t / T)  # 2 cycles per window: long-range
    high = torch.sin(2 * math.pi * (T // 2 - 3) * t / T)  # near Nyquist: token-to-token
    mid = torch.sin(2 * math.pi * (3 * T // 16) * t / T)  # 3/8 of Nyquist: band [1/4, 1/2) of Nyquist = band 2
    E = S.band_energies(torch.stack([low, high, mid]), 256, 4)
    frac = E / E.sum(1, keepdim=True)
    assert frac[0, 0] > 0.999  # the pure low-frequency sine lands in the lowest band
    assert frac[1, 3] > 0.999
    assert frac[2, 2] > 0.999


def test_fine_profile_merges_into_coarse_bands():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(S.merge_bands(S.band_energies(x, 256, 8), 4), S.band_energies(x, 256, 4))
    torch.testing.assert_close(S.merge_bands(S.band_energies(x, 256, 8), 6), S.band_energies(x, 256, 6))


def test_adaptive_band_weights_formula():
    local = torch.tensor([3.0, 4.0])
    w = S.adaptive_band_weights(local, (local**2).sum())
    torch.testing.assert_close(w, torch.tensor([0.6, 0.8]), rtol=1e-6, atol=1e-6)  # one rank: unit norm
    w2 = S.adaptive_band_weights(local, torch.tensor(100.0))  # two ranks with global energy 100
    torch.testing.assert_close(w2, local / (10.0 + 1e-6))


def test_mixing_schedule_endpoints():
    assert S.mix_schedule(0) == pytest.approx(0.3)
    assert S.mix_schedule(10000) == pytest.approx(0.7)
    assert S.mix_schedule(50000) == pytest.approx(0.7)  # clamped after decay_steps
    assert S.mix_schedule(5000) == pytest.approx(0.5)
    values = [S.mix_schedule(s) for s in range(0, 10001, 500)]
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert S.mix_schedule(0, initial=0.9, final=0.1, decay_steps=10) == pytest.approx(0.9)


def test_a_custom_stage_starts_at_the_exact_product_of_its_start_and_the_step_unit():
    """A ``stage_table`` start of 0.07 units of 100 steps begins at step 7: the float product 0.07 * 100 =
    7.000000000000001 moved the stage, and its LR multiplier, to step 8."""
    table = S.parse_stages([["a", 0, 4, 0.3, 1.0], ["b", 0.07, 4, 0.3, 0.5]])
    assert [S.stage_at(step, 100, table).name for step in (6, 7, 8)] == ["a", "b", "b"]
    sampler = FourierSampler(step_unit=100, stage_table=[["a", 0, 4, 0.3, 1.0], ["b", 0.07, 4, 0.3, 0.5]])
    assert (sampler.lr_multiplier(6), sampler.lr_multiplier(7)) == (1.0, 0.5)


def test_stage_schedule_and_switches():
    for step, name in [(0, "warmup"), (4999, "warmup"), (5000, "ramp"), (19999, "ramp"), (20000, "stable")]:
        assert S.stage_at(step, 1000).name == name
    s = FourierSampler()
    assert (s.bands_at(0), s.mix_at(0), s.lr_multiplier(0)) == (4, 0.3, 0.1)
    assert (s.bands_at(7000), s.mix_at(7000), s.lr_multiplier(7000)) == (6, 0.5, 0.5)
    assert (s.bands_at(25000), s.mix_at(25000), s.lr_multiplier(25000)) == (8, 0.7, 1.0)
    half = FourierSampler(step_unit=10)  # scaled: stable from step 200
    assert half.stage(199).name == "ramp" and half.stage(200).name == "stable"
    off = FourierSampler(stage_mix=False, stage_lr=False, stage_bands=False, num_bands=4)
    assert off.lr_multiplier(0) == 1.0 and off.bands_at(25000) == 4
    assert off.mix_at(0) == pytest.approx(0.3) and off.mix_at(10000) == pytest.approx(0.7)  # the cosine
    assert FourierSampler(stages=False).lr_multiplier(0) == 1.0
    assert FourierSampler(score="time").mix_at(25000) == 0.0 and FourierSampler(score="frequency").mix_at(0) == 1.0
    custom = FourierSampler(stage_table=[["a", 0, 2, 0.1, 1.0], ["b", 3, 3, 0.9, 0.5]], step_unit=1)
    assert custom.stage(2).name == "a" and custom.stage(3).bands == 3
    with pytest.raises(ValueError, match="stage_table"):
        FourierSampler(stage_table=[["a", 1, 2, 0.1, 1.0]])



def test_stage_table_rows_as_mappings_from_a_hydra_config():
    """Rows as mappings (documented: "or dicts") arrive from Hydra as DictConfig, which is not a dict: they used
    to be unpacked positionally, i.e. as their keys ("could not convert string to float: 'start'")."""
    from omegaconf import OmegaConf

    rows = [{"name": "warm", "start": 0, "bands": 4, "mix": 0.3, "lr_mult": 0.1},
            {"name": "stable", "start": 2, "bands": 8, "mix": 0.7, "lr_mult": 1.0}]
    expected = (S.Stage("warm", 0.0, 4, 0.3, 0.1), S.Stage("stable", 2.0, 8, 0.7, 1.0))
    assert S.parse_stages(rows) == expected
    assert S.parse_stages(OmegaConf.create(rows)) == expected
    assert FourierSampler(stage_table=OmegaConf.create(rows)).stage_table == expected


_ROW = ["b", 3, 3, 0.9, 0.5]  # a good second row, for the table [["a", 0, 2, 0.1, 1.0], row]


@pytest.mark.parametrize(("row", "match"), [
    (["b", 3, 3, 0.9], r"row 1 \(\['b', 3, 3, 0.9\]\): has 4 fields, needs 5: \[name, start_units"),  # one missing
    ([*_ROW, 7], r"row 1 .*: has 6 fields, needs 5"),
    (["b", "x", 3, 0.9, 0.5], r"row 1 .*: start must be a finite number, got 'x' \(str\)"),
    (["b", 3, "8", 0.9, 0.5], r"row 1 .*: bands must be a finite number, got '8' \(str\)"),
    (["b", 3, 3, None, 0.5], r"row 1 .*: mix must be a finite number, got None"),
    (["b", float("nan"), 3, 0.9, 0.5], r"row 1 .*: start must be a finite number, got nan"),  # passed the order check
    (["b", 3, 2.5, 0.9, 0.5], r"row 1 .*: bands must be a positive integer, got 2.5"),  # was truncated to 2
    (["b", 3, 3, 0.9, float("inf")], r"row 1 .*: lr_mult must be a finite number, got inf"),
    (["b", 3, 3, 1.5, 0.5], r"row 1 .*: mix must be in \[0, 1\], got 1.5"),
    ({"name": "b", "start": 3, "bands": 3, "mix": 0.9}, r"row 1 .*: missing lr_mult \(the keys are"),
    ({"name": "b", "start": 3, "bands": 3, "mix": 0.9, "lr": 0.5}, r"row 1 .*: missing lr_mult; unknown lr"),
    (5, r"row 1 \(5\): a row must be a list \[name, start_units, bands, mix, lr_mult\].*got int"),
    ("bstart", r"row 1 \('bstart'\): a row must be a list"),  # was unpacked letter by letter
    (["b", 0, 3, 0.9, 0.5], r"row 1 \('b'\) starts at 0, not after row 0 \('a'\) at 0: .*increasing order"),
])
def test_a_malformed_stage_table_row_is_named_by_its_index(row, match):
    """A malformed row gave the dataclass's bare TypeError ("Stage.__init__() missing 1 required positional
    argument: 'lr_mult'") or float()'s ValueError, naming neither stage_table nor the row; a NaN start or 2.5 bands
    passed. Now a ValueError names stage_table, the row's index and what is wrong, for lists and mappings."""
    from omegaconf import OmegaConf

    table = [["a", 0, 2, 0.1, 1.0], row]
    with pytest.raises(ValueError, match="stage_table " + match):
        FourierSampler(stage_table=table)
    if isinstance(row, (list, dict)) and not any(isinstance(v, float) and not math.isfinite(v) for v in
                                                 (row.values() if isinstance(row, dict) else row)):
        with pytest.raises(ValueError, match="stage_table " + match):  # as Hydra hands it over
            FourierSampler(stage_table=OmegaConf.create(table))


@pytest.mark.parametrize(("table", "match"), [
    ([["a", 0, 2, 0.1, 1.0], ["b", 5, 3, 0.9, 0.5], ["c", 2, 4, 0.9, 1.0]],
     r"row 2 \('c'\) starts at 2, not after row 1 \('b'\) at 5"),
    ([["a", 1, 2, 0.1, 1.0]], r"row 0 \('a'\) must start at 0, got 1"),
    ([], r"is empty"),
    ("warmup", r"must be a list of \[name, start_units, bands, mix, lr_mult\] rows .*got 'warmup'"),
])
def test_a_stage_table_out_of_order_or_not_a_list_is_named(table, match):
    with pytest.raises(ValueError, match="stage_table " + match):
        FourierSampler(stage_table=table)


def test_a_malformed_stage_table_on_the_command_line_is_named(tmp_path):
    """Through ``python train.py``: the row's error reaches the user in one line, after the config node's name."""
    import subprocess

    from tests.conftest import PYTHON, ROOT, TINY, make_corpus, subprocess_env

    corpus = make_corpus(tmp_path / "corpus", n_files=2)
    cmd = [PYTHON, str(ROOT / "train.py"), *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]",
           "data/sampler=fourier", "data.sampler.stage_table=[[warm,0,4,0.3,0.1],[stable,20,8,0.7]]"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == (
        "error: data.sampler: stage_table row 1 (['stable', 20, 8, 0.7]): has 4 fields, needs 5: "
        "[name, start_units, bands, mix, lr_mult]"), proc.stderr[-3000:]
    assert not (tmp_path / "token_cache").exists()  # refused before the corpus was read


def test_moment_ratio_is_scale_free_and_magnitude_is_not():
    """The brief's |m1|/sqrt(m2) ranks by the score's stability, not its size (a documented finding)."""
    m1, m2 = torch.zeros(3), torch.zeros(3)
    for k in range(400):
        score = torch.tensor([1.0, 10.0, 10.0 if k % 2 else 0.5])  # steady small, steady large, erratic
        m1, m2 = S.update_moments(m1, m2, score)
        if k == 29:  # without bias correction m2 (beta=0.99) lags m1: early on every ratio clamps to 1
            assert S.importance(m1, m2, torch.full((3,), 30)).tolist() == [1.0, 1.0, 1.0]
    visits = torch.full((3,), 400)
    ratio = S.importance(m1, m2, visits, "moment_ratio")
    assert ratio[0] == ratio[1] == 1.0  # both clamp to max_prob: size does not matter
    assert ratio[2] == pytest.approx(5.25 / math.sqrt((100 + 0.25) / 2), rel=0.1)  # erratic: mean/rms ~ 0.74
    mag = S.importance(m1, m2, visits, "magnitude")
    assert mag[1] / mag[0] == pytest.approx(10.0, rel=1e-3)
    unseen = S.importance(m1, m2, torch.tensor([0, 30, 30]), "magnitude", prior=0.5)
    assert unseen[0] == 0.5


# ---- the sampler ---------------------------------------------------------------------------------------------


def feed(sampler: FourierSampler, steps: int, batch: int = 8, T: int = 64, start: int = 0, hot=()):
    """Draw and observe ``steps`` steps with deterministic synthetic token losses (``hot`` indices: high loss)."""
    batches = []
    for step in range(start, start + steps):
        idx = sampler.global_batch(step, batch)
        g = torch.Generator().manual_seed(step)
        loss = torch.rand(batch, T, generator=g) + idx[:, None].float() % 3
        for i, j in enumerate(idx.tolist()):
            if j in hot:
                loss[i] += 4.0
        sampler.observe(loss, idx, step + 1)
        batches.append(idx)
    return torch.stack(batches)


def make(num_samples: int = 50, seed: int = 0, **kw) -> FourierSampler:
    s = FourierSampler(**kw)
    s.setup(num_samples, seed=seed)
    return s


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_probabilities_valid_after_training(variant):
    s = make(variant=variant, uniform_floor=0.2, step_unit=1)
    feed(s, 12)
    s.exclude([3, 4])
    p = s.probabilities(12)
    assert p.dtype == torch.float64 and p.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert p[3] == 0 and p[4] == 0
    active = torch.ones(50, dtype=torch.bool)
    active[[3, 4]] = False
    assert bool((p[active] >= 0.2 / 48 - 1e-15).all())
    drawn = feed(s, 5, start=12)
    assert not bool(((drawn == 3) | (drawn == 4)).any())


@pytest.mark.parametrize("mixture", [False, True], ids=["uniform_prior", "mixture_prior_and_exclusions"])
def test_draws_follow_the_probabilities(mixture):
    """The two-level inverse CDF (blocks of 256, the last one partial here) draws from ``probabilities()``."""
    n = 1000
    s = FourierSampler(variant="magnitude", stages=False, score="time", uniform_floor=0.2)
    base = torch.where(torch.arange(n) < 300, 3.0, 1.0) if mixture else None
    s.setup(n, base, seed=0)
    feed(s, 40, batch=32, hot=set(range(0, n, 7)))
    excluded = [5, 600, 999] if mixture else []
    s.exclude(excluded)
    p = s.probabilities(40)
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float64)
    assert 0.5 * (p - uniform).abs().sum() > 0.15  # far from uniform, so the check below has teeth
    draws = torch.cat([s.global_batch(step, 4096) for step in range(40, 140)])  # no updates in between
    freq = torch.bincount(draws, minlength=n).double() / draws.numel()
    assert freq[excluded].sum() == 0  # excluded: never drawn
    assert 0.5 * (freq - p).abs().sum() < 0.03  # total variation; sampling noise alone is ~0.02
    hot = torch.zeros(n, dtype=torch.bool)
    hot[::7] = True
    assert freq[hot].sum().item() == pytest.approx(p[hot].sum().item(), abs=0.01)


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_incremental_cdf_equals_a_full_rebuild(variant):
    """Updates rescan only their blocks; the result must equal a rebuild from scratch bit for bit (a resumed
    sampler rebuilds everything, so this is what keeps its draws identical to the uninterrupted run's)."""
    s = make(num_samples=5000, variant=variant, step_unit=1)
    feed(s, 30, batch=16)
    c = s._distribution()
    kept = {k: v.clone() for k, v in c.items() if isinstance(v, torch.Tensor)}
    draws = s.global_batch(30, 256)
    s._touch(raw=True)  # drop every cache: the next draw rebuilds all blocks
    c = s._distribution()
    for k, v in kept.items():
        assert torch.equal(c[k], v), k
    assert torch.equal(s.global_batch(30, 256), draws)


def test_magnitude_blocks_are_rescanned_when_the_mean_moves_samples_across_a_clamp():
    """``magnitude`` divides by the mean over seen samples, which moves every step; a block that no update
    touched must still be rescanned when that moves one of its samples across a clamp edge. Tight clamps and
    a hot set that changes make that happen here (checked), and the sampler must agree with the pure
    reference and with a full rebuild at every step."""
    n, lo, cap = 3000, 0.6, 1.4
    s = make(num_samples=n, variant="magnitude", stages=False, score="time", min_prob=lo, magnitude_cap=cap,
             uniform_floor=0.1)
    crossed = 0
    prev = None
    for phase, hot in enumerate([set(range(0, n, 5)), set(range(1, n, 3)), set()]):
        for step in range(phase * 15, phase * 15 + 15):
            before = s.visits.clone()
            feed(s, 1, batch=64, start=step, hot=hot)
            p = s.probabilities(step + 1)
            elem = S.importance_elementwise(s.m1, s.m2, s.visits, "magnitude", momentum=s.momentum)
            seen = s.visits > 0
            x = elem / (elem[seen].sum() / seen.sum())
            cls = torch.where(~seen, 0, torch.where(x < lo, 1, torch.where(x > cap, 2, 3)))
            if prev is not None:
                untouched = s.visits == before
                crossed += int(((cls != prev) & untouched & seen).sum())
            prev = cls
            raw = S.importance(s.m1, s.m2, s.visits, "magnitude", min_prob=lo, magnitude_cap=cap)
            ref = S.sampling_probabilities(raw, 0.1)
            torch.testing.assert_close(p, ref, rtol=1e-9, atol=0)
            c = s._distribution()
            kept = {k: v.clone() for k, v in c.items() if isinstance(v, torch.Tensor)}
            s._touch(raw=True)
            c = s._distribution()
            for k, v in kept.items():
                assert torch.equal(c[k], v), (step, k)
    assert crossed > 50  # the mean did move samples that no update touched across a clamp edge


def test_magnitude_variant_oversamples_persistently_hard_samples():
    hot = set(range(10))
    s = make(num_samples=100, variant="magnitude", stages=False, score="time", uniform_floor=0.1)
    feed(s, 60, hot=hot)
    p = s.probabilities(60)
    assert p[:10].mean() > 2.0 * p[10:].mean()
    ratio = make(num_samples=100, stages=False, score="time")  # the brief's transform: ~uniform
    feed(ratio, 60, hot=hot)
    q = ratio.probabilities(60)
    assert q[:10].mean() < 1.2 * q[10:].mean()


def _block_samples_before_exclusions(self, blocks):
    """``FourierSampler._block_samples`` as it was before excluded samples left the magnitude mean."""
    pos, valid = self._block_positions(blocks)
    seen = ~self._unseen[pos.clamp(max=self.num_samples - 1)] & valid
    return pos, valid, self._elem[pos], seen


def test_magnitude_without_skips_draws_and_weighs_exactly_as_before(monkeypatch):
    """Leaving skipped samples out of the magnitude mean must not change a bit when nothing is skipped (the
    published benchmark grid has no skips): draws of 30 steps with the clamps active, then the probabilities, the
    mean, the next batch and its importance weights equal those of the code before that change, run here too.
    The change acts only when something is excluded, so this passed before it as well: it guards the no-skip path
    against later edits (a mask that drops seen samples fails it)."""

    def run() -> tuple:
        s = FourierSampler(variant="magnitude", step_unit=2, uniform_floor=0.1, importance_weights=True,
                           min_prob=0.3, magnitude_cap=2.0)
        s.setup(700, seed=7)
        draws = feed(s, 30, batch=16, hot=set(range(0, 700, 9)))
        nxt = s.global_batch(30, 16)
        return draws, s.probabilities(30), s._distribution()["mean"], nxt, s.loss_weights(nxt)

    new = run()
    monkeypatch.setattr(FourierSampler, "_block_samples", _block_samples_before_exclusions)
    old = run()
    assert new[2] == old[2] and new[2] != 1.0  # the mean over seen samples, not the no-sample fallback
    for a, b in zip(new[:2] + new[3:], old[:2] + old[3:]):
        assert torch.equal(a, b)
    assert new[1].max() > 1.5 * new[1].min()  # the sampling is not uniform: the mean matters


def test_magnitude_mean_leaves_out_the_samples_of_a_skipped_batch():
    """A loss-spike monitor that skips a step excludes its batch's samples from the sampler, but the callback has
    already scored them (at the spike's loss). Under ``magnitude`` their scores entered the mean that every other
    sample is divided by: a 16-sample batch at loss +30 moved the mean from 1.78 to 3.33 and the other samples'
    probabilities by up to 29 %. The other samples must be drawn exactly as if that batch had never been scored."""

    def run(score_the_spike: bool) -> FourierSampler:
        s = FourierSampler(variant="magnitude", stages=False, score="time", uniform_floor=0.1)
        s.setup(400, seed=3)
        feed(s, 20, batch=16, hot=set(range(0, 400, 10)))
        idx = s.global_batch(20, 16)
        if score_the_spike:
            s.observe(torch.rand(16, 64, generator=torch.Generator().manual_seed(99)) + 30.0, idx, 21)
        s.exclude(idx.tolist())
        return s

    scored, unscored = run(True), run(False)
    assert scored.num_excluded == 16 and not torch.equal(scored.m1, unscored.m1)  # the spike did reach the table
    p = scored.probabilities(21)
    assert torch.equal(p, unscored.probabilities(21))
    assert torch.equal(scored.global_batch(21, 64), unscored.global_batch(21, 64))
    counted = (scored.visits > 0) & ~scored.excluded
    elem = S.importance_elementwise(scored.m1, scored.m2, scored.visits, "magnitude")
    assert scored._distribution()["mean"] == pytest.approx(float(elem[counted].mean()), rel=1e-12)
    raw = S.importance(scored.m1, scored.m2, scored.visits, "magnitude", excluded=scored.excluded)
    torch.testing.assert_close(p, S.sampling_probabilities(raw, 0.1, scored.excluded), rtol=1e-9, atol=0)


def test_time_score_update_and_fp16_profile():
    s = make(score="time", stages=False)
    idx = torch.tensor([7, 7, 9])
    loss = torch.stack([torch.full((64,), 2.0), torch.full((64,), 4.0), torch.full((64,), 1.0)])
    s.observe(loss, idx, 1)
    # a sample drawn twice in one step gets one update with its mean score
    assert s.m1[7].item() == pytest.approx(0.1 * 3.0) and s.m2[7].item() == pytest.approx(0.01 * 9.0)
    assert s.visits[7] == 1 and s.visits[9] == 1 and s.visits[0] == 0
    assert s.profile.dtype == torch.float16 and s.profile.shape == (50, 4)
    assert s.updates == 1 and s.seq_len == 64 and (s.max_freq, s.num_bands) == (256, 4)


def test_frequency_score_is_commensurate_with_loss():
    s = make(score="frequency", stages=False)
    t = torch.arange(64, dtype=torch.float32)
    loss = (3 + torch.sin(2 * math.pi * 2 * t / 64))[None]  # amplitude 1, std 1/sqrt(2), all in band 0
    s.observe(loss, torch.tensor([5]), 1)
    # one rank, one sample: weights are the unit vector of its profile, score = sqrt(energy) = std
    assert s.m1[5].item() == pytest.approx(0.1 * math.sqrt(0.5), rel=1e-3)


def test_determinism_given_seed_and_state():
    a, b = make(seed=3, step_unit=1), make(seed=3, step_unit=1)
    assert torch.equal(feed(a, 8), feed(b, 8))
    c = make(seed=3, step_unit=1)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.probabilities(8), a.probabilities(8))
    assert torch.equal(feed(a, 6, start=8), feed(c, 6, start=8))  # same future draws and updates
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(a, key), getattr(c, key)), key
    assert not torch.equal(feed(make(seed=4, step_unit=1), 8), feed(make(seed=3, step_unit=1), 8))


def _observations(steps: int, batch: int = 8, T: int = 64, n: int = 50) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed (token_loss, index) pairs, one per step, that do not depend on what a sampler draws."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(n, (batch,), generator=g)
        out.append((torch.rand(batch, T, generator=g) * (1 + idx[:, None].float() % 4), idx))
    return out


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_lag_one_draws_from_the_table_through_the_step_before_the_previous_one(variant):
    """lag=1: the draw of step s sees the updates of steps 1 .. s-2, exactly what lag=0 draws after s-2 updates."""
    obs = _observations(9)
    for s in range(2, 10):
        lag0 = make(step_unit=1, variant=variant, require_updates=False)
        lag1 = make(step_unit=1, variant=variant, require_updates=False, lag=1)
        for k in range(s - 2):
            lag0.observe(*obs[k], k + 1)
        for k in range(s - 1):
            lag1.observe(*obs[k], k + 1)
        assert lag1.updates == lag0.updates == s - 2 and len(lag1._pending) == min(s - 1, 1)
        assert torch.equal(lag1.global_batch(s, 64), lag0.global_batch(s, 64)), s
        assert torch.equal(lag1.probabilities(s), lag0.probabilities(s)), s
    assert not torch.equal(lag0.probabilities(9), make(step_unit=1, variant=variant).probabilities(9))  # it learned


def test_lag_one_resumes_exactly_with_its_pending_update(tmp_path):
    straight = make(seed=3, step_unit=1, lag=1)
    expected = feed(straight, 10)
    first = make(seed=3, step_unit=1, lag=1)
    drawn = feed(first, 4)
    torch.save(first.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)  # plain tensors, ints and lists
    assert state["pending_steps"] == [4] and state["updates"] == 3
    resumed = make(seed=3, step_unit=1, lag=1)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([drawn, feed(resumed, 6, start=4)]), expected)
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(straight, key), getattr(resumed, key)), key
    assert straight.updates == resumed.updates == 9
    assert torch.equal(straight.state_dict()["pending_records"][0], resumed.state_dict()["pending_records"][0])


def test_a_lag_one_state_resumed_with_lag_zero_applies_its_pending_update_at_once():
    obs = _observations(5)
    lag0, lag1 = make(stages=False), make(stages=False, lag=1)
    for k, (loss, idx) in enumerate(obs):
        lag0.observe(loss, idx, k + 1)
        lag1.observe(loss, idx, k + 1)
    assert lag1.updates == 4 and lag0.updates == 5
    resumed = make(stages=False)
    resumed.load_state_dict(lag1.state_dict())
    assert resumed.updates == 5 and not resumed._pending
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(lag0, key), getattr(resumed, key)), key


def test_lag_one_keeps_learning_when_the_step_count_starts_over():
    """A second fit with a new Trainer on the same datamodule counts optimizer steps from 0 again. With lag=1 the
    update left pending by the first fit's last step (5) waited for a step above 5, and every later update queued
    behind it: the table stood still through the second fit's first 5 steps. Each observe() now applies the updates
    of the earlier calls, whatever their step number."""
    obs = _observations(8)
    steps = [1, 2, 3, 4, 5, 1, 2, 3]  # a first fit of 5 steps, then a second one
    lag0, lag1 = make(stages=False), make(stages=False, lag=1)
    for (loss, idx), step in zip(obs, steps):
        lag1.observe(loss, idx, step)
    for (loss, idx), step in zip(obs[:7], steps):
        lag0.observe(loss, idx, step)
    assert lag1.updates == lag0.updates == 7 and [u.step for u in lag1._pending] == [3]
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(lag0, key), getattr(lag1, key)), key


def test_damaged_pending_records_are_refused():
    s = make(stages=False, lag=1)
    feed(s, 3)
    state = s.state_dict()
    width = state["pending_records"][0].shape[1]
    for records, match in [(state["pending_records"][0][:, :-2], f"uint8 records \\[n, {width}\\]"),
                           (state["pending_records"][0].float(), "torch.float32")]:
        with pytest.raises(ValueError, match=f"'pending_records' of step 3: expected .*{match}"):
            make(stages=False, lag=1).load_state_dict({**state, "pending_records": [records]})
    bad = state["pending_records"][0].clone()
    bad[0, :8] = torch.tensor([200], dtype=torch.int64).view(torch.uint8)  # sample 200 of 50
    with pytest.raises(ValueError, match=r"names samples outside \[0, 50\)"):
        make(stages=False, lag=1).load_state_dict({**state, "pending_records": [bad]})
    with pytest.raises(ValueError, match="lag must be 0 or 1"):
        FourierSampler(lag=2)


@pytest.mark.parametrize("lag", [0, 1])
def test_lag_one_observe_never_reads_the_token_loss_on_the_host(lag):
    """On a GPU, any host read of the step's token loss (bool, item, .cpu) waits for the step. Meta tensors have no
    data, so such a read fails: with lag=1 observe queues all its work on the token loss's device; lag=0 reads."""
    s = make(stages=False, lag=lag)
    loss, idx = _observations(1)[0]
    meta = loss.to("meta")
    if lag == 0:
        with pytest.raises((RuntimeError, NotImplementedError)):
            s.observe(meta, idx, 1)
        return
    stats = s.observe(meta, idx, 1)
    assert stats["top_band_energy"].device.type == "meta" and stats["nonfinite"] is None
    assert s.updates == 0 and len(s._pending) == 1 and s._pending[0].parts[0].device.type == "meta"


def test_state_dict_is_plain_and_checked(tmp_path):
    s = make(step_unit=1)
    feed(s, 3)
    torch.save(s.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    other = make(num_samples=51)
    with pytest.raises(ValueError, match="'m1'"):
        other.load_state_dict(state)
    partial = {k: v for k, v in state.items() if k != "m2"}
    with pytest.raises(KeyError, match="'m2'"):
        make().load_state_dict(partial)


def _sampler_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.data.samplers"]


def test_a_fourier_sampler_resuming_a_random_sampler_state_starts_its_table_over(tiny_cfg, caplog):
    """RandomSampler's warning on resuming a FourierSampler state says that "a later resume with
    data/sampler=fourier starts it over", but FourierSampler refused a RandomSampler's state with a KeyError ('m1'):
    a run could not switch to data/sampler=fourier on resume. It now keeps the exclusions, warns, and learns a fresh
    table from the resumed step on."""
    random = RandomSampler()
    random.setup(50, seed=0)
    random.exclude([3, 9])
    s = make(step_unit=1)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):  # in train.log, by rank 0
        s.load_state_dict(random.state_dict())
    (line,) = _sampler_lines(caplog)
    assert re.search(r"written by RandomSampler.*2 excluded samples.*table starts empty", line), line
    assert s.excluded.nonzero().flatten().tolist() == [3, 9] and s.updates == 0 and int(s.visits.sum()) == 0
    assert float(s.probabilities(0)[[3, 9]].sum()) == 0.0
    common = ["scheduler=constant", "sample.max_new_tokens=0", "trainer.val_check_interval=3"]
    _, first = train(tiny_cfg(*common, "trainer.max_steps=3", run="switch"))
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        _, resumed = train(
            tiny_cfg(*common, "data/sampler=fourier", "trainer.max_steps=6", f"ckpt_path={ckpt}", run="switch")
        )
    assert ["written by RandomSampler" in line for line in _sampler_lines(caplog)] == [True]
    assert resumed["trainer"].global_step == 6 and resumed["datamodule"].sampler.updates == 3


@pytest.mark.parametrize("rank", [0, 1])
def test_a_random_sampler_resuming_a_fourier_state_says_what_it_drops(caplog, monkeypatch, rank):
    """``data/sampler=random`` resuming a ``data/sampler=fourier`` checkpoint keeps the exclusions and dropped the
    spectral table silently (switching strategies warns in the same situation)."""
    s = make(step_unit=1)
    feed(s, 3)
    s.exclude([7])
    random = RandomSampler()
    random.setup(50, seed=0)
    seen = int((s.visits > 0).sum())
    monkeypatch.setattr(rank_zero_only, "rank", rank)  # every rank resumes it; rank 0 says so (in train.log)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        random.load_state_dict(s.state_dict())
    assert random.excluded.nonzero().flatten().tolist() == [7]
    lines = _sampler_lines(caplog)
    assert len(lines) == (1 if rank == 0 else 0), lines
    if rank == 0:
        assert re.search(rf"written by FourierSampler.*{seen} samples seen.*RandomSampler.*dropped", lines[0])


def test_memory_is_linear_in_samples():
    per = []
    for n in (1000, 4000):
        s = make(num_samples=n, step_unit=1)
        feed(s, 2)
        per.append(s.bytes_per_sample())
    assert per[0] == per[1]
    assert per[0]["table"] == 4 + 4 + 4 + 2 * 8 + 1  # m1, m2, visits, fp16 profile of 8 bands, excluded
    assert per[0]["total"] <= 64



def test_bytes_per_sample_counts_every_per_sample_tensor_held():
    """Under a mixture prior the sampler also holds the prior (float64, 8 B/sample): it was left out."""
    n = 3000
    for base in (None, torch.cat([torch.full((n // 2,), 3.0), torch.ones(n - n // 2)]).double()):
        s = FourierSampler(step_unit=1)
        s.setup(n, base, seed=0)
        feed(s, 2)
        s.global_batch(2, 8)
        held = [v for v in vars(s).values() if isinstance(v, torch.Tensor)]
        held += [v for v in s._cache.values() if isinstance(v, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t.numel() > 1}
        assert s.bytes_per_sample()["total"] == pytest.approx(sum(storages.values()) / n)


def test_importance_weights_are_unbiased():
    s = make(variant="magnitude", importance_weights=True, stages=False)
    feed(s, 10, hot={1, 2})
    p = s.probabilities(10)
    w = s.loss_weights(torch.arange(50))
    torch.testing.assert_close(w.double(), 1.0 / (50 * p), rtol=1e-6, atol=0)
    assert (p * w.double()).sum().item() == pytest.approx(1.0, abs=1e-6)  # E_p[w] = 1
    assert make().loss_weights(torch.arange(4)) is None


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_importance_weights_under_a_mixture_prior_are_target_over_p(variant):
    """With a mixture prior and exclusions the weights are ``target_i / p_i``, so a weighted mean over draws
    from ``p`` estimates the mean under the prior for every per-sample function, not only E_p[w] = 1."""
    n = 40
    base = torch.where(torch.arange(n) < 10, 4.0, 1.0)
    s = FourierSampler(variant=variant, importance_weights=True, stages=False, step_unit=1)
    s.setup(n, base, seed=0)
    feed(s, 10, hot={1, 2, 30})
    s.exclude([5, 33])
    p, target = s.probabilities(10), s.target_distribution()
    assert target[0] == pytest.approx(4 * target[20]) and target[5] == 0  # the prior is far from uniform
    active = target > 0
    w = s.loss_weights(torch.arange(n)).double()
    torch.testing.assert_close(w[active], target[active] / p[active], rtol=1e-6, atol=0)
    f = torch.arange(n, dtype=torch.float64) % 7 + torch.linspace(0, 1, n, dtype=torch.float64)  # any function
    assert (p * w * f)[active].sum().item() == pytest.approx((target * f).sum().item(), rel=1e-6)


def test_missing_updates_fail_loudly():
    s = make()
    s.global_batch(0, 4)
    s.global_batch(1, 4)
    with pytest.raises(RuntimeError, match="fourier_sampler"):
        s.global_batch(2, 4)
    make(require_updates=False).global_batch(5, 4)


def test_bad_arguments_name_the_key():
    # it was 'log_every_n_steps must be positive, got 0', not naming the class (AdaptiveGradClip takes the key too)
    with pytest.raises(ValueError, match=r"^FourierSamplerCallback: log_every_n_steps must be positive, got 0$"):
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


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 40),
    floor=st.floats(0.0, 1.0),
    variant=st.sampled_from(S.VARIANTS),
    data=st.data(),
)
def test_probabilities_are_always_valid(n, floor, variant, data):
    score = st.floats(-50, 50, allow_nan=False, width=32)
    m1 = torch.tensor(data.draw(st.lists(score, min_size=n, max_size=n)))
    m2 = torch.tensor(data.draw(st.lists(st.floats(0, 2500, width=32), min_size=n, max_size=n)))
    visits = torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
    excluded = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    excluded[data.draw(st.integers(0, n - 1))] = False
    raw = S.importance(m1, m2, visits, variant, prior=data.draw(st.floats(1e-3, 10)))
    p = S.sampling_probabilities(raw, floor, excluded)
    assert bool(torch.isfinite(p).all())
    assert p.sum().item() == pytest.approx(1.0, abs=1e-9)
    assert bool((p[excluded] == 0).all())
    assert bool((p[~excluded] > 0).all())
    assert bool((p[~excluded] >= floor / int((~excluded).sum()) * (1 - 1e-12)).all())


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 30),
    variant=st.sampled_from(S.VARIANTS),
    score=st.sampled_from(["mixed", "time", "frequency"]),
    floor=st.floats(0.0, 1.0),
    steps=st.integers(1, 6),
    scale=st.floats(1e-3, 30.0),
    seed=st.integers(0, 2**16),
)
def test_sampler_probabilities_are_always_valid(n, variant, score, floor, steps, scale, seed):
    """Through the sampler itself: any sequence of updates leaves a valid distribution and valid draws."""
    s = make(num_samples=n, variant=variant, score=score, uniform_floor=floor, step_unit=1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    s.exclude([seed % n])
    for step in range(steps):
        idx = s.global_batch(step, 4)
        s.observe(torch.rand(4, 32, generator=g) * scale, idx, step + 1)
    p = s.probabilities(steps)
    active = ~s.excluded
    assert p.sum().item() == pytest.approx(1.0, abs=1e-9)
    assert p[seed % n] == 0 and bool((p[active] > 0).all())
    assert bool((p[active] >= floor / int(active.sum()) * (1 - 1e-9)).all())
    drawn = s.global_batch(steps, 64)
    assert bool(((drawn >= 0) & (drawn < n)).all()) and not bool((drawn == seed % n).any())


# ---- the callback and the trainer ----------------------------------------------------------------------------


class _FakeTrainer:
    def __init__(self, sampler):
        self.datamodule = type("DM", (), {"sampler": sampler})()


def test_callback_rejects_other_samplers_and_missing_keys():
    cb = FourierSamplerCallback()
    with pytest.raises(TypeError, match="FourierSampler.*RandomSampler"):
        cb.sampler_of(_FakeTrainer(RandomSampler()))
    trainer = _FakeTrainer(make())
    trainer.global_step, trainer.accumulate_grad_batches = 1, 1
    with pytest.raises(KeyError, match="'token_loss'"):
        cb.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0), "index": torch.tensor([0])}, None, 0)
    with pytest.raises(KeyError, match="'index'"):
        cb.on_train_batch_end(trainer, None, {"token_loss": torch.rand(1, 8)}, None, 0)



class _Recorder:
    """A stand-in LightningModule: ``log(name, value)`` calls by the trainer's ``global_step`` at the time."""

    def __init__(self, trainer):
        self.trainer, self.logged = trainer, {}

    def log(self, name, value, **kw):
        self.logged.setdefault(self.trainer.global_step, {})[name] = value


def test_logged_entropy_is_of_the_distribution_the_batch_was_drawn_from():
    """On one process observe() applies its update at once: the entropy logged after it was the next draw's."""
    s = make(variant="magnitude", stages=False, uniform_floor=0.0)
    cb = FourierSamplerCallback(log_every_n_steps=1)
    trainer = _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, 1
    module = _Recorder(trainer)
    drawn_from = []
    for step in range(4):
        idx = s.global_batch(step, 8)
        drawn_from.append(S.entropy(s.probabilities(step)))
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        token_loss = torch.rand(8, 32, generator=torch.Generator().manual_seed(step)) * (1 + idx[:, None] % 5)
        cb.on_train_batch_end(trainer, module, {"token_loss": token_loss, "index": idx}, None, step)
    assert len(set(drawn_from)) > 1  # the distribution does move
    assert [module.logged[step + 1]["fourier/prob_entropy"] for step in range(4)] == drawn_from


def _drive(cb, sampler, steps: int, trainer_every: int) -> _Recorder:
    """Run ``cb`` over ``steps`` optimizer steps of batches of 4 drawn from ``sampler``, as Lightning calls it."""
    trainer = _FakeTrainer(sampler)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, trainer_every
    module = _Recorder(trainer)
    for step in range(steps):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        idx = sampler.global_batch(step, 4)
        cb.on_train_batch_end(trainer, module, {"token_loss": torch.rand(4, 32), "index": idx}, None, step)
    return module


def test_logged_lr_multiplier_is_the_one_the_step_used():
    """fourier/lr_mult at step s is the multiplier of step s's update (the pre-step hook reads the step before
    Lightning advances global_step), like fourier/bands and fourier/mix of the same row, not step s + 1's."""
    s = make(step_unit=1)  # stages warmup [0, 5) x0.1, ramp [5, 20) x0.5
    module = _drive(FourierSamplerCallback(log_every_n_steps=1), s, steps=8, trainer_every=1)
    logged = [module.logged[step + 1]["fourier/lr_mult"] for step in range(8)]
    assert logged == [s.lr_multiplier(step) for step in range(8)] == [0.1] * 5 + [0.5] * 3


def test_logged_lr_multiplier_is_one_when_the_callback_does_not_apply_it():
    """With apply_lr_multiplier=False the updates use the unscaled LR, so fourier/lr_mult must say 1.0; it logged
    the stage's 0.1/0.5 although no step used them."""
    s = make(step_unit=1)
    module = _drive(FourierSamplerCallback(log_every_n_steps=1, apply_lr_multiplier=False), s, steps=8, trainer_every=1)
    assert [module.logged[step + 1]["fourier/lr_mult"] for step in range(8)] == [1.0] * 8


def test_trainer_log_every_n_steps_zero_learns_and_logs_nothing():
    """Lightning's log_every_n_steps=0 ("no step logging") made the callback divide by zero at its first batch
    (``global_step % 0``), so a run with data/sampler=fourier died; now the sampler learns and no fourier/* is
    written, as Lightning writes no step metrics."""
    s = make(stages=False)
    module = _drive(FourierSamplerCallback(), s, steps=4, trainer_every=0)
    assert module.logged == {}
    assert s.updates == 4


class _ListLogger:
    """A stand-in logger: ``(step, name, value)`` of every write, in order."""

    def __init__(self):
        self.rows: list[tuple[int, str, float]] = []

    def log_metrics(self, metrics, step):
        self.rows += [(step, name, value) for name, value in metrics.items()]

    def save(self):
        pass


def _drive_fixed(cb, sampler, losses: list[torch.Tensor], index: list[torch.Tensor], every: int = 1):
    """Run ``cb`` over one optimizer step per ``(losses[k], index[k])`` as Lightning calls it, with a logger."""
    trainer = _FakeTrainer(sampler)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, every
    trainer.loggers = [_ListLogger()]
    module = _Recorder(trainer)
    for step, (loss, idx) in enumerate(zip(losses, index)):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        cb.on_train_batch_end(trainer, module, {"token_loss": loss, "index": idx}, None, step)
    return trainer, module


@pytest.mark.parametrize("lag", [0, 1])
def test_the_nonfinite_warning_names_the_last_step_it_counted(lag):
    """The count grows when an update is applied; with lag=1 step s's is applied at step s + 1's end, where the
    warning said "up to step s + 1" although step s + 1's samples were not counted yet. It names the last step
    applied now: step 2 under both lags, written at step 2's end (lag=0) or step 3's (lag=1)."""
    import warnings

    obs = _observations(5, batch=4, T=32)
    losses = [loss.clone() for loss, _ in obs]
    losses[2][1, 5], losses[2][3] = float("nan"), float("inf")
    warned = {}
    cb, s = FourierSamplerCallback(), make(stages=False, lag=lag)
    trainer = _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, 1
    module = _Recorder(trainer)
    for step, (loss, (_, idx)) in enumerate(zip(losses, obs)):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cb.on_train_batch_end(trainer, module, {"token_loss": loss, "index": idx}, None, step)
        warned[step] = [str(w.message) for w in caught if "NaN/inf" in str(w.message)]
    assert [step for step, messages in warned.items() if messages] == [2 + lag]
    assert warned[2 + lag] == ["FourierSampler: 2 sample(s) up to step 2 had a NaN/inf token loss; they are left out "
                               "of the sampling table (counted in fourier/nonfinite_skipped)"]


@pytest.mark.parametrize("every", [1, 2])
def test_lag_one_logs_the_top_band_energy_of_each_logged_step_once_it_has_landed(every):
    """With lag=1, fourier/top_band_energy was read off the GPU at every logged step (a wait for the step). It is
    now written under its own step when it has reached the host with that step's update (the next step's end; the
    last step's at train end): the same (step, value) pairs as with lag=0, where observe() reads it anyway."""
    obs = _observations(6, batch=4, T=32)
    losses, index = [loss for loss, _ in obs], [i for _, i in obs]
    written = {}
    for lag in (0, 1):
        cb = FourierSamplerCallback()
        trainer, module = _drive_fixed(cb, make(stages=False, lag=lag), losses, index, every=every)
        before_end = [(step, v) for step, name, v in trainer.loggers[0].rows if name == "fourier/top_band_energy"]
        cb.on_train_end(trainer, module)
        written[lag] = [(step, v) for step, name, v in trainer.loggers[0].rows if name == "fourier/top_band_energy"]
        logged_steps = [step for step in range(6) if (step + 1) % every == 0]
        assert [step for step, _ in written[lag]] == logged_steps
        # lag=1: each one a step late (on the host by then), the last one at train end
        assert before_end == written[lag][:len(logged_steps) - lag]
        if lag:
            calls = {k: v for k, v in module.logged.items() if "fourier/top_band_energy" in v}
            assert sorted(calls) == [step + 2 for step in logged_steps[:-1]]  # during step + 1 (global_step + 1)
            assert all(isinstance(v, float) for _, v in written[lag])
    assert written[1] == written[0]


@pytest.mark.parametrize("lag", [0, 1])
def test_logged_top_band_energy_is_the_mean_over_the_steps_micro_batches(lag):
    """Under gradient accumulation fourier/top_band_energy was the last micro-batch's value alone (lag 0: the stats of
    the last observe(); lag 1: the last update applied), 1/k of the step's windows. It is the mean over all of them,
    under both lags: here 2 micro-batches a step, whose top band energies differ by a factor of ~100."""
    obs = _observations(6, batch=4, T=32)
    cb, s = FourierSamplerCallback(), make(stages=False, lag=lag)
    trainer = _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 2, 1
    trainer.loggers = [_ListLogger()]
    module = _Recorder(trainer)
    expected = []
    for step in range(3):
        micro = [(obs[2 * step][0] * 10.0, obs[2 * step][1]), obs[2 * step + 1]]
        reference = make(stages=False)
        expected.append(sum(reference.observe(loss, idx, step)["top_band_energy"] for loss, idx in micro) / 2)
        trainer.global_step = step
        for k, (loss, idx) in enumerate(micro):
            cb.on_train_batch_start(trainer, module, None, 2 * step + k)
            trainer.global_step = step + k  # advanced before the batch end of the step's last micro-batch only
            cb.on_train_batch_end(trainer, module, {"token_loss": loss, "index": idx}, None, 2 * step + k)
    cb.on_train_end(trainer, module)
    written = [(step, v) for step, name, v in trainer.loggers[0].rows if name == "fourier/top_band_energy"]
    assert [step for step, _ in written] == [0, 1, 2]
    for (_, value), mean in zip(written, expected):
        assert value == pytest.approx(mean, rel=1e-6)


def test_lag_one_logging_never_reads_the_token_loss_on_the_host():
    """As observe() (see the meta test above), the callback's logging under lag=1 must not read the step's token loss:
    a logged step with meta token losses (no data: any read fails) writes its row; float() of the energy failed."""
    s = make(stages=False, lag=1)
    loss, idx = _observations(1, batch=4, T=32)[0]
    trainer, module = _drive_fixed(FourierSamplerCallback(), s, [loss.to("meta")], [idx])
    row = {name: v for step, name, v in trainer.loggers[0].rows if step == 0}
    assert row["fourier/bands"] == s.bands_at(0) and "fourier/top_band_energy" not in row  # not landed yet
    assert s.updates == 0 and len(s._pending) == 1


class _RecordingSampler(FourierSampler):
    """A FourierSampler that records the (first index, step) of every observe()."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[int, int]] = []

    def observe(self, token_loss, index, step):
        self.seen.append((int(index[0]), step))
        return super().observe(token_loss, index, step)


class _IndexData(L.LightningDataModule):
    """Batches ``{"index": [i]}`` for i in range(epoch_length), one epoch after another, and a recording sampler."""

    def __init__(self, epoch_length: int = 64) -> None:
        super().__init__()
        self.epoch_length = epoch_length
        self.sampler = _RecordingSampler(step_unit=1)
        self.sampler.setup(64, seed=0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([{"index": torch.tensor([i])} for i in range(self.epoch_length)],
                                           batch_size=None)


class _TokenLossModule(L.LightningModule):
    """A plain module returning loss, token_loss and index; ``training_step`` returns None (Lightning's way to skip a
    batch) at the batch indices ``skip``."""

    def __init__(self, skip: tuple[int, ...] = (), lr: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.skip, self.lr = skip, lr

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        token_loss = self.w * torch.linspace(1, 2, 16)[None]
        return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize(("accumulate", "epoch_length"), [(1, 64), (3, 64), (2, 5)])
def test_every_micro_batch_is_scored_at_its_own_optimizer_step(accumulate, epoch_length):
    """Stage and mix boundaries fall on the right step: observe() gets the optimizer step the micro-batch belongs
    to (at batch end Lightning has already advanced global_step after the last micro-batch, not the others). With 5
    batches an epoch and accumulate 2, Lightning steps after the epoch's lone 5th batch: that is step 2's only one."""
    data = _IndexData(epoch_length)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=accumulate, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FourierSamplerCallback()])
    trainer.fit(_TokenLossModule(), datamodule=data)
    seen = data.sampler.seen
    if epoch_length == 5:
        assert seen == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (0, 3), (1, 3)]
        return
    assert [step for _, step in seen] == [i // accumulate for i in range(4 * accumulate)]
    assert [i for i, _ in seen] == list(range(4 * accumulate))


class _LrRecorder(L.Callback):
    """Records the LR that each optimizer update used (a step pre-hook registered after the sampler's)."""

    def __init__(self):
        self.used, self.after = [], []

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        opt.register_step_pre_hook(lambda o, a, k: self.used.append(o.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(trainer.optimizers[0].param_groups[0]["lr"])


def _events(run_dir: Path, steps: bool = False) -> dict:
    """Each TensorBoard tag's values (with ``steps``: its steps) in the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import event_files

    tags = {}
    for f in event_files(run_dir):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags[tag] = [e.step if steps else e.value for e in acc.Scalars(tag)]
    return tags


FOURIER = [
    "data/sampler=fourier",
    "callbacks=[default,fourier_sampler]",
    "data.sampler.step_unit=0.4",  # stages: warmup steps 0-1 (LR x0.1), ramp 2-7 (x0.5), stable from 8
    "scheduler=constant",
    "sample.max_new_tokens=0",
    "trainer.log_every_n_steps=1",
]


@pytest.mark.parametrize("lag", [0, 1])
def test_exact_resume_through_trainer_checkpoint(tiny_cfg, lag):
    n = 5
    common = FOURIER + ["trainer.val_check_interval=5", f"data.sampler.lag={lag}"]
    _, straight = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", run="straight"))
    _, first = train(tiny_cfg(*common, f"trainer.max_steps={n}", run="split"))
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    _, resumed = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", f"ckpt_path={ckpt}", run="split"))
    a, b = straight["datamodule"].sampler, resumed["datamodule"].sampler
    assert isinstance(a, FourierSampler) and a.updates == b.updates == 2 * n - lag
    assert len(a._pending) == len(b._pending) == lag  # lag=1: the last step's update, saved unapplied
    if lag:
        assert torch.equal(a._pending[0].records(), b._pending[0].records())
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert int((a.visits > 0).sum()) > 0
    assert torch.equal(a.probabilities(2 * n), b.probabilities(2 * n))
    assert torch.equal(a.global_batch(2 * n, 8), b.global_batch(2 * n, 8))
    wa, wb = straight["module"].model.state_dict(), resumed["module"].model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    logged = _events(Path(straight["trainer"].default_root_dir))
    for tag in ("fourier/mix", "fourier/bands", "fourier/prob_entropy", "fourier/top_band_energy"):
        assert tag in logged, tag
    assert logged["fourier/bands"][0] == 4.0 and logged["fourier/bands"][-1] == 8.0
    assert logged["fourier/prob_entropy"][-1] <= math.log(straight["datamodule"].num_train_samples) + 1e-6
    steps = _events(Path(straight["trainer"].default_root_dir), steps=True)  # lag=1: the last one at train end
    assert steps["fourier/top_band_energy"] == steps["fourier/mix"] == list(range(2 * n))


def test_stage_lr_multiplier_is_applied_inside_the_step(tiny_cfg):
    cfg = tiny_cfg(*FOURIER, "trainer.max_steps=10", "trainer.val_check_interval=10", "scheduler.warmup_steps=0")
    with open_dict(cfg):
        cfg.callbacks["lr_recorder"] = {"_target_": f"{__name__}._LrRecorder"}
    _, objects = train(cfg)
    rec = next(c for c in objects["trainer"].callbacks if isinstance(c, _LrRecorder))
    lr = cfg.optimizer.lr
    expected = [lr * (0.1 if s < 2 else 0.5 if s < 8 else 1.0) for s in range(10)]
    assert rec.used == pytest.approx(expected)
    assert rec.after == pytest.approx([lr] * 10)  # the scheduler's LR is restored after every update


class _ScaleLogitsAt(L.Callback):
    """Multiplies the logits by 50 for one step: a finite loss spike that LossSpikeMonitor skips."""

    def __init__(self, step: int) -> None:
        self.step, self.handle = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * 50.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_a_skipped_spike_batch_is_left_out_of_the_magnitude_mean_through_the_callbacks(tiny_cfg):
    """The callbacks' path: the FourierSamplerCallback scored every batch, also the one LossSpikeMonitor skips; the
    monitor then excludes its samples. The mean of ``magnitude`` must be over the seen samples still drawable
    (before the fix it was 4.18 here, over all seen samples, against 3.38 without the 4 spiked ones). The callback
    now leaves the skipped batch out of the table altogether (test_the_table_does_not_learn_from_a_step_the_monitor_
    dropped); the mean is still over the drawable samples."""
    cfg = tiny_cfg("data/sampler=fourier", "data.sampler.variant=magnitude", "data.sampler.stages=false",
                   "callbacks=[default,loss_spike,fourier_sampler]", "callbacks.loss_spike.warmup_steps=3",
                   "trainer.max_steps=14", "sample.max_new_tokens=0")
    with open_dict(cfg):
        cfg.callbacks["spike"] = {"_target_": f"{__name__}._ScaleLogitsAt", "step": 8}
    _, objects = train(cfg)
    sampler = objects["datamodule"].sampler
    monitor = next(c for c in objects["trainer"].callbacks if isinstance(c, LossSpikeMonitor))
    assert [(e["step"], e["actions"]) for e in monitor.events] == [(8, ["log", "skip"])]
    seen = sampler.visits > 0
    assert sampler.num_excluded == 4
    elem = S.importance_elementwise(sampler.m1, sampler.m2, sampler.visits, "magnitude")
    assert sampler._distribution()["mean"] == pytest.approx(float(elem[seen & ~sampler.excluded].mean()), rel=1e-12)


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_nonfinite_token_loss_is_left_out_of_the_table(variant):
    """A NaN/inf row (an fp16 overflow that the GradScaler skips) must not poison its sample's moments, nor,
    through the shared band weights, the scores of the other samples of its batch."""
    clean, dirty = make(variant=variant, stages=False), make(variant=variant, stages=False)
    feed(clean, 5)
    feed(dirty, 5)
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(4, 64, generator=g) + 1.0
    bad = loss.clone()
    bad[1, 10] = float("nan")
    bad[3] = float("inf")
    idx = torch.tensor([40, 41, 42, 43])
    before = dirty.visits.clone()
    clean.observe(loss[[0, 2]], idx[[0, 2]], 6)
    stats = dirty.observe(bad, idx, 6)
    assert stats["nonfinite"] == 2 and dirty.nonfinite_skipped == 2
    for key in ("m1", "m2", "visits"):  # exactly as if only the two finite rows had been observed
        assert torch.equal(getattr(clean, key), getattr(dirty, key)), key
    assert torch.equal(dirty.visits - before, torch.isin(torch.arange(50), idx[[0, 2]]).int())
    p = dirty.probabilities(6)
    assert bool(torch.isfinite(p).all()) and p.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert torch.equal(dirty.global_batch(6, 32), clean.global_batch(6, 32))
    restored = make(variant=variant, stages=False)
    restored.load_state_dict(dirty.state_dict())
    assert restored.nonfinite_skipped == 2


class _StageLrData(L.LightningDataModule):
    """64 single-index batches and a FourierSampler whose one stage scales the LR by 0.5 (steps 0-3, then held)."""

    def __init__(self):
        super().__init__()
        self.sampler = FourierSampler(stage_table=[["a", 0, 4, 0.3, 0.5]], step_unit=1)
        self.sampler.setup(64, seed=0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([{"index": torch.tensor([i])} for i in range(64)], batch_size=None)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
@pytest.mark.parametrize("order", ["fourier_first", "loss_spike_first"])
def test_stage_lr_and_spike_cooldown_both_restore_the_lr_in_either_order(tmp_path, order, precision):
    """The FourierSampler's stage LR multiplier (0.5) and LossSpikeMonitor's lr_cooldown (0.1 for 2 steps after the
    spike at step 5) both scale the LR for one optimizer step and put it back. Without an LR scheduler (nothing
    recomputes the LR each step) every put-back must be exact in either callback order: with the monitor listed
    first its restore ran before the sampler's, which then wrote back the cooled LR (0.1), and the LR decayed for
    good (each later cool-down compounded). Which order failed depended on the precision: under 32-true Lightning
    runs the closure (so the monitor's on_before_optimizer_step) inside optimizer.step after the step pre-hooks, under
    16-mixed before optimizer.step."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            scale = 10.0 if self.trainer.global_step == 5 else 1.0
            token_loss = (1.0 + 0.001 * self.w) * torch.linspace(1, 2, 16)[None] * scale
            return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

        def configure_optimizers(self):
            return UsedLrSGD(self.parameters(), lr=1.0)

    class UsedLrSGD(torch.optim.SGD):
        """Records the LR of each update, taken after the closure (under 32-true Lightning runs the closure, so
        on_before_optimizer_step, inside step, after the step pre-hooks)."""

        def step(self, closure=None):
            loss = None if closure is None else closure()
            used.append(self.param_groups[0]["lr"])
            super().step()
            return loss

    used: list[float] = []

    fourier = FourierSamplerCallback()
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], warmup_steps=3, cooldown_factor=0.1, cooldown_steps=2,
                               cooldown_ramp_steps=0, path=str(tmp_path / "spikes.jsonl"))
    recorder = _LrRecorder()
    callbacks = [fourier, monitor] if order == "fourier_first" else [monitor, fourier]
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))] \
        if precision == "16-mixed" else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[*callbacks, recorder],
                        plugins=plugins)
    trainer.fit(Module(), datamodule=_StageLrData())
    assert [e["step"] for e in monitor.events] == [5]
    assert recorder.after == [1.0] * 10  # the configured LR after every step
    assert used == pytest.approx([0.5] * 5 + [0.05, 0.05] + [0.5] * 3)


def test_an_exception_inside_the_step_leaves_neither_hooks_nor_a_scaled_lr(tmp_path):
    """A raise inside optimizer.step (here from the closure, which Lightning runs there under 32-true, after the
    sampler's pre-hook scaled the LR by 0.5) left the optimizer with the sampler's hooks and the scaled LR (0.5); the
    optimizer outlives the failed fit (the module keeps it, a user retries or inspects it)."""
    from lit_dtrain.callbacks import OptimizerDiagnostics

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                raise RuntimeError("boom at step 3")
            token_loss = (1.0 + 0.001 * self.w) * torch.linspace(1, 2, 16)[None]
            return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

        def configure_optimizers(self):
            self.opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return self.opt

    module = Module()
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FourierSamplerCallback(), monitor, OptimizerDiagnostics(every_n_steps=1)])
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit(module, datamodule=_StageLrData())
    assert module.opt.param_groups[0]["lr"] == 1.0
    assert len(module.opt._optimizer_step_pre_hooks) == 0  # (torch's own registry of step pre-hooks)


def test_rows_follow_lightnings_logging_cadence():
    """fourier/* rows at the steps where Lightning writes train/loss, ``(k + 1) % log_every_n_steps == 0``, like the
    other callbacks (``_logging.on_log_cadence``); it also wrote a row at step 0, one off that cadence."""
    s = make(stages=False)
    module = _drive(FourierSamplerCallback(), s, steps=10, trainer_every=5)
    assert sorted(step - 1 for step in module.logged) == [4, 9]  # _Recorder keys: global_step after the step
    module = _drive(FourierSamplerCallback(log_every_n_steps=3), make(stages=False), steps=10, trainer_every=5)
    assert sorted(step - 1 for step in module.logged) == [2, 5, 8]


class _TableAtBatchStart(L.Callback):
    """The sampler's table (m1, m2, visits, profile, updates) when each micro-batch starts, by global step: at the
    start of step s + 1 every callback has finished step s."""

    def __init__(self) -> None:
        self.tables: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sampler = trainer.datamodule.sampler
        sampler.flush()
        self.tables.setdefault(trainer.global_step, {
            "m1": sampler.m1.clone(), "m2": sampler.m2.clone(), "visits": sampler.visits.clone(),
            "profile": sampler.profile.clone(), "updates": sampler.updates})


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("order", ["monitor_first", "sampler_first"])
def test_the_table_does_not_learn_from_a_step_the_monitor_dropped(tiny_cfg, order, accumulate):
    """FourierSamplerCallback scored every batch, also the one LossSpikeMonitor then skipped: m1/m2, visits, the band
    profile and the update count took in the spike. A step whose grads the monitor dropped is now left out of the
    table (told, in either callback order, by the grads the optimizer step saw), and only that step: the table is the
    same before and after it, and changes at every other step."""
    callbacks = "[default,loss_spike,fourier_sampler]" if order == "monitor_first" else \
        "[default,fourier_sampler,loss_spike]"
    cfg = tiny_cfg("data/sampler=fourier", "data.sampler.variant=magnitude", "data.sampler.stages=false",
                   f"callbacks={callbacks}", "callbacks.loss_spike.warmup_steps=3", "trainer.max_steps=11",
                   f"trainer.accumulate_grad_batches={accumulate}", "sample.max_new_tokens=0",
                   run=f"{order}_{accumulate}")
    with open_dict(cfg):
        cfg.callbacks["spike"] = {"_target_": f"{__name__}._ScaleLogitsAt", "step": 8}
        cfg.callbacks["tables"] = {"_target_": f"{__name__}._TableAtBatchStart"}
    _, objects = train(cfg)
    trainer = objects["trainer"]
    monitor = next(c for c in trainer.callbacks if isinstance(c, LossSpikeMonitor))
    tables = next(c for c in trainer.callbacks if isinstance(c, _TableAtBatchStart)).tables
    assert [(e["step"], e["actions"]) for e in monitor.events] == [(8, ["log", "skip"])]
    sampler = objects["datamodule"].sampler
    assert sampler.num_excluded == 4 * accumulate  # the monitor still excludes the dropped step's samples
    for step in range(10):
        before, after = tables[step], tables[step + 1]
        same = all(torch.equal(before[k], after[k]) for k in ("m1", "m2", "visits", "profile"))
        assert same == (step == 8), step
        assert after["updates"] - before["updates"] == (0 if step == 8 else accumulate), step
    assert sampler.updates == 10 * accumulate


@pytest.mark.parametrize(("action", "order"), [("skip", "sampler_first"), ("rollback", "monitor_first")])
@pytest.mark.parametrize("fused", [False, True])
def test_the_table_does_not_learn_from_a_step_the_monitor_dropped_under_16_mixed(tmp_path, fused, action, order):
    """Under 16-mixed a dropped step never reaches foreach AdamW's ``step`` (the GradScaler skips it), and fused AdamW
    is called without grads: both are told apart from an applied step, in either callback order."""
    from functools import partial

    from lightning.pytorch.plugins.precision import MixedPrecision

    from lit_dtrain.optim import adamw
    from tests.unit.test_loss_spike import Inject, make_data, make_module

    dm = make_data(tmp_path)
    dm.sampler = FourierSampler(stages=False)
    tables = _TableAtBatchStart()
    monitor = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2)
    pair = [FourierSamplerCallback(), monitor] if order == "sampler_first" else [monitor, FourierSamplerCallback()]
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=9, plugins=[plugin], logger=False,
                        callbacks=[Inject({6: "finite"}), *pair, tables],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=str(tmp_path))
    module = make_module()
    module.optimizer_factory = partial(adamw, lr=3e-3, fused=fused)
    trainer.fit(module, datamodule=dm)
    assert [e["step"] for e in monitor.events] == [6]
    for step in range(8):
        same = all(torch.equal(tables.tables[step][k], tables.tables[step + 1][k]) for k in ("m1", "visits"))
        assert same == (step == 6), step


class _LagAtBatchStart(L.Callback):
    """The sampler's applied update count and pending steps when each optimizer step starts."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, list[int]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sampler = trainer.datamodule.sampler
        self.at.setdefault(trainer.global_step, (sampler.updates, [u.step for u in sampler._pending]))


@pytest.mark.parametrize(("action", "accumulate"), [("skip", 1), ("rollback", 2)])
def test_lag_one_applies_the_previous_update_at_a_step_the_monitor_dropped(tmp_path, action, accumulate):
    """With lag=1 the update of step s is applied at the next observe(). A step that LossSpikeMonitor drops (NaN
    loss) is not observed, so the update before it waited a step more: the step after the dropped one drew from the
    table through s - 3, not s - 2. The callback now applies it at the dropped step's end."""
    from tests.unit.test_loss_spike import Inject, make_data, make_module

    dm = make_data(tmp_path)
    dm.sampler = FourierSampler(stages=False, lag=1)
    record = _LagAtBatchStart()
    monitor = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, accumulate_grad_batches=accumulate, logger=False,
                        callbacks=[Inject({6: "nan"}), monitor, FourierSamplerCallback(), record],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(make_module(), datamodule=dm)
    assert [e["step"] for e in monitor.events] == [6]
    for step in range(2, 10):  # the draw of step s sees every trained step up to s - 2; only s - 1 is pending
        trained = [k for k in range(step - 1) if k != 6]
        assert record.at[step] == (accumulate * len(trained), [step - 1] * accumulate * (step != 7)), step


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_batch_the_module_skips_is_left_out(accumulate):
    """``training_step`` returning None is Lightning's way to skip a batch (it passes ``{}`` to on_train_batch_end);
    the callback raised StepOutputError ("got keys []") there and stopped the run. It now leaves such a batch out and
    observes the others."""
    data = _IndexData()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=accumulate, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FourierSamplerCallback()])
    trainer.fit(_TokenLossModule(skip=(2, 3) if accumulate == 1 else (2,), lr=0.1), datamodule=data)
    if accumulate == 1:  # steps 2 and 3 are skipped whole
        assert data.sampler.seen == [(0, 0), (1, 1), (4, 4)]
    else:  # step 1 keeps its second micro-batch
        assert data.sampler.seen == [(0, 0), (1, 0), (3, 1), (4, 2), (5, 2), (6, 3), (7, 3), (8, 4), (9, 4)]


def test_gradient_accumulation_over_more_than_two_micro_batches_trains(tiny_cfg):
    """The sampler's check for a missing callback (no update by micro-step 2) fired under accumulate_grad_batches=3:
    the first optimizer step, and with it the first update, ends after micro-step 2 is drawn. With the callback
    attached the check is off, and every micro-batch is learned from."""
    cfg = tiny_cfg(*FOURIER, "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.accumulate_grad_batches=3")
    _, objects = train(cfg)
    assert objects["trainer"].global_step == 3
    assert objects["datamodule"].sampler.updates == 9


def test_the_missing_callback_check_still_fires_without_a_feeder():
    s = make()
    s.expect_updates()  # a feeder is attached: updates arrive at its optimizer steps
    s.global_batch(5, 4)
    with pytest.raises(RuntimeError, match="fourier_sampler"):
        make().global_batch(2, 4)


def test_a_table_from_another_corpus_of_the_same_size_is_refused(tiny_cfg, corpus):
    """The table is indexed by window: resuming on another corpus (here one document reversed, so the same number
    of windows) silently applied its scores to other text. The checkpoint now records which dataset the table
    indexes (the token caches' content keys, which cover the files, block_size and val_fraction) and a resume on
    another one is a ValueError naming both, before any step."""
    common = [*FOURIER, "trainer.val_check_interval=3"]
    _, first = train(tiny_cfg(*common, "trainer.max_steps=3", run="other"))
    n = first["datamodule"].num_train_samples
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    doc = corpus / "doc_000.txt"
    doc.write_text(doc.read_text()[::-1])
    # the same bytes in another order: the same number of windows, so the size check cannot tell
    other = r"dataset [0-9a-f]{16}, and this run's is [0-9a-f]{16}: the checkpoint belongs to another corpus"
    with pytest.raises(ConfigError, match=other) as refused:
        train(tiny_cfg(*common, "trainer.max_steps=6", f"ckpt_path={ckpt}", run="other"))
    assert user_error(refused.value) is refused.value  # train.py prints it as one line, 'error: ...', no traceback
    doc.write_text(doc.read_text()[::-1])  # the corpus it was trained on: resumes
    _, resumed = train(tiny_cfg(*common, "trainer.max_steps=6", f"ckpt_path={ckpt}", run="other"))
    assert resumed["datamodule"].num_train_samples == n and resumed["datamodule"].sampler.updates == 6


def test_exclusions_from_another_dataset_are_refused_and_an_exclusion_free_state_is_not():
    a, b = RandomSampler(), RandomSampler()
    a.setup(50, seed=0, dataset_key="aaaa")
    b.setup(50, seed=0, dataset_key="bbbb")
    b.load_state_dict(a.state_dict())  # nothing per-window: any dataset may take it
    a.exclude([4])
    with pytest.raises(ConfigError, match="'excluded' indexes the windows of dataset aaaa, and this run's is bbbb"):
        b.load_state_dict(a.state_dict())
    c = RandomSampler()
    c.setup(50, seed=0)  # no key (a sampler outside LMDataModule), or a checkpoint from before keys: not checked
    c.load_state_dict(a.state_dict())
    assert c.excluded.nonzero().flatten().tolist() == [4]


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


@pytest.mark.parametrize("changed", [{"max_freq": 512}, {"num_bands": 6}])
def test_a_band_config_changed_on_resume_is_refused_not_silently_replaced(changed):
    """The table's band profile was computed with the checkpoint's band edges, and load_state_dict took them over
    silently: resuming with data.sampler.max_freq=512 (or num_bands=6, stages on: the same 8-band profile shape)
    kept scoring with 256/4 while the config said otherwise. A configured value that differs is now an error naming
    both; null (auto) takes the checkpoint's."""
    s = make(max_freq=256, num_bands=4, step_unit=1)
    feed(s, 3)
    state = s.state_dict()
    key, value = next(iter(changed.items()))
    with pytest.raises(ValueError, match=rf"{key}={value}.*checkpoint.*{key}={state[key]}"):
        make(step_unit=1, **{"max_freq": 256, "num_bands": 4, **changed}).load_state_dict(state)
    auto = make(step_unit=1)  # null: the checkpoint's
    auto.load_state_dict(state)
    assert (auto.max_freq, auto.num_bands) == (256, 4)


def test_stages_turned_off_on_resume_keep_the_finer_profile_and_score_with_its_merged_bands():
    """A table saved with stages on holds an 8-band profile; resuming it with data.sampler.stages=false (4 bands) was
    refused ("'profile' has 8 bands, this configuration uses 4"), and no setting let it through (num_bands=8 differs
    from the saved num_bands=4). The finer profile merges exactly into 4 bands: the resumed table is kept, draws as
    before, and scores new batches as a sampler whose table was built with stages off from the same profiles."""
    s = make(max_freq=256, num_bands=4, step_unit=1000, variant="magnitude")  # stages on: warmup, 4 of 8 bands
    feed(s, 3)
    state = s.state_dict()
    assert state["profile"].shape[1] == 8
    off = make(stages=False, variant="magnitude")
    off.load_state_dict(state)
    assert torch.equal(off.probabilities(3), s.probabilities(3))
    assert off.fine_bands == 8 and off.bands_at(3) == 4
    loss, idx = torch.rand(8, 64, generator=torch.Generator().manual_seed(9)), torch.arange(8)
    merged = S.merge_bands(S.band_energies(loss, 256, 8), 4)
    assert torch.allclose(merged, S.band_energies(loss, 256, 4), rtol=1e-5, atol=1e-7)  # why keeping it is exact
    stats = off.observe(loss, idx, 4)
    assert stats["bands"] == 4 and off.profile.shape[1] == 8 and bool(off.visits[idx].gt(0).all())
    with pytest.raises(ValueError, match="'profile' has 8 bands, this configuration needs 10"):
        make(step_unit=1000, stage_table=[["a", 0, 4, 0.3, 1.0], ["b", 5, 10, 0.5, 1.0]]).load_state_dict(state)


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
    # RandomSampler has no such minimum
    metrics, _ = train(tiny_cfg("data.block_size=1", "sample.max_new_tokens=0", run="random"))
    assert metrics["steps"] == 6


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


def test_the_weighted_loss_of_drawn_batches_estimates_the_target_mean():
    """End to end over real draws (not only p): the mean over steps of each batch's weighted mean loss equals the
    loss's mean under the target distribution (mixture prior, exclusions), within Monte Carlo error. ``magnitude``:
    the brief's ``moment_ratio`` stays uniform here, where any weights would pass."""
    n = 60
    base = torch.where(torch.arange(n) < 20, 3.0, 1.0)
    s = FourierSampler(variant="magnitude", importance_weights=True, stages=False, uniform_floor=0.1)
    s.setup(n, base, seed=0, source_offsets=[0, 20, n], source_names=["a", "b"])
    feed(s, 20, hot={1, 2, 30})
    s.exclude([5, 33])
    loss = (torch.arange(n, dtype=torch.float64) * 0.37) % 5 + 0.1
    ref = float((s.target_distribution() * loss).sum())
    weighted, plain = [], []
    for step in range(1000, 3000):
        idx = s.global_batch(step, 16)
        weighted.append(float((s.loss_weights(idx).double() * loss[idx]).mean()))
        plain.append(float(loss[idx].mean()))
    for est, unbiased in ((weighted, True), (plain, False)):  # unweighted: far off (the weights matter)
        est = torch.tensor(est, dtype=torch.float64)
        z = abs(float(est.mean()) - ref) / (float(est.std()) / math.sqrt(len(est)))
        assert (z < 4) == unbiased, z


def test_lag_one_writes_the_owed_top_band_energy_when_a_stop_signal_ends_the_fit():
    """With lag=1 a logged step's fourier/top_band_energy is written at the next step's end. A SIGTERM stop saves at
    step k's end and ends the fit (Lightning's SIGTERMException, through on_exception), which dropped step k's value:
    the resumed run restores its update, not the value, so step k had no point in either run (a real 2-rank run
    killed at step 9: points 0..7, 10..13). It is written at the stop, as at train end; another error writes none."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    obs = _observations(4, batch=4, T=32)
    losses, index = [loss for loss, _ in obs], [i for _, i in obs]
    written = {}
    for name, exc in (("end", None), ("sigterm", SIGTERMException()), ("error", RuntimeError("boom"))):
        cb = FourierSamplerCallback()
        trainer, module = _drive_fixed(cb, make(stages=False, lag=1), losses, index)
        trainer.optimizers = []
        if exc is None:
            cb.on_train_end(trainer, module)
        else:
            cb.on_exception(trainer, module, exc)
        written[name] = [(step, v) for step, name_, v in trainer.loggers[0].rows if name_ == "fourier/top_band_energy"]
    assert [step for step, _ in written["end"]] == [0, 1, 2, 3]
    assert written["sigterm"] == written["end"]
    assert written["error"] == written["end"][:3]
