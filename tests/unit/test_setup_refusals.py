"""What a rank that failed before the ranks' setup leaves for the others (``strategies/_setup_refusals.py``; the
2-process run is ``tests/dist/test_setup_refusals_dist.py``)."""

from __future__ import annotations

import pickle

import pytest

from lit_dtrain.data.corpus import CorpusError
from lit_dtrain.strategies import _setup_refusals
from lit_dtrain.strategies._setup_refusals import PeerFailedBeforeSetup, leave_refusal


class ShardMissing(CorpusError):
    """A bad input of one's own whose class is not built again from its message (pickle calls cls(*args))."""

    def __init__(self, shard: int, where: str) -> None:
        super().__init__(f"shard {shard} is missing from {where}")


class ShardMissingHere(CorpusError):
    """One whose class is built again from its message, with another one: pickle calls cls(message)."""

    def __init__(self, shard, where: str = "/data/shards") -> None:
        super().__init__(f"shard {shard} is missing from {where}")


class _Store:
    def __init__(self) -> None:
        self.values = {}

    def set(self, key, value) -> None:
        self.values[key] = value


@pytest.mark.parametrize("error, left", [
    (CorpusError("data source 'x': path '/nope' does not exist"),
     (CorpusError, "data source 'x': path '/nope' does not exist")),
    # rank 1 raised PeerFailedBeforeSetup, no bad input: its Hydra traceback (40 lines) beside rank 0's line, now
    # labelled '[rank: 0] error: ...' as the ranks' lines differed; and it said rank 0's traceback was in its output
    (ShardMissing(3, "/data/shards"), (CorpusError, "shard 3 is missing from /data/shards")),
    # rank 1 said 'shard shard 3 is missing from /data/shards is missing from /data/shards' beside rank 0's line
    (ShardMissingHere(3), (CorpusError, "shard 3 is missing from /data/shards")),
    (RuntimeError("the download failed"), (PeerFailedBeforeSetup, "rank 0 stopped before training: RuntimeError: the "
                                           "download failed (its traceback is in that rank's output)")),
])
def test_a_bad_input_is_left_as_one_the_others_raise_with_the_same_message(monkeypatch, error, left):
    store = _Store()
    monkeypatch.setattr(_setup_refusals, "_store_and_rank", lambda: (store, 0))
    leave_refusal(error)
    (payload,) = store.values.values()
    raised = pickle.loads(payload)
    assert (type(raised), str(raised)) == left


def test_a_stop_signal_before_the_setup_is_left_for_the_others_and_waits_for_them_to_read_it(monkeypatch):
    """SIGTERM to rank 0 alone in its token cache build (prepare_data, before the ranks' pre_setup barrier): rank 0
    said it stopped before training and exited 143, and rank 1, waiting at the barrier in the store rank 0's process
    held, printed torch's TCPStore warnings (two C++ stack traces) and 'error: rank 1: a collective failed before
    training (... Connection closed by peer ...) ... Resume with resume=auto', exit 1. The stop is left for the
    others, who stop with it, and rank 0 waits (2 s at most) until they have read it."""
    import signal

    from lit_dtrain.stops_before_training import StoppedBeforeTraining

    store = _Store()
    store.check = lambda keys: all(k in store.values for k in keys)
    monkeypatch.setattr(_setup_refusals, "_store_and_rank", lambda: (store, 0))
    monkeypatch.setattr(_setup_refusals.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(_setup_refusals.time, "sleep", lambda s: store.set(
        next(iter(store.values)).replace("refused/rank0", "seen/rank1"), "1"))  # rank 1 reads it
    leave_refusal(StoppedBeforeTraining(signal.SIGTERM))
    refused = [v for k, v in store.values.items() if k.endswith("refused/rank0")]
    raised = pickle.loads(refused[0])
    assert isinstance(raised, StoppedBeforeTraining) and (raised.signum, raised.code) == (signal.SIGTERM, 143)
    assert any(k.endswith("seen/rank1") for k in store.values)  # it waited for rank 1


def test_the_stop_a_peer_left_is_raised_here_and_not_left_again_in_a_store_its_rank_is_closing(monkeypatch):
    """Rank 1 raised rank 0's stop at its pre_setup barrier, then its strategy's on_exception left it in the store
    again: rank 0, which holds the store, exits once rank 1 has read the stop, so that write met a closed socket and
    printed torch's TCPStore 'sendBytes failed ... Broken pipe' C++ stack trace beside the stop lines (1 run in 8 of
    tests/e2e/test_stop_before_training_ddp.py's token-cache case). The refusal raised here is marked, and
    record_rank_failure leaves nothing for it; this rank's own errors are still left."""
    import signal
    from datetime import timedelta

    from lit_dtrain.stops_before_training import StoppedBeforeTraining
    from lit_dtrain.utils import distributed as records

    store = _Store()
    store.check = lambda keys: all(k in store.values for k in keys)
    store.get = lambda key: store.values[key]
    store.add = lambda key, n: store.values.setdefault(key, 1)
    monkeypatch.setattr(_setup_refusals, "_store_and_rank", lambda: (store, 0))
    monkeypatch.setattr(_setup_refusals.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(_setup_refusals.time, "sleep", lambda s: store.set(
        next(iter(store.values)).replace("refused/rank0", "seen/rank1"), "1"))  # rank 1 reads it
    leave_refusal(StoppedBeforeTraining(signal.SIGTERM))  # rank 0's, left before it exits
    monkeypatch.setattr(_setup_refusals, "_store_and_rank", lambda: (store, 1))
    with pytest.raises(StoppedBeforeTraining) as raised:
        _setup_refusals.raise_a_peers_refusal(timedelta(seconds=5))
    assert raised.value.signum == signal.SIGTERM
    monkeypatch.setattr(records, "_store_and_rank", lambda: (store, 1))
    before = dict(store.values)
    records.record_rank_failure(raised.value)
    assert store.values == before  # nothing written to rank 0's store
    records.record_rank_failure(ValueError("rank 1's own"))
    assert [v for k, v in store.values.items() if k not in before] == ["rank 1 stopped: ValueError: rank 1's own"]
