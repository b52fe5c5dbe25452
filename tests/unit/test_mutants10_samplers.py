"""Exact results of the step-indexed samplers' base (``data/samplers/base.py``) where single-point mutants passed
test_mutants8_samplers.py, test_data_resume_and_exclusions.py, test_loss_spike_records.py and test_data_batches.py
(tenth hand mutation audit)."""

from __future__ import annotations

import logging

import pytest
import torch

from lit_dtrain.data.samplers import RandomSampler, step_generator


def _sampler(n: int, **kw) -> RandomSampler:
    s = RandomSampler()
    s.setup(n, **kw)
    return s


def test_a_two_source_mixture_keeps_each_sources_share_under_exclusions():
    """Two sources of 2 windows each (shares 0.5/0.5), window 0 excluded: source 0's mass moves to its window 1, so
    the target is [0, 0.5, 0.25, 0.25]. Renormalizing within sources only from three sources on gave two sources
    the plain renormalization over the windows left, [0, 1/3, 1/3, 1/3] (source 0 down to a third)."""
    s = _sampler(4, source_offsets=[0, 2, 4])
    s.exclude([0])
    assert s.target_distribution().tolist() == [0.0, 0.5, 0.25, 0.25]


def test_a_source_with_no_training_window_is_taken():
    """An empty source (``[0, 2, 2, 4]``: source 1 holds no window, e.g. a file shorter than one block) is valid;
    offsets must not fall (a strict rise refused it). Its share is 0 and the others keep theirs."""
    s = _sampler(4, source_offsets=[0, 2, 2, 4], source_names=["a", "empty", "b"])
    s.exclude([3])
    assert s.target_distribution().tolist() == [0.25, 0.25, 0.5, 0.0]
    with pytest.raises(ValueError, match=r"source_offsets must rise from 0 to num_samples=4, got \[0, 3, 2, 4\]"):
        _sampler(4, source_offsets=[0, 3, 2, 4])


def test_a_second_setup_on_the_same_dataset_keeps_the_exclusions():
    """``setup`` again with the same number of windows (a second fit or a validate on the same datamodule) keeps the
    excluded windows; a new size starts them over (they would index other windows)."""
    s = _sampler(10)
    s.exclude([3, 7])
    s.setup(10)
    assert s.state_dict()["excluded"].tolist() == [3, 7] and s.num_excluded == 2
    s.setup(12)
    assert s.state_dict()["excluded"].tolist() == [] and s.num_excluded == 0


def test_exclude_refuses_the_index_one_past_the_last_window_by_name():
    """Index ``num_samples`` is out of range as -1 is: the line names it, where an off-by-one check left it to the
    tensor's own IndexError ('index 4 is out of bounds for dimension 0')."""
    s = _sampler(4)
    with pytest.raises(ValueError, match=r"^exclude: sample index 4 is out of range for 4 samples$"):
        s.exclude([1, 4])
    assert s.num_excluded == 0


def test_windows_of_a_validation_only_source_do_not_count_as_left_to_train_on(caplog):
    """Prior [0.5, 0.5, 0, 0] (the second source has weight 0: validation only). Excluding both training windows
    leaves nothing to train on, though two windows are not excluded; counting windows of weight >= 0 went on with a
    prior of zeros (0/0: a NaN target). The error is the one line: the training source, of share 1, is not also
    warned about as a source whose share goes to the others (there are none)."""
    s = _sampler(4, base_weights=torch.tensor([0.5, 0.5, 0.0, 0.0]), source_offsets=[0, 2, 4])
    s.exclude([0])
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        with pytest.raises(RuntimeError, match="every training sample has been excluded"):
            s.exclude([1])
    assert [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.data.samplers"] == []


def test_step_generator_streams_are_independent():
    """``stream`` (public: ``lit_dtrain.data.samplers.step_generator``) gives another generator for the same
    (seed, step); a stream term left out gave every stream stream 0's numbers."""
    a, b = (torch.rand(4, generator=step_generator(1, 5, stream)) for stream in (0, 1))
    assert not torch.equal(a, b)
    assert torch.equal(a, torch.rand(4, generator=step_generator(1, 5)))


def test_a_run_without_a_dataset_key_takes_a_keyed_state():
    """A datamodule of one's own that gives no ``dataset_key`` cannot tell datasets apart: it takes a state saved
    with a key (its exclusions, by size and range checks alone), as a keyed run takes an older state without one;
    refusing it left such a run unable to resume a checkpoint of the built-in datamodule's."""
    saved = _sampler(10, dataset_key="corpus-a")
    saved.exclude([2, 5])
    run = _sampler(10)
    run.load_state_dict(saved.state_dict())
    assert run.state_dict()["excluded"].tolist() == [2, 5]


def test_an_exhausted_source_without_names_is_warned_about_by_its_index(caplog):
    """Sources without ``source_names`` are named by their index from 0, as a mixture's config lists them: the second
    of three, every window excluded, is source '1' (from 1 it was '2', the third source's index)."""
    s = _sampler(6, source_offsets=[0, 2, 4, 6])
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        s.exclude([2, 3])
    lines = [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.data.samplers"]
    assert len(lines) == 1 and lines[0].startswith("data source '1': every training window of it is excluded")
    assert "its share 0.3333 of the mixture" in lines[0]
