"""Counts in messages agree with their nouns and verbs: a warning said "the last 1 steps run at min_lr_factor"."""

from __future__ import annotations

from lit_dtrain.utils.words import counted, plural


def test_a_count_of_one_takes_the_singular():
    assert [counted(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert counted(1, "rank") == "1 rank" and counted(3, "batch", "batches") == "3 batches"
    assert [plural(n, "runs", "run") for n in (1, 2)] == ["runs", "run"]
