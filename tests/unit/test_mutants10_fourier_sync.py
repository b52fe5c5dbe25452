"""Exact results of how a FourierSampler update travels to the table (``data/samplers/fourier_sync.py``) where
single-point mutants passed test_fourier_sampler_lag_and_resume.py, test_fourier_sampler_callback_logging.py and
test_fourier_sampler_spikes.py (tenth hand mutation audit)."""

from __future__ import annotations

import pytest
import torch

from tests.unit._fourier_helpers import _observations, feed, make


def test_pending_records_of_a_state_with_no_band_layout_are_refused():
    """A state whose table was never bound (``seq_len`` 0: no band layout) cannot hold pending records: records of
    12 bytes (index and score, no band) are refused by the one-line error, where a width check alone took them and
    unpacking them failed on a reshape of 0 bands."""
    s = make(stages=False, lag=1)
    feed(s, 2)
    state = s.state_dict()
    damaged = {**state, "seq_len": 0, "pending_records": [state["pending_records"][0][:, :12].contiguous()]}
    with pytest.raises(ValueError, match=r"'pending_records' of step 2: expected uint8 records \[n, 12\] for 0 bands"):
        make(stages=False, lag=1).load_state_dict(damaged)


def test_a_pending_record_of_the_window_one_past_the_last_is_refused():
    """A pending record naming window 50 of 50 is outside ``[0, 50)`` as window 200 is (an off-by-one check took it,
    and applying it at the next observe failed on the table's index 50)."""
    s = make(stages=False, lag=1)
    feed(s, 2)
    state = s.state_dict()
    records = state["pending_records"][0].clone()
    records[0, :8] = torch.tensor([50], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match=r"'pending_records' of step 2 names samples outside \[0, 50\)"):
        make(stages=False, lag=1).load_state_dict({**state, "pending_records": [records]})


def test_step_not_observed_keeps_that_steps_own_update_pending():
    """lag=1, step 2 observed (step 1's update applied, step 2's queued), then ``step_not_observed(2)`` (a caller
    that observed a micro-batch of step 2 before the step was dropped): the draw of step 3 must see the table through
    step 1, so step 2's update stays pending (``updates`` 1) and the draw is lag=0's after one update. Applying every
    pending update there drew step 3 from the table through step 2."""
    obs = _observations(2)
    lag1, lag0 = make(stages=False, lag=1), make(stages=False)
    lag1.observe(*obs[0], 1)
    lag1.observe(*obs[1], 2)
    lag1.step_not_observed(2)
    lag0.observe(*obs[0], 1)
    assert lag1.updates == lag0.updates == 1 and [u.step for u in lag1._pending] == [2]
    assert torch.equal(lag1.global_batch(3, 32), lag0.global_batch(3, 32))


def test_landed_stats_waiting_on_an_update_restored_from_a_checkpoint_is_none():
    """lag=1: step 2's update is pending when the state is saved; restored, it carries records but no logging stats
    (they were this process's, not the checkpoint's). ``landed_stats(2, wait=True)`` (the callback's at the end of
    a fit) is then None, as documented, while the live sampler reads step 2's 0.328 from its own pending update.
    Reading every pending update of the step there raised TypeError on float(None)."""
    obs = _observations(2)
    s = make(stages=False, lag=1)
    s.observe(*obs[0], 1)
    s.observe(*obs[1], 2)
    assert s.landed_stats(2, wait=True)["top_band_energy"] == pytest.approx(0.32807839, rel=1e-6)
    restored = make(stages=False, lag=1)
    restored.load_state_dict(s.state_dict())
    assert [u.step for u in restored._pending] == [2] and restored._pending[0].stats is None
    assert restored.landed_stats(2, wait=True) is None
