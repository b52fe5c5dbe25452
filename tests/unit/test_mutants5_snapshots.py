"""Exact results of ``SnapshotRing.pick`` and of the ``lr_cooldown`` multiplier, from the fifth hand mutation audit:
a ``min_age`` taken as exclusive, a too-young ring that restored its newest snapshot, a ring that kept snapshots of
another layout, and a cool-down one step late or short all passed the suite before these."""

from __future__ import annotations

import pytest

from lit_dtrain.callbacks._snapshots import SnapshotRing, set_hparams
from lit_dtrain.callbacks._spike_stats import cooldown_factor

A = ([[2]], ("w",))  # a layout: one param group of 2 tensors, one state key
B = ([[2], [1]], ("w",))  # another: a group added (a BaseFinetuning unfreeze)


def ring_of(*entries: tuple[int, tuple], keep: int = 4) -> SnapshotRing:
    ring = SnapshotRing(keep=keep)
    ring.snapshots.extend({"step": step, "layout": layout} for step, layout in entries)
    return ring


def steps(ring: SnapshotRing) -> list[int]:
    return [s["step"] for s in ring.snapshots]


def test_a_snapshot_exactly_min_age_steps_old_is_old_enough() -> None:
    ring = ring_of((10, A), (20, A), (25, A))
    snap, old_enough = ring.pick(30, 5, A)  # 30 - 25 == min_age
    assert (snap["step"], old_enough) == (25, True) and steps(ring) == [10, 20, 25]


def test_without_an_old_enough_snapshot_the_oldest_is_restored_and_said_so() -> None:
    ring = ring_of((10, A), (20, A), (25, A))
    snap, old_enough = ring.pick(26, 20, A)  # none is 20 steps old: the oldest, the furthest from the spike
    assert (snap["step"], old_enough) == (10, False) and steps(ring) == [10]


def test_the_newest_old_enough_snapshot_is_picked_not_the_oldest() -> None:
    ring = ring_of((10, A), (20, A), (25, A))
    assert ring.pick(40, 5, A)[0]["step"] == 25 and steps(ring) == [10, 20, 25]


def test_snapshots_of_another_layout_are_dropped_and_never_restored() -> None:
    ring = ring_of((10, A), (20, B), (30, B))
    snap, old_enough = ring.pick(40, 5, B)
    assert (snap["step"], old_enough) == (30, True) and steps(ring) == [20, 30]
    assert ring.snapshots.maxlen == 4  # the ring still keeps as many as configured
    assert ring.pick(41, 5, A) == (None, False) and len(ring) == 0  # none fits: all gone, the next one starts anew


def test_the_default_ring_keeps_two_snapshots() -> None:
    assert SnapshotRing().snapshots.maxlen == 2


def test_set_hparams_puts_back_the_schedule_and_keeps_the_snapshots_other_entries() -> None:
    class Opt:
        param_groups = [{"params": [], "lr": 0.5, "d": 2.0}]

    class Trainer:
        optimizers = [Opt()]

    set_hparams(Trainer, [[{"lr": 0.1, "d": 9.0, "swa_lr": 0.05}]])
    # the LR is now's schedule's; Prodigy's learned d the snapshot's; an entry the snapshot lacks is added back
    assert Opt.param_groups[0] == {"params": [], "lr": 0.1, "d": 2.0, "swa_lr": 0.05}


@pytest.mark.parametrize(("since", "expected"), [
    (-1, 1.0), (0, 0.2), (2, 0.2), (3, 0.2 + 0.8 * 1 / 4), (4, 0.2 + 0.8 * 2 / 4), (5, 0.2 + 0.8 * 3 / 4), (6, 1.0),
])
def test_cooldown_holds_then_ramps_back_to_one(since: int, expected: float) -> None:
    # factor 0.2 for hold=3 steps (0, 1, 2), then ramp=3 steps up in quarters, then 1.0
    assert cooldown_factor(since, 0.2, 3, 3) == pytest.approx(expected, rel=1e-12)
