"""PreemptionCheckpoint under 2-rank DDP (gloo, CPU, 127.0.0.1) in a user's own project: a SIGTERM during the
validation that ends an epoch, to one rank or to both, is saved by every rank at that validation's end (the epoch's
boundary, step 4), and the resumed fit ends bitwise as the straight one. It was saved one step later, mid-epoch (step
5), which Lightning does not resume exactly on a plain DataLoader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.dist._preemption_epoch_end_jobs import _worker

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_a_sigterm_in_the_epoch_end_validation_saves_at_its_end_on_every_rank_and_resumes_exactly(
        tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["straight"]["step"] == 12 and r0["straight"]["params"] == r1["straight"]["params"]
    for name in ("one", "both"):
        assert r0[name]["saved"] == (4, 0), name  # (was step 5, epoch 1)
        for r in (r0, r1):  # every rank stopped after the save, at the same step
            assert (r[name]["stopped"], r[name]["step"]) == ("SIGTERMException", 4), name
            resumed = r[name + "_resumed"]
            assert resumed["stopped"] is None and resumed["step"] == 12, name
            assert resumed["params"] == r0["straight"]["params"], name  # bitwise
            assert resumed["wsd"] == r0["straight"]["wsd"], name
