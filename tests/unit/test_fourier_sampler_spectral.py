"""FourierSampler's spectral core: bands, band energies, weights, mixing and stage schedules, the stage table."""

from __future__ import annotations

import math

import pytest
import torch

from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.data.samplers import spectral as S

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


def test_default_band_config_follows_the_brief_at_its_edges():
    """The brief's ``(max_freq, num_bands)``: (256, 4) up to 512 tokens, (1024, 6) from 2048, (512, 5) between."""
    assert [S.default_band_config(t) for t in (64, 512, 513, 2047, 2048, 8192)] == [
        (256, 4), (256, 4), (512, 5), (512, 5), (1024, 6), (1024, 6)]


def test_the_shortest_windows_put_their_one_bin_in_the_top_band():
    """T = 2 or 3 has one non-DC bin (nyquist 1): every band edge maps to it (clamped to ``[1, T // 2]``), so it lies in
    the top band, which then holds the row's whole variance."""
    assert S.band_lower_bins(256, 4, 2).tolist() == S.band_lower_bins(256, 4, 3).tolist() == [1, 1, 1, 1]
    assert S.band_energies(torch.tensor([[1.0, 3.0]]), 256, 4).tolist() == [[0.0, 0.0, 0.0, 1.0]]


@pytest.mark.parametrize("world", [2, 4])
def test_the_frequency_score_does_not_depend_on_the_world_size(world):
    """``W`` ranks of equal band sums all-reduce ``W`` times the energy, so each rank's weights have norm
    ``1/sqrt(W)``; the ``sqrt(W)`` factor gives every sample the score it has on one process."""
    profile = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.1, 0.2, 0.3, 0.4]])
    local = profile.sum(0)
    one = S.frequency_score(profile, S.adaptive_band_weights(local, local.square().sum()), 1)
    many = S.frequency_score(profile, S.adaptive_band_weights(local, world * local.square().sum()), world)
    torch.testing.assert_close(many, one)
