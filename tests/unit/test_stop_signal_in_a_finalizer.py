"""A SIGTERM whose handler runs inside a finalizer (a ``weakref.finalize`` callback, a ``__del__``: the garbage of the
sweep's previous job collected as the next job starts) before training: Python drops an exception raised there
('Exception ignored in: <finalize object ...>'), so the stop was lost:
``python train.py -m optimizer.lr=1e-3,3e-3,1e-2`` sent SIGTERM as job 1 started trained jobs 1 and 2
to their end and exited 0."""

from __future__ import annotations

import logging
import signal
import sys
import weakref

import pytest

from lit_dtrain.stops_before_training import StoppedBeforeTraining, StopsBeforeTraining


class _Garbage:
    pass


def _signal_in_a_finalizer() -> None:
    """SIGTERM to this process, its handler run inside a ``weakref.finalize`` callback (where Python drops what it
    raises, reporting it to ``sys.unraisablehook``)."""
    garbage = _Garbage()
    weakref.finalize(garbage, signal.raise_signal, signal.SIGTERM)
    del garbage


def test_a_stop_signal_dropped_in_a_finalizer_stops_at_training_start(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="lit_dtrain")
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    stops = StopsBeforeTraining()
    with pytest.raises(SystemExit, match="143"), stops:
        _signal_in_a_finalizer()  # the handler's exception is dropped here: the start goes on
        assert [d.exc_type for d in dropped] == [StoppedBeforeTraining]
        stops.on_train_start(None, None)  # ... and stops here, before training
        pytest.fail("training started after a SIGTERM")
    assert not stops.training_started
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    assert [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.logs_kept"] == [
        "stopped by SIGTERM before training (a new run): nothing trained, no checkpoint written; run the same "
        "command again to start it",
        "exiting with status 143 (stopped by SIGTERM, not finished)",
    ]


def test_a_stop_signal_raised_where_it_can_be_is_not_raised_again():
    """The usual case: the handler's exception leaves the block; a later StopsBeforeTraining is not stopped by it."""
    with pytest.raises(SystemExit, match="143"), StopsBeforeTraining():
        signal.raise_signal(signal.SIGTERM)
    later = StopsBeforeTraining()
    with later:
        later.on_train_start(None, None)
    assert later.training_started



def test_the_ranks_agree_once_per_fit_for_every_such_callback_of_a_rank(monkeypatch):
    """Rank 0 of a resume holds two (``LogsKeptUntilTraining`` beside ``StopsBeforeTraining``), the other ranks one:
    a gather for each hung the resume of 2 srun ranks (``tests/e2e/test_slurm.py``). One gather, of the highest
    signal either dropped, and both stop with it."""
    import types

    import torch

    import lit_dtrain.utils.distributed as distributed

    gathered = []
    monkeypatch.setattr(distributed, "all_gather_stacked",
                        lambda t: gathered.append(int(t)) or torch.stack([t, torch.tensor(0)]))
    first, second = StopsBeforeTraining(), StopsBeforeTraining()
    second.signalled = signal.SIGHUP  # dropped by the second one's handler only
    trainer = types.SimpleNamespace(world_size=2, callbacks=[object(), first, second])
    module = types.SimpleNamespace(device="cpu")
    with pytest.raises(StoppedBeforeTraining) as stopped:
        first.on_train_start(trainer, module)
    assert stopped.value.signum == signal.SIGHUP
    assert gathered == [signal.SIGHUP]
    with pytest.raises(StoppedBeforeTraining):
        second.on_train_start(trainer, module)
    assert gathered == [signal.SIGHUP]  # agreed already: no second gather
