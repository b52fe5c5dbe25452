"""2-process gloo: a rank that raises before Lightning's ``pre_setup`` barrier (in ``prepare_data``, which Lightning
runs on local rank 0 alone) has every rank refuse the fit at once, and the process group serves the next fit (a DDP
multirun's next job). Rank 1 waited in the barrier for the collective timeout, then failed with a collective error
(in a multirun its process group was then gone for every later job)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.dist._compressed_ddp_helpers import WORLD, as_launched_rank, run_rank_processes
from tests.dist.test_compressed_ddp_failures import _FailAt

pytestmark = pytest.mark.dist


class _PrepareFails(_FailAt):
    """A tiny module (of plain DDP) whose ``prepare_data`` (rank 0's alone) raises ``error``, if given."""

    def __init__(self, dump_dir: str, error: Exception | None) -> None:
        super().__init__(dump_dir, "fit", step=-1, how="")
        self.error = error

    def prepare_data(self) -> None:
        if self.error is not None:
            raise self.error


def _worker(rank: int, port: int, root: str, error: Exception) -> None:
    """Two fits of one's own in one process group under ``make_ddp``: the first with ``error`` in rank 0's
    prepare_data, the second without; each rank's outcomes are saved."""
    from lit_dtrain.strategies import make_ddp

    as_launched_rank(rank, port)
    outcomes = []
    for fails in (error, None):
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            strategy=make_ddp(collective_timeout_s=60))
        outcome = {"type": None, "message": None}
        try:
            trainer.fit(_PrepareFails(root, fails))
            outcome["steps"] = trainer.global_step
        except Exception as e:  # noqa: BLE001 - record what this rank raised
            outcome = {"type": type(e).__name__, "message": str(e)}
        outcomes.append({**outcome, "time": time.time()})
    torch.save(outcomes, Path(root) / f"rank{rank}.pt")
    os._exit(0)


@pytest.mark.parametrize("error, rank_1_type, rank_1_message", [
    # a bad input: the same error on rank 1, so that it is reported once
    (("CorpusError", "data source 'x': path '/nope' does not exist"), "CorpusError",
     "data source 'x': path '/nope' does not exist"),
    (("RuntimeError", "the download failed"), "PeerFailedBeforeSetup",
     "rank 0 stopped before training: RuntimeError: the download failed (its traceback is in that rank's output)"),
])
def test_a_rank_0_failure_in_prepare_data_is_every_ranks_at_once_and_the_group_serves_the_next_fit(
        tmp_path, error, rank_1_type, rank_1_message):
    from lit_dtrain.data.corpus import CorpusError

    kind, text = error
    run_rank_processes(_worker, str(tmp_path), CorpusError(text) if kind == "CorpusError" else RuntimeError(text),
                       timeout=200)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert (r0[0]["type"], r0[0]["message"]) == (kind, text), r0
    assert (r1[0]["type"], r1[0]["message"]) == (rank_1_type, rank_1_message), r1
    assert abs(r1[0]["time"] - r0[0]["time"]) < 20, (r0, r1)  # at once, not after the 60 s collective timeout
    assert r0[1]["steps"] == r1[1]["steps"] == 2, (r0, r1)  # the next fit trains on the same group
