"""Exact results of the FourierSampler's checkpointed state (``data/samplers/fourier_state.py``) where single-point
mutants passed test_fourier_sampler_lag_and_resume.py, test_fourier_sampler_probabilities.py and
test_fourier_sampler_spikes.py (tenth hand mutation audit)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.errors import ConfigError
from tests.unit._fourier_helpers import feed, make


def _same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        elif key == "pending_records":
            assert len(value) == len(b[key]) and all(torch.equal(x, y) for x, y in zip(value, b[key])), key
        else:
            assert value == b[key], key


def test_a_resumed_sampler_saves_the_state_it_loaded():
    """load_state_dict then state_dict, with no step between, gives back every entry as saved: the table, the
    counters (``updates`` 6, ``last_step`` 6, ``nonfinite_skipped`` 1), the band layout and the pending update of
    step 7. ``last_step`` read as 0 on load was written back as 0 by the next checkpoint of a resumed run that had not
    observed a step yet (a run stopped again at once)."""
    s = make(seed=1, step_unit=1, lag=1)
    feed(s, 5)
    loss = torch.rand(4, 64)
    loss[0, 3] = float("nan")
    s.observe(loss, torch.tensor([0, 1, 2, 3]), 6)  # step 5's update is applied; step 6's (one NaN row) is pending
    s.observe(torch.rand(4, 64), torch.tensor([4, 5, 6, 7]), 7)  # step 6's update applied: its NaN row is skipped
    state = s.state_dict()
    assert (state["updates"], state["last_step"], state["nonfinite_skipped"], state["pending_steps"]) == (6, 6, 1, [7])
    resumed = make(seed=1, step_unit=1, lag=1)
    resumed.load_state_dict(state)
    _same_state(state, resumed.state_dict())


def test_a_pending_update_of_another_dataset_is_refused_before_any_window_was_visited():
    """lag=1 after one observed step: no window is visited yet, and the state's only learning is the pending update
    of step 1, whose records name windows of the dataset it was saved on. Loaded into a run on another dataset of the
    same size it is refused by the dataset key, as a visited table is (checking the key only when ``visits`` has a
    visit took it, and applied those scores to other text at the next step)."""
    def sampler(key: str) -> FourierSampler:
        s = FourierSampler(stages=False, lag=1)
        s.setup(50, seed=0, dataset_key=key)
        return s

    saved = sampler("corpus-a")
    saved.observe(torch.rand(4, 64), torch.tensor([0, 1, 2, 3]), 1)
    state = saved.state_dict()
    assert not state["visits"].any() and state["pending_steps"] == [1]
    with pytest.raises(ConfigError, match="indexes the windows of dataset corpus-a, and this run's is corpus-b"):
        sampler("corpus-b").load_state_dict(state)
    same = sampler("corpus-a")
    same.load_state_dict(state)
    assert [u.step for u in same._pending] == [1]


def test_a_random_sampler_state_loaded_into_a_used_table_leaves_the_state_of_a_fresh_one():
    """A RandomSampler's state (exclusions only) starts the table over: loaded into a sampler that had already
    learned (5 updates, one NaN row skipped), its next ``state_dict`` is that of a fresh sampler given the same state
    (but for the auto band edges it keeps), counters included: left as they were, ``updates`` 5 went on with an
    empty table, and the ``require_updates`` check read that empty table as fed."""

    from lit_dtrain.data.samplers import RandomSampler

    random = RandomSampler()
    random.setup(50)
    random.exclude([7, 9])
    used = make(seed=2, stages=False)
    feed(used, 4)
    loss = torch.rand(2, 64)
    loss[1, 0] = float("inf")
    used.observe(loss, torch.tensor([3, 4]), 5)
    assert (used.updates, used.last_step, used.nonfinite_skipped) == (5, 5, 1)
    used.load_state_dict(random.state_dict())
    fresh = make(seed=2, stages=False)
    fresh.load_state_dict(random.state_dict())
    auto = ("max_freq", "num_bands")  # the auto band edges stay bound (256/4 for T=64); the table is unbound
    _same_state({k: v for k, v in fresh.state_dict().items() if k not in auto},
                {k: v for k, v in used.state_dict().items() if k not in auto})
    assert used.state_dict()["excluded"].tolist() == [7, 9] and used.updates == 0


def test_a_state_loaded_into_a_lag_one_sampler_drops_the_updates_it_had_pending():
    """lag=1, a state saved after step 4 (step 4's update pending) loaded back into the same sampler after steps 5-6
    (step 6's update pending), as a rollback to a snapshot does: the sampler holds the saved pending update alone and
    draws the next 4 steps exactly as a fresh sampler given that state. Kept, the stale update of step 6 was applied
    at the next observe on top of the restored table: an update of a step the rollback undid."""
    live = make(seed=4, step_unit=1, lag=1)
    feed(live, 4)
    state = live.state_dict()
    feed(live, 2, start=4)
    live.load_state_dict(state)
    fresh = make(seed=4, step_unit=1, lag=1)
    fresh.load_state_dict(state)
    assert [u.step for u in live._pending] == [u.step for u in fresh._pending] == [4] and live.updates == 3
    assert torch.equal(feed(live, 4, start=4), feed(fresh, 4, start=4))
    _same_state(fresh.state_dict(), live.state_dict())
