"""A rank whose collective failed because its peers were only stopped by a signal before training stops with that
signal too (``collectives_named``): it exited 1 with 'error: rank 0: rank 1 was interrupted before training (SIGTERM);
this rank's next collective then failed'. The 2-rank runs are in tests/e2e/test_stop_one_rank_before_training_ddp.py."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from lit_dtrain._collective_errors import CollectiveError, collectives_named, interrupting_signal
from lit_dtrain.callbacks.preemption import PreemptionCheckpoint
from lit_dtrain.stops_before_training import StoppedBeforeTraining
from lit_dtrain.utils.distributed import PeerRankFailedError, failure_line


def _trainer(tmp_path, training_started=False, fn="fit", own_signal=None):
    preemption = PreemptionCheckpoint(str(tmp_path))
    preemption.signum = own_signal
    strategy = SimpleNamespace(training_started=training_started, launcher=None)
    return SimpleNamespace(world_size=2, global_rank=0, global_step=0, strategy=strategy, callbacks=[preemption],
                           state=SimpleNamespace(fn=fn), ckpt_path=None)


def _peer_failed(*lines):
    raise PeerRankFailedError("rank 0: " + "; ".join(lines), tuple(lines))


def test_the_signal_the_interrupted_peers_lines_name():
    term = failure_line(StoppedBeforeTraining(signal.SIGTERM), 1, " before training")
    hup = failure_line(StoppedBeforeTraining(signal.SIGHUP), 2, " before training")
    ctrl_c = failure_line(KeyboardInterrupt(), 1, " before training")
    error = failure_line(ValueError("bad"), 1, " before training")
    assert [interrupting_signal(f) for f in ([term], [hup, term], [ctrl_c], [term, error], [])] == [
        signal.SIGTERM, signal.SIGTERM, signal.SIGINT, None, None]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_peer_stopped_before_training_stops_this_rank_with_its_signal(tmp_path, signum):
    line = failure_line(StoppedBeforeTraining(signum), 1, " before training")
    with pytest.raises(StoppedBeforeTraining) as info, collectives_named(_trainer(tmp_path)):
        _peer_failed(line)
    assert (info.value.signum, info.value.code) == (signum, 128 + signum)


def test_this_ranks_own_higher_signal_and_a_peers_ctrl_c(tmp_path):
    line = failure_line(StoppedBeforeTraining(signal.SIGHUP), 1, " before training")
    with pytest.raises(StoppedBeforeTraining) as info, collectives_named(_trainer(tmp_path, own_signal=signal.SIGTERM)):
        _peer_failed(line)
    assert info.value.signum == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt), collectives_named(_trainer(tmp_path)):  # train() says it and exits 130
        _peer_failed(failure_line(KeyboardInterrupt(), 1, " before training"))


@pytest.mark.parametrize("trainer", [dict(training_started=True), dict(fn="validate")], ids=["training", "validate"])
def test_a_peers_error_or_a_stop_once_training_started_is_still_a_collective_error(tmp_path, trainer):
    stopped = failure_line(StoppedBeforeTraining(signal.SIGTERM), 1, " before training")
    stand_in = _trainer(tmp_path, **trainer)
    with pytest.raises(CollectiveError, match="rank 1 was interrupted"), collectives_named(stand_in):
        _peer_failed(stopped)
    error = failure_line(ValueError("bad"), 1, " before training")
    with pytest.raises(CollectiveError, match="ValueError: bad"), collectives_named(_trainer(tmp_path)):
        _peer_failed(stopped, error)


def test_a_peers_ctrl_c_in_the_final_validation_is_this_ranks_ctrl_c_too(tmp_path):
    """Ctrl-C to rank 1 alone in train()'s final validation: rank 0 exited 1 with 'error: rank 0: rank 1 was
    interrupted at step 6 (KeyboardInterrupt); this rank's next collective then failed'; now train() says it and exits
    130, naming the checkpoint, as it does for a Ctrl-C to every rank there."""
    ctrl_c = failure_line(KeyboardInterrupt(), 1, " at step 6")
    with pytest.raises(KeyboardInterrupt), collectives_named(_trainer(tmp_path, training_started=True, fn="validate")):
        _peer_failed(ctrl_c)
