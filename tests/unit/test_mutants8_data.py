"""Exact results of the mixture's drawn-share counts (``data/_drawn_shares.py``) and of the mixture-change warning
(``data/_mixture_resume.py``) where single-point mutants passed test_drawn_shares.py and test_mixture_resume.py
(eighth hand mutation audit): a batch drawn from the first source alone, a checkpoint that counted other sources, a
mixture with nothing drawn yet, and three sources of which one keeps its share."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import torch

from lit_dtrain.data._drawn_shares import count_drawn, drawn_share_metrics, restore_drawn
from lit_dtrain.data._mixture_resume import warn_if_the_mixture_changed


class _Windows:
    """Windows 0..9 belong to source 0, 10..19 to source 1 (``WindowSet.source_of``)."""

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        return (indices >= 10).astype(np.int64)


def _datamodule(counts=(0, 0)) -> SimpleNamespace:
    return SimpleNamespace(drawn_windows=np.asarray(counts, dtype=np.int64), train_windows=_Windows(),
                           sources=[SimpleNamespace(name="old"), SimpleNamespace(name="new")])


def test_a_batch_drawn_from_the_first_source_alone_counts_for_it_alone():
    """``np.bincount`` of indices of source 0 only is one long: without ``minlength`` it broadcast onto both counts,
    and the shares read 0.5/0.5 for a batch that held no window of the second source."""
    dm = _datamodule()
    count_drawn(dm, torch.tensor([0, 3, 9, 9]))
    assert dm.drawn_windows.tolist() == [4, 0]
    count_drawn(dm, torch.tensor([12, 5]))
    assert dm.drawn_windows.tolist() == [5, 1]
    assert drawn_share_metrics(dm) == {"data/share/old": 5 / 6, "data/share/new": 1 / 6}


def test_a_mixture_with_nothing_drawn_yet_logs_no_share():
    assert drawn_share_metrics(_datamodule((0, 0))) == {}


def test_a_checkpoint_that_counted_other_sources_leaves_the_counts_unknown():
    """Its counts name other sources (a data.sources edit): neither taken by position nor an error, no share is
    logged (a KeyError when the names were not compared first)."""
    dm = _datamodule((1, 1))
    restore_drawn(dm, {"drawn_per_source": {"a": 3, "b": 4}, "micro_step": 7})
    assert dm.drawn_windows is None
    restore_drawn(dm, {"drawn_per_source": {"old": 3, "new": 4}, "micro_step": 7})
    assert dm.drawn_windows.tolist() == [3, 4]


def test_three_sources_of_which_one_keeps_its_share_still_warn(caplog):
    """Weights 1/1/2 resumed as 1/2/1: the first source's share stays 0.25, the other two swap theirs. One share
    that did not move is no reason to stay quiet (an ``any`` in place of ``all`` said nothing)."""
    saved = {"a": 0.25, "b": 0.25, "c": 0.5}
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.corpus"):
        warn_if_the_mixture_changed(saved, {"a": 0.25, "b": 0.5, "c": 0.25})
    [record] = [r for r in caplog.records if "mixture shares" in r.getMessage()]
    assert "(a 0.25, b 0.25, c 0.5), and this run's data.sources weights give (a 0.25, b 0.5, c 0.25)" in \
        record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.corpus"):
        warn_if_the_mixture_changed(saved, dict(saved))
    assert not [r for r in caplog.records if "mixture shares" in r.getMessage()]
