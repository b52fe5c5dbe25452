"""Exact results of the loss-spike statistics (``callbacks/_spike_stats.py``) where single-point mutants passed
test_loss_spike_detector, _edges, _schedules, _actions, test_mutants5_spike_actions, test_grad_clip_diag and
test_grad_clip_diag_combinations (eleventh hand mutation audit)."""

from __future__ import annotations

import json
import math

import pytest

from lit_dtrain.callbacks._spike_stats import GRAD_SPIKE, LOSS_SPIKE, RobustStat, SpikeDetector, despike, relative_rise


def test_a_plateau_of_a_negative_loss_has_the_scale_min_rel_scale_of_its_size() -> None:
    """The floor is ``min_rel_scale * |location|``: a Gaussian NLL flat at -2.0 has the scale 0.02, so a rise to -1.98
    is z = 1. Without the ``abs`` the floor was -0.02, the scale fell to ``min_scale`` (1e-8) and that 1 % rise read
    as z = 2e6, a spike."""
    stat = RobustStat("ema", warmup=2, clip_z=None, min_rel_scale=0.01)
    for _ in range(5):
        stat.add(-2.0)
    assert stat.scale() == 0.02
    assert stat.zscore(-1.98) == pytest.approx(1.0)
    detector = SpikeDetector(rel_threshold=None, warmup_steps=3)
    for _ in range(5):
        detector.decide(-2.0)
    assert not detector.decide(-1.98, update=False).is_spike


def test_a_spike_at_the_end_of_a_warmup_shorter_than_6_steps_is_despiked_when_that_warmup_ends() -> None:
    """Despiking runs at the warmup's end and again at 6 values: a 10x loss as the 5th of warmup_steps=5 is replaced
    by the median of its neighbours at once, so the 6th step, the first that can be a spike, sees location 1.0 and
    the scale floor 0.01: 10.0 is a spike (z = 900). Despiking at 6 values alone left the equal-weight mean 2.8 and the
    scale 4.5 for that step, and the second 10x loss in a row was trained on (z = 1.6)."""
    detector = SpikeDetector(warmup_steps=5)
    for x in (1.0, 1.0, 1.0, 1.0, 10.0):
        assert not detector.decide(x).is_spike
    assert detector.loss_stat.location() == 1.0 and detector.loss_stat.scale() == 0.01
    decision = detector.decide(10.0)
    assert decision.reasons == [LOSS_SPIKE] and decision.loss_z == pytest.approx(900.0)


def test_a_checkpoint_after_the_warmup_holds_no_warmup_values() -> None:
    """The warmup's values are kept only until their despiking: after the warmup (and after the second despiking at
    6 values for a shorter one) the state's ``warm`` is empty, not the first ``max(warmup, 6)`` losses carried in
    every checkpoint for the rest of the run. Mid-warmup it holds them."""
    for warmup in (3, 8):
        detector = SpikeDetector(warmup_steps=warmup)
        for i in range(4):
            detector.decide(1.0 + 0.01 * i)
        assert detector.state_dict()["loss_stat"]["warm"] == [1.0, 1.01, 1.02, 1.03]
        for i in range(4, 20):
            detector.decide(1.0 + 0.01 * (i % 2))
        assert detector.state_dict()["loss_stat"]["warm"] == []


def test_a_level_shift_restarts_the_statistics_from_the_runs_own_values() -> None:
    """The accepted level's statistics are those of the run's raw losses, 2, 2, 2, 2, 3: the equal-weight mean 2.2 and
    the forecast-error scale 0.5 (the 3.0 errs by 1 against the mean 2.0 before it, weighted 1/4). Reseeding with
    clip_z on clipped the run's 3.0 to 2.06 once its 3 warmup values were in (location 2.012); adding the
    shift's own loss once more after the reseed counted the 3.0 twice (location 2.333)."""
    detector = SpikeDetector(warmup_steps=3, max_consecutive=5)
    for i in range(10):
        detector.decide(1.0 + 0.001 * (i % 2))
    decisions = [detector.decide(x) for x in (2.0, 2.0, 2.0, 2.0, 3.0)]
    assert [d.is_spike for d in decisions] == [True] * 4 + [False] and decisions[-1].level_shift
    stat = detector.loss_stat
    assert stat.count == 5 and stat.location() == pytest.approx(2.2, rel=1e-12)
    assert stat.raw_scale() == pytest.approx(0.5, rel=1e-12)  # errors 0, 0, 0, 1 with weights 1, 1/2, 1/3, 1/4


def test_a_grad_norm_level_shift_restarts_the_grad_statistics_from_the_runs_own_values() -> None:
    """As for the loss: after ``max_consecutive`` grad-norm spikes 2, 2, 2, 2, 3 the grad statistics are those five
    values (mean 2.2), the shift's grad norm not added a second time (2.333)."""
    detector = SpikeDetector(grad_z_threshold=6.0, warmup_steps=3, max_consecutive=5)
    for i in range(10):
        detector.decide(1.0, 1.0 + 0.001 * (i % 2))
    decisions = [detector.decide(1.0, g) for g in (2.0, 2.0, 2.0, 2.0, 3.0)]
    assert [d.reasons for d in decisions] == [[GRAD_SPIKE]] * 4 + [[]] and decisions[-1].grad_level_shift
    assert detector.grad_stat.count == 5 and detector.grad_stat.location() == pytest.approx(2.2, rel=1e-12)


def test_a_median_level_shift_forgets_the_old_levels_values() -> None:
    """``"median"``: the reseeded statistics hold the run's values alone, so a shift to a flat 20.0 from a noisy 1/2
    history has the floor scale 0.2; keeping the old window's values kept its first differences (1.0) in the MAD: a
    scale of 1.05."""
    detector = SpikeDetector(method="median", window=20, warmup_steps=3, max_consecutive=3)
    for i in range(12):
        detector.decide(1.0 + (i % 2))
    assert [detector.decide(20.0).level_shift for _ in range(3)] == [False, False, True]
    assert list(detector.loss_stat.values) == [20.0, 20.0, 20.0]
    assert detector.loss_stat.scale() == pytest.approx(0.2)


def test_despike_takes_the_noise_scale_from_the_first_differences_over_sqrt_2() -> None:
    """Around a noise of alternating 5.0/5.2 the first differences are 0.2, the noise scale 1.4826 * 0.2 / sqrt(2) =
    0.2097 and the threshold at z = 3 0.629: 5.85 (0.75 above the neighbours' median 5.1) is replaced, 5.70 (0.60
    above it) is not. Without the sqrt(2) the threshold was 0.890 and 5.85 stayed."""
    values = [5.0, 5.2, 5.0, 5.2, 5.0, 5.1, 5.2, 5.0, 5.2, 5.0, 5.2]
    assert despike(values[:5] + [5.85] + values[6:], 3.0) == values
    assert despike(values[:5] + [5.70] + values[6:], 3.0) == values[:5] + [5.70] + values[6:]


def test_a_loss_below_a_location_of_zero_is_no_rise() -> None:
    """At a location of exactly 0 the relative rise is the sign of the loss times infinity: a loss below 0 is a fall
    (-inf), never a spike; a loss above 0 is +inf, and 0 itself no rise."""
    assert relative_rise(-1.0, 0.0) == -math.inf
    assert relative_rise(1.0, 0.0) == math.inf
    assert relative_rise(0.0, 0.0) == 0.0


def test_grad_norm_spikes_apart_never_make_a_level_shift() -> None:
    """Only consecutive grad-norm spikes count toward ``max_consecutive``: three spikes each followed by a normal step
    stay three spikes (a count that a normal step did not reset took the third as a new level and reseeded the grad
    statistics at 5.0)."""
    detector = SpikeDetector(grad_z_threshold=6.0, warmup_steps=3, max_consecutive=3)
    for i in range(10):
        detector.decide(1.0, 1.0 + 0.001 * (i % 2))
    reasons = []
    for _ in range(3):
        reasons.append(detector.decide(1.0, 5.0))
        reasons.append(detector.decide(1.0, 1.0))
    assert [(d.reasons, d.grad_level_shift) for d in reasons] == [([GRAD_SPIKE], False), ([], False)] * 3
    assert detector.grad_stat.location() < 1.01


def test_a_resume_inside_a_run_of_grad_norm_spikes_keeps_its_count() -> None:
    """The state carries the run of consecutive grad-norm spikes: two before a save and one after the load make the
    third, the level shift (loading it as empty made the resumed run need three more)."""
    detector = SpikeDetector(grad_z_threshold=6.0, warmup_steps=3, max_consecutive=3)
    for i in range(10):
        detector.decide(1.0, 1.0 + 0.001 * (i % 2))
    assert [detector.decide(1.0, 5.0).reasons for _ in range(2)] == [[GRAD_SPIKE], [GRAD_SPIKE]]
    resumed = SpikeDetector(grad_z_threshold=6.0, warmup_steps=3, max_consecutive=3)
    resumed.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert resumed.grad_consecutive == [5.0, 5.0]
    assert resumed.decide(1.0, 5.0).grad_level_shift


def test_a_non_finite_loss_has_an_infinite_z_score() -> None:
    """A NaN or inf loss is recorded with z = inf (spikes.jsonl's loss_z), not 0, ready or not."""
    detector = SpikeDetector(warmup_steps=3)
    assert detector.decide(math.nan).loss_z == math.inf
    for x in (1.0, 1.01, 1.0, 1.01):
        detector.decide(x)
    assert detector.decide(math.inf).loss_z == math.inf and detector.loss_stat.zscore(math.nan) == math.inf
