"""LossSpikeMonitor's detector on synthetic sequences: the known spikes, warmup, thresholds, robust statistics,
windows, cool-down, its state and arguments."""

from __future__ import annotations

import json
import math
import random

import pytest

from lit_dtrain.callbacks import AdaptiveGradClip, LossSpikeMonitor
from lit_dtrain.callbacks._spike_stats import (
    GRAD_SPIKE,
    LOSS_SPIKE,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    RobustStat,
    SpikeDetector,
    SpikeWindow,
    cooldown_factor,
    despike,
)
from tests.unit._loss_spike_helpers import one_thread  # noqa: F401 - its autouse fixture, as before the split

# ---------------------------------------------------------------------------------------------------------------
# pure statistics
# ---------------------------------------------------------------------------------------------------------------


def synthetic_losses(n: int, seed: int, noise: float = 0.04) -> list[float]:
    """A decaying training-loss curve with multiplicative noise and occasional mild bumps (no spikes)."""
    rng = random.Random(seed)
    out = []
    for t in range(n):
        base = 2.0 + 3.5 * math.exp(-t / 150.0)
        bump = 0.08 * base if rng.random() < 0.02 else 0.0  # a harder-than-usual batch, not a spike
        out.append(base * (1.0 + noise * rng.gauss(0.0, 1.0)) + bump)
    return out


SPIKES = {300: ("mul", 1.6), 777: ("nan", None), 1200: ("mul", 2.5), 1201: ("mul", 2.0), 1650: ("inf", None)}


def with_spikes(losses: list[float]) -> list[float]:
    out = list(losses)
    for step, (kind, factor) in SPIKES.items():
        out[step] = out[step] * factor if kind == "mul" else math.nan if kind == "nan" else math.inf
    return out


@pytest.mark.parametrize("method", ["ema", "median"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_finds_exactly_the_known_spikes(method: str, seed: int) -> None:
    detector = SpikeDetector(method=method, warmup_steps=50)
    losses = with_spikes(synthetic_losses(2000, seed))
    found = [t for t, x in enumerate(losses) if detector.decide(x).is_spike]
    assert found == sorted(SPIKES)


def test_detector_reasons_and_warmup() -> None:
    detector = SpikeDetector(warmup_steps=10, grad_z_threshold=6.0)
    # during warmup only non-finite values count
    assert detector.decide(100.0, 1.0).reasons == []
    assert detector.decide(math.nan, 1.0).reasons == [NONFINITE_LOSS]
    assert detector.decide(3.0, math.inf).reasons == [NONFINITE_GRAD]
    detector = SpikeDetector(warmup_steps=10, grad_z_threshold=6.0)
    for i in range(30):
        assert not detector.decide(3.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 2)).is_spike
    assert detector.decide(3.01, 10.0).reasons == [GRAD_SPIKE]
    assert detector.decide(9.0, 1.0).reasons == [LOSS_SPIKE]
    assert detector.decide(1.0, 1.0).reasons == []  # lower than usual is never a spike
    count = detector.loss_stat.count
    detector.decide(9.0, 1.0)
    assert detector.loss_stat.count == count  # spikes are not absorbed into the statistics


def test_a_lasting_level_shift_is_accepted_after_max_consecutive_spikes() -> None:
    losses = synthetic_losses(1500, 0)
    shifted = losses[:1000] + [1.6 * x for x in losses[1000:]]  # the loss level moves up for good
    detector = SpikeDetector(max_consecutive=10)
    decisions = [detector.decide(x) for x in shifted]
    assert [t for t, d in enumerate(decisions) if d.is_spike] == list(range(1000, 1009))
    assert [t for t, d in enumerate(decisions) if d.level_shift] == [1009]
    never = SpikeDetector(max_consecutive=None)
    assert sum(never.decide(x).is_spike for x in shifted) > 400  # without it, skip would drop every later step


def test_a_nan_step_inside_a_run_of_spikes_neither_counts_toward_max_consecutive_nor_ends_the_run() -> None:
    """A NaN/inf step says nothing about the loss level: it cannot seed the new level's statistics, so it does not
    count, and it does not show the loss back at its old level, so it does not end the run. Ending it would never
    accept a level whose steps turn NaN now and then (4 spikes, then a NaN, over and over: every step dropped, and
    max_nonfinite, which counts NaN steps in a row, never reached)."""
    losses = synthetic_losses(1500, 0)
    shifted = losses[:1000] + [1.6 * x for x in losses[1000:]]
    for nan_at, shift_at in (({1004}, 1010), (set(range(1004, 1500, 5)), 1011)):
        detector = SpikeDetector(max_consecutive=10)
        decisions = [detector.decide(math.nan if t in nan_at else x) for t, x in enumerate(shifted)]
        assert [t for t, d in enumerate(decisions) if d.level_shift] == [shift_at]  # the 10th finite spike
        assert [t for t, d in enumerate(decisions) if LOSS_SPIKE in d.reasons] == [
            t for t in range(1000, shift_at) if t not in nan_at]
        assert [t for t, d in enumerate(decisions) if d.is_spike and t > shift_at] == sorted(
            t for t in nan_at if t > shift_at)  # the new level is accepted: only the NaN steps are spikes after it


def test_a_lasting_grad_norm_level_shift_is_accepted_after_max_consecutive_spikes() -> None:
    """With grad_z_threshold, a grad norm that rose for good was a spike at every later step: skip dropped all of
    them. It is accepted after max_consecutive grad-norm spikes in a row, as the loss is."""
    losses = synthetic_losses(400, 0)
    grads = [g if t < 200 else 20.0 * g for t, g in enumerate(synthetic_losses(400, 1))]
    detector = SpikeDetector(grad_z_threshold=4.0, max_consecutive=10)
    decisions = [detector.decide(x, g) for x, g in zip(losses, grads)]
    assert [t for t, d in enumerate(decisions) if d.is_spike] == list(range(200, 209))
    assert {tuple(d.reasons) for d in decisions if d.is_spike} == {(GRAD_SPIKE,)}
    assert [t for t, d in enumerate(decisions) if d.grad_level_shift] == [209]
    assert not any(d.level_shift for d in decisions)  # the loss did not move
    assert detector.loss_stat.count == 400 - 9  # the accepted step's loss counts; the spikes' do not
    state = SpikeDetector(grad_z_threshold=4.0)
    state.load_state_dict(detector.state_dict())
    assert state.state_dict() == detector.state_dict()


def test_both_thresholds_must_hold() -> None:
    only_z = SpikeDetector(z_threshold=6.0, rel_threshold=None, warmup_steps=5)
    both = SpikeDetector(z_threshold=6.0, rel_threshold=0.2, warmup_steps=5)
    for x in [3.0, 3.001, 2.999, 3.0, 3.001, 3.0]:
        only_z.decide(x)
        both.decide(x)
    # 10% above a very flat history: z is huge (scale floor 1% of 3.0 -> z = 10) but rel = 0.1 < 0.2
    assert only_z.decide(3.3, update=False).is_spike
    assert not both.decide(3.3, update=False).is_spike
    assert both.decide(3.7, update=False).is_spike


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_spike_inside_the_warmup_does_not_blind_the_detector(seed: int) -> None:
    """Nothing can be a spike during the warmup; a 10x loss there used to inflate the EMA scale so much that a
    3x loss 80 steps after the warmup had z = 2.5 (missed) and detection came back only after ~300 steps."""
    losses = synthetic_losses(400, seed)
    polluted = list(losses)
    polluted[20] = 10 * losses[20]
    clean_detector, detector = SpikeDetector(warmup_steps=50), SpikeDetector(warmup_steps=50)
    for t in range(130):
        clean_detector.decide(losses[t])
        detector.decide(polluted[t])
        if t == 30:  # mid-warmup, the state (with its warmup values) round-trips through plain JSON
            detector.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert detector.decide(3 * losses[130], update=False).is_spike
    # the despiked warmup leaves statistics close to those of the clean run
    assert detector.loss_stat.scale() < 1.5 * clean_detector.loss_stat.scale()
    assert abs(detector.loss_stat.location() / clean_detector.loss_stat.location() - 1) < 0.01
    # and a clean warmup is left exactly as it was: the recomputation only happens when there is a spike
    plain = RobustStat(warmup=50, clip_z=None)  # clip_z=None: no despiking
    again = SpikeDetector(warmup_steps=50)
    for x in losses[:60]:
        plain.add(x)
        again.decide(x)
    assert (plain.mean, plain.var) == (again.loss_stat.mean, again.loss_stat.var)


@pytest.mark.parametrize("warmup", [2, 3, 5])
def test_a_spike_inside_a_warmup_shorter_than_6_steps_does_not_blind_the_detector(warmup: int) -> None:
    """The despiking takes the noise scale from the warmup's own values, and fewer than 6 cannot tell one spike from
    noise: with warmup_steps 2-5 and a 10x loss at step 1, a 3x loss at step 200 went undetected. The first 6 values
    are now despiked again once there are 6 of them."""
    for seed in range(3):
        losses = synthetic_losses(400, seed)
        polluted = list(losses)
        polluted[1] = 10 * losses[1]
        detector = SpikeDetector(warmup_steps=warmup)
        for t in range(200):
            detector.decide(polluted[t])
            if t == 3:  # the kept values round-trip through the state
                detector.load_state_dict(json.loads(json.dumps(detector.state_dict())))
        assert detector.decide(3 * losses[200], update=False).is_spike, seed


def test_robust_stat_ema_tracks_mean_and_std() -> None:
    rng = random.Random(0)
    stat = RobustStat("ema", decay=0.99, warmup=10, clip_z=None, min_rel_scale=0.0)
    for _ in range(5000):
        stat.add(rng.gauss(10.0, 2.0))
    assert abs(stat.location() - 10.0) < 0.5
    assert abs(stat.scale() - 2.0) < 0.4
    med = RobustStat("median", window=2001, warmup=10, min_rel_scale=0.0)
    for _ in range(2001):
        med.add(rng.gauss(10.0, 2.0))
    assert abs(med.location() - 10.0) < 0.2
    assert abs(med.scale() - 2.0) < 0.2


def test_robust_stat_ema_weighs_early_values_and_errors_equally() -> None:
    """Until ``1/(1-decay)`` values the location is the plain mean and the scale the RMS of the one-step forecast
    errors ``x_k - mean(x_1..x_(k-1))`` (exact on a short series)."""
    stat = RobustStat("ema", decay=0.99, warmup=2, clip_z=None, min_rel_scale=0.0, min_scale=0.0)
    for x in (1.0, 3.0, 2.0, 6.0):  # running means 1, 2, 2, 3; errors 2, 0, 4
        stat.add(x)
    assert stat.location() == pytest.approx(3.0, rel=1e-12)
    assert stat.scale() == pytest.approx(math.sqrt((4 + 0 + 16) / 3), rel=1e-12)


def test_detector_state_roundtrip_gives_identical_decisions() -> None:
    losses = with_spikes(synthetic_losses(2000, 3))
    a = SpikeDetector(method="median", window=50)
    for x in losses[:1000]:
        a.decide(x)
    b = SpikeDetector(method="median", window=50)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # plain floats/ints/lists only
    for x in losses[1000:]:
        da, db = a.decide(x), b.decide(x)
        assert (da.reasons, da.loss_z if math.isfinite(da.loss_z) else 0) == (
            db.reasons, db.loss_z if math.isfinite(db.loss_z) else 0)


def test_window_and_cooldown() -> None:
    w = SpikeWindow(max_spikes=3, window_steps=100)
    assert [w.add(s) for s in (10, 50, 200, 250, 260)] == [False, False, False, False, True]
    edge = SpikeWindow(max_spikes=3, window_steps=100)  # the window is the last 100 steps, (step - 100, step]
    assert [edge.add(s) for s in (0, 50, 100)] == [False, False, False]  # step 0 is 100 steps back: outside
    assert edge.add(149) is True  # 50, 100, 149
    assert [cooldown_factor(s, 0.1, 2, 3) for s in range(-1, 7)] == pytest.approx(
        [1.0, 0.1, 0.1, 0.1 + 0.9 * 0.25, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.75, 1.0, 1.0])


def test_a_checkpoint_carries_every_part_of_the_monitor_state() -> None:
    """A resumed monitor holds what the interrupted one held: the raise window's spike steps above all (a resume that
    forgot steps 10 and 50 let a third spike at step 60 train on where the uninterrupted run raised)."""
    def monitor():
        return LossSpikeMonitor(actions=["log", "skip", "raise"], raise_after=3, raise_window=100, warmup_steps=3)

    before = monitor()
    for step in (10, 50):
        assert before.window.add(step) is False
    for loss in (2.0, 2.1, 1.9, 2.05):
        before.detector.decide(loss)
    before.excluded, before.num_spikes, before.nonfinite_run, before.cooldown_start = [7, 3], 2, [50], 50
    before.recent_indices.append([1, 2])
    after = monitor()
    after.load_state_dict(before.state_dict())
    assert after.window.steps == [10, 50] and after.window.add(60) is True
    assert after.detector.state_dict() == before.detector.state_dict()
    assert (after.excluded, after.num_spikes, after.nonfinite_run, after.cooldown_start) == ([7, 3], 2, [50], 50)
    assert [list(x) for x in after.recent_indices] == [[1, 2]]


def test_a_rollback_drops_the_snapshots_newer_than_the_one_restored() -> None:
    """Those may hold the update that caused the spike: a second spike soon after the rollback must go back to the
    restored snapshot or older, never forward to one taken after it (the ring kept it, and step 33 went to step 30)."""
    from lit_dtrain.callbacks._snapshots import SnapshotRing

    ring = SnapshotRing(keep=3)
    ring.snapshots.extend({"step": step, "layout": ([[2]], ("w",))} for step in (10, 20, 30))
    snap, old_enough = ring.pick(31, 5, ([[2]], ("w",)))
    assert (snap["step"], old_enough) == (20, True) and [s["step"] for s in ring.snapshots] == [10, 20]
    assert ring.pick(33, 1, ([[2]], ("w",)))[0]["step"] == 20


def test_bad_arguments_fail_loudly() -> None:
    with pytest.raises(ValueError, match="actions"):
        LossSpikeMonitor(actions=["log", "explode"])
    with pytest.raises(ValueError, match="z_threshold and rel_threshold"):
        SpikeDetector(z_threshold=None, rel_threshold=None)
    with pytest.raises(ValueError, match="method"):
        RobustStat("mean")
    with pytest.raises(ValueError, match="grad_z_threshold needs check_grad"):
        LossSpikeMonitor(grad_z_threshold=5.0, check_grad=False)
    # the message names the argument the user passed (it named the internal ``warmup`` / ``max_spikes``)
    with pytest.raises(ValueError, match=r"LossSpikeMonitor: warmup_steps must be an integer >= 2, got 0"):
        LossSpikeMonitor(warmup_steps=0)
    with pytest.raises(ValueError, match=r"LossSpikeMonitor: raise_after must be an integer >= 1, got 0"):
        LossSpikeMonitor(raise_after=0)
    with pytest.raises(ValueError, match=r"LossSpikeMonitor: raise_window must be an integer >= 1, got 0"):
        LossSpikeMonitor(raise_window=0)
    # the statistics' arguments are checked by RobustStat and SpikeDetector, but reported under the callback the
    # user configured and the argument's own name (they said 'RobustStat: method ...', 'RobustStat: warmup ...')
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: decay must be in \(0, 1\), got 1.5$"):
        LossSpikeMonitor(decay=1.5)
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: method must be one of \('ema', 'median'\), got 'mean'$"):
        LossSpikeMonitor(method="mean")
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: warmup_steps \(20\) must be <= window \(10\)"):
        LossSpikeMonitor(method="median", window=10, warmup_steps=20)
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: max_consecutive must be an integer >= 2 or None, got 1$"):
        LossSpikeMonitor(max_consecutive=1)
    # no kept snapshot is ever 4 steps old (snapshots 2 steps apart, 2 kept): every rollback restored a newer one
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: rollback_min_age \(4\) must be < snapshot_every \* "
                                         r"snapshot_keep \(2 \* 2\)"):
        LossSpikeMonitor(actions=["rollback"], snapshot_every=2, snapshot_keep=2, rollback_min_age=4)
    assert LossSpikeMonitor(actions=["rollback"], snapshot_every=2, snapshot_keep=2, rollback_min_age=3)
    assert LossSpikeMonitor(actions=["skip"], snapshot_every=2, snapshot_keep=2, rollback_min_age=4)  # unused
    with pytest.raises(ValueError, match=r"^AdaptiveGradClip: decay must be in \(0, 1\), got 1.5$"):
        AdaptiveGradClip(decay=1.5)
    with pytest.raises(ValueError, match=r"^RobustStat: scale_decay must be in \(0, 1\), got 0.0$"):
        RobustStat(scale_decay=0.0)


def test_robust_stat_median_location_is_the_median_of_the_recent_tenth_of_the_window() -> None:
    """``"median"``: the location is the median of the last ``max(3, window // 10)`` values, so it follows a falling
    loss; the median of the whole window (50.5 here) lagged 45 steps behind, and a spike to 40 read as a drop."""
    stat = RobustStat("median", window=100, warmup=3, min_rel_scale=0.0)
    for x in range(100, 0, -1):  # 100, 99, ..., 1: the last 10 are 10..1
        stat.add(float(x))
    assert stat.location() == 5.5
    assert stat.raw_scale() == pytest.approx(1.4826 / math.sqrt(2.0))  # every first difference is 1
    assert stat.zscore(40.0) == pytest.approx((40.0 - 5.5) / (1.4826 / math.sqrt(2.0)))
    short = RobustStat("median", window=20, warmup=3, min_rel_scale=0.0)
    for x in (9.0, 1.0, 2.0, 30.0):  # window // 10 = 2 < 3: the last 3 values
        short.add(x)
    assert short.location() == 2.0


def test_despike_replaces_upward_outliers_only_by_the_median_of_their_neighbours() -> None:
    """Only a rise is a spike: an unusually low loss (an easy batch) inside the warmup stays as it is; a high one is
    replaced by the median of its 10 neighbours, itself left out (with it, 5.2 here)."""
    values = [5.0, 5.2, 5.0, 5.2, 5.0, 5.1, 5.2, 5.0, 5.2, 5.0, 5.2]
    dip = values[:5] + [1.0] + values[6:]
    assert despike(dip, 3.0) == dip
    assert despike(values[:5] + [9.0] + values[6:], 3.0) == values  # five 5.0 and five 5.2 around it: 5.1


def test_the_scale_is_at_least_min_rel_scale_of_the_location() -> None:
    """A plateau (every forecast error 0) has the scale ``min_rel_scale * |location|``, not ``min_scale``: a rise of
    10 % is z = 10 at ``min_rel_scale=0.01``, not 5e7."""
    stat = RobustStat("ema", warmup=2, clip_z=None, min_rel_scale=0.01)
    for _ in range(5):
        stat.add(5.0)
    assert stat.raw_scale() == 0.0
    assert stat.scale() == pytest.approx(0.05)
    assert stat.zscore(5.5) == pytest.approx(10.0)


def test_a_level_shift_shorter_than_the_warmup_still_detects_the_next_spike() -> None:
    """The statistics reseeded from a run of ``max_consecutive`` spikes are ready at once, even where that run is
    shorter than ``warmup_steps``: else the first spike after a level shift went unseen for the rest of a warmup."""
    d = SpikeDetector(max_consecutive=3, warmup_steps=5)
    for i in range(10):
        assert not d.decide(1.0 + 0.01 * (i % 2)).is_spike
    assert [d.decide(x).reasons for x in (2.0, 2.02)] == [[LOSS_SPIKE], [LOSS_SPIKE]]
    shift = d.decide(2.0)
    assert shift.level_shift and not shift.is_spike
    assert d.decide(10.0).reasons == [LOSS_SPIKE]
