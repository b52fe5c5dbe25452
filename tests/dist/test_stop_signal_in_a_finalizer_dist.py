"""2-process gloo: a SIGTERM before training on rank 1 alone whose exception Python dropped in a finalizer (the
garbage of a sweep's previous job collected as the next starts). Rank 1 alone stopped at ``on_train_start`` with 143
while rank 0 trained into a collective that failed: 'error: rank 0: rank 1 was interrupted before training (SIGTERM);
this rank's next collective then failed at step 0 (...). Resume with resume=auto.', exit status 1. Every rank stops
there, before training, with 143."""

from __future__ import annotations

import os
import signal
import sys
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.dist._compressed_ddp_helpers import WORLD, TinyModule, as_launched_rank, run_rank_processes

pytestmark = pytest.mark.dist


class _Garbage:
    pass


def _worker(rank: int, port: int, root: str) -> None:
    from lit_dtrain.stops_before_training import StopsBeforeTraining
    from lit_dtrain.strategies import make_ddp

    as_launched_rank(rank, port)
    sys.unraisablehook = lambda unraisable: None  # (Python's 'Exception ignored in: <finalize object ...>')
    stops = StopsBeforeTraining()
    outcome = {"code": None, "steps": None}
    try:
        with stops:
            if rank == 1:  # SIGTERM to rank 1, its handler run inside a finalizer: its exception dropped
                garbage = _Garbage()
                weakref.finalize(garbage, signal.raise_signal, signal.SIGTERM)
                del garbage
            trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=3, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=root, strategy=make_ddp(collective_timeout_s=60), callbacks=[stops])
            try:
                trainer.fit(TinyModule(root, "finalizer"))
            finally:
                outcome["steps"] = trainer.global_step
    except SystemExit as e:
        outcome["code"] = e.code
    except Exception as e:  # noqa: BLE001 - recorded for the test
        outcome["code"] = f"{type(e).__name__}: {e}"
    torch.save(outcome, Path(root) / f"rank{rank}.pt")
    os._exit(0)


def test_a_stop_signal_dropped_on_one_rank_stops_every_rank_before_training(tmp_path):
    run_rank_processes(_worker, str(tmp_path), timeout=200)
    outcomes = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert outcomes == [{"code": 143, "steps": 0}] * WORLD, outcomes
