"""2-process gloo: a rank that raises alone under lit_dtrain's plain DDP (``strategy=auto``/``ddp``, ``make_ddp``) is
named in the other rank's one-line error, as under ``CompressedDDPStrategy`` (test_compressed_ddp_failures.py).
Rank 1 raising ``OSError: No space left on device`` at step 4 of ``torchrun ... train.py trainer=ddp_cpu`` left rank
0's last line at 'a collective failed at step 4 (... Connection closed by peer ...). Another rank probably died or
hung': the cause was only in rank 1's Hydra traceback above it."""

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


class _FailOdd(_FailAt):
    """``how="blank"``: an error whose text starts on its second line; ``"interrupt"``: a ``KeyboardInterrupt`` (a
    second Ctrl-C that reached this rank alone); ``"peer_text"``: a project's own ``RuntimeError`` whose text reads
    like gloo's."""

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_step and self.how == "peer_text":
            raise RuntimeError("connection to the peer database timed out")
        if self.global_step == self.fail_step and self.how == "blank":
            raise ValueError("\nthe shard's index is empty")
        if self.global_step == self.fail_step and self.how == "interrupt":
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def _ddp_trainer(root: str) -> L.Trainer:
    from lit_dtrain.strategies import make_ddp

    return L.Trainer(accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     strategy=make_ddp(collective_timeout_s=30))


def _plain_ddp_worker(rank: int, port: int, root: str, how: str) -> None:
    """One fit through train.py's ``_fit`` under ``make_ddp``: rank 1 fails at step 2 as ``how`` says; each rank's
    outcome is saved."""
    as_launched_rank(rank, port)
    from lit_dtrain.train import _fit

    trainer = _ddp_trainer(root)
    outcome = {"type": None, "message": None}
    try:
        _fit(trainer, _FailOdd(root, "fit", step=2, how=how if rank == 1 else None), None, None)
    except BaseException as e:  # noqa: BLE001 - record what this rank raised (a KeyboardInterrupt's SystemExit too)
        outcome = {"type": type(e).__name__, "message": str(e)}
    outcome["time"] = time.time()
    torch.save(outcome, Path(root) / f"rank{rank}.pt")
    os._exit(0)


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_rank_that_raised_alone_under_plain_ddp_is_named_by_the_other(tmp_path, how):
    run_rank_processes(_plain_ddp_worker, str(tmp_path), how)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r0["type"] == "CollectiveError", r0
    message = r0["message"]
    if how == "raise":
        r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
        assert r1["type"] == "ValueError" and r0["time"] - r1["time"] < 20, (r0, r1)  # at once, not after 30 s
        assert message.startswith("rank 0: rank 1 stopped at step 2: ValueError: planned failure of fit; this rank's "
                                  "next collective then failed at step 2 ("), message
        assert message.endswith("): fix that rank's error. Resume with resume=auto."), message
    else:  # killed: nothing recorded, the line stays as it was
        assert message.startswith("rank 0: a collective failed at step 2 (RuntimeError: "), message
        assert "Another rank probably died or hung" in message, message
        # gloo's error, not the strategy's PeerRankFailedError, whose text is a line of its own: it read 'a collective
        # failed at step 2 (PeerRankFailedError: rank 0: a collective failed (RuntimeError: ...'
        assert message.count("a collective failed") == 1, message


@pytest.mark.parametrize("how", ["blank", "interrupt"])
def test_the_named_line_of_an_error_without_a_first_line_and_of_an_interrupted_rank(tmp_path, how):
    """Rank 0's line named 'rank 1 stopped at step 2: ValueError:' for ``ValueError("\\nthe shard's index is
    empty")``, and a rank 1 stopped by a ``KeyboardInterrupt`` as 'KeyboardInterrupt:; ... fix that rank's error'."""
    run_rank_processes(_plain_ddp_worker, str(tmp_path), how)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r0["type"] == "CollectiveError", r0
    if how == "blank":
        assert r0["message"].startswith("rank 0: rank 1 stopped at step 2: ValueError: the shard's index is empty; "
                                        "this rank's next collective then failed at step 2 ("), r0
        assert r0["message"].endswith("): fix that rank's error. Resume with resume=auto."), r0
    else:
        assert r0["message"].startswith("rank 0: rank 1 was interrupted at step 2 (KeyboardInterrupt); this rank's "
                                        "next collective then failed at step 2 ("), r0
        assert r0["message"].endswith("): Resume with resume=auto.") and "fix" not in r0["message"], r0


def _own_fit_worker(rank: int, port: int, root: str) -> None:
    """A fit of one's own (``trainer.fit``, not train.py's ``_fit``) under ``make_ddp``: rank 1 raises at step 2."""
    as_launched_rank(rank, port)

    trainer = _ddp_trainer(root)
    outcome = {"type": None, "message": None}
    try:
        trainer.fit(_FailAt(root, "fit", step=2, how="raise" if rank == 1 else None))
    except Exception as e:  # noqa: BLE001 - record what this rank raised
        outcome = {"type": type(e).__name__, "message": str(e)}
    torch.save(outcome, Path(root) / f"rank{rank}.pt")
    os._exit(0)


def test_a_fit_of_ones_own_under_make_ddp_names_the_rank_that_raised(tmp_path):
    """Rank 0 of one's own ``trainer.fit(..., strategy=make_ddp())`` got gloo's bare 'RuntimeError: ... Connection
    closed by peer' in 0.6 s while rank 1's ValueError sat unread in the store."""
    run_rank_processes(_own_fit_worker, str(tmp_path))
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r0["type"] == "PeerRankFailedError", r0
    assert r0["message"].startswith("rank 0: rank 1 stopped at step 2: ValueError: planned failure of fit. This "
                                    "rank's next collective with that peer then failed ("), r0


def test_a_projects_own_runtime_error_that_reads_like_a_collective_failure_is_named(tmp_path):
    """Rank 1's own ``RuntimeError("connection to the peer database timed out")`` (raised in its training step) was
    read by its text as a failed collective: rank 1 ended with 'a collective failed at step 2 (PeerRankFailedError:
    ...  a peer rank stopped ...)' and recorded nothing, so rank 0's line said 'Another rank probably died or hung'.
    Now rank 1 raises its own error and rank 0's line names it."""
    run_rank_processes(_plain_ddp_worker, str(tmp_path), "peer_text")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert (r1["type"], r1["message"]) == ("RuntimeError", "connection to the peer database timed out"), r1
    assert r0["type"] == "CollectiveError", r0
    assert r0["message"].startswith("rank 0: rank 1 stopped at step 2: RuntimeError: connection to the peer database "
                                    "timed out; this rank's next collective then failed at step 2 ("), r0
    assert r0["message"].endswith("): fix that rank's error. Resume with resume=auto."), r0


def _resume_refused_worker(rank: int, port: int, root: str, ckpt: str) -> None:
    """train.py's ``_fit`` under ``make_ddp`` resuming ``ckpt`` (step 4): rank 1 alone refuses it at the load."""
    as_launched_rank(rank, port)
    from lit_dtrain.train import _fit
    from tests.faults import RefuseAtLoad

    trainer = _ddp_trainer(root)
    trainer.callbacks.append(RefuseAtLoad(rank=1))
    outcome = {"type": None, "message": None}
    try:
        _fit(trainer, _FailAt(root, "fit", step=-1, how=None), None, ckpt)
    except BaseException as e:  # noqa: BLE001 - record what this rank raised
        outcome = {"type": type(e).__name__, "message": str(e)}
    torch.save(outcome, Path(root) / f"rank{rank}.pt")
    os._exit(0)


def test_a_resume_rank_1_alone_refuses_is_named_at_the_checkpoints_step_not_at_step_0(tmp_path):
    """A step-4 checkpoint that rank 1 alone refused while it loaded read 'rank 0: rank 1 stopped at step 0: ...; this
    rank's next collective then failed at step 0' on rank 0: the loops, which hold the step, were not restored yet
    (2 gloo ranks of ``train.py trainer=ddp_cpu resume=auto``)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_FailAt(str(tmp_path), "fit", step=-1, how=None))
    ckpt = str(tmp_path / "step4.ckpt")
    trainer.save_checkpoint(ckpt)
    run_rank_processes(_resume_refused_worker, str(tmp_path), ckpt)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert (r1["type"], r1["message"]) == ("ConfigError", "refused at the load on rank 1"), r1
    assert r0["type"] == "CollectiveError", r0
    assert r0["message"].startswith(
        "rank 0: rank 1 stopped before training, resuming from step 4: ConfigError: refused at the load on rank 1; "
        "this rank's next collective then failed before training, resuming from step 4 ("), r0


RANK_0_FAILS_ALONE = '''
import sys, time, datetime
import torch, torch.distributed as dist
from lit_dtrain.utils.distributed import destroy_process_group_at_exit, explain_collective_failure, record_rank_failure
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
destroy_process_group_at_exit()  # train()'s
dist.barrier()
if rank == 0:  # a resume rank 0 alone refused: its error recorded, then the process ends
    record_rank_failure(ValueError("refused on rank 0 alone"), " before training")
    sys.exit(1)
time.sleep(3)  # still loading the checkpoint when rank 0 refused: its next collective comes after rank 0 ended
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as e:
    print("LINE:", explain_collective_failure(e), flush=True)
'''


def test_a_rank_0_that_fails_alone_keeps_the_store_for_the_other_ranks_read(tmp_path):
    """Rank 0's process holds the store (no torchrun agent): a resume rank 0 alone refused left rank 1 with torch's
    ~30-frame 'recvValue failed' warning and a line that did not name rank 0's error (the store was gone with rank 0's
    process). Rank 0 keeps it at exit until rank 1 has read it (``utils.store_kept``)."""
    import subprocess
    import sys

    from tests.conftest import free_port, subprocess_env

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK_0_FAILS_ALONE, str(r), str(port)],
                              env=subprocess_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    (_, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [1, 0], err0[-2000:] + err1[-2000:]
    assert "recvValue failed" not in err1, err1[-3000:]
    assert "LINE: rank 1: rank 0 stopped before training: ValueError: refused on rank 0 alone. This rank's next " \
           "collective with that peer then failed" in out1, out1 + err1[-3000:]


RANK_0_OUTLIVES_ITS_CHILD = '''
import os, signal, subprocess, sys, time, datetime
import torch.distributed as dist
from lit_dtrain.utils.distributed import destroy_process_group_at_exit, record_rank_failure
from lit_dtrain.utils.store_kept import note_peer_processes
rank, port = int(sys.argv[1]), int(sys.argv[2])
if rank == 0:  # Lightning's launcher: rank 0 starts rank 1 as its child (launcher.procs)
    child = subprocess.Popen([sys.executable, "-c", sys.argv[3], "1", str(port)])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
destroy_process_group_at_exit()  # train()'s
dist.barrier()
if rank == 1:  # killed (OOM, SIGKILL): it reads nothing more
    os.kill(os.getpid(), signal.SIGKILL)
child.wait()
note_peer_processes(type("Launcher", (), {"procs": [child]})())  # RankFailureRecords.on_exception's
record_rank_failure(ValueError("rank 0 fails alone"), " before training")
print("EXIT AT", time.time(), flush=True)
sys.exit(1)
'''


def test_a_rank_0_that_fails_alone_does_not_keep_the_store_for_a_rank_whose_process_ended(tmp_path):
    """Under Lightning's launcher a rank 1 that was killed reads no record: rank 0 waited the full 8 s for it, and
    Lightning's observer, which SIGKILLs rank 0 within 5 s of a child's death, ended rank 0 with 137 where its error's
    status was 1 (train.py trainer=ddp_cpu, rank 1 SIGKILLed and rank 0 raising in the fit's setup: 137, 1 without the
    wait). Rank 0 stops keeping the store once its child has ended."""
    import subprocess
    import sys
    import time

    from tests.conftest import free_port, subprocess_env

    port = free_port()
    proc = subprocess.run([sys.executable, "-c", RANK_0_OUTLIVES_ITS_CHILD, "0", str(port), RANK_0_OUTLIVES_ITS_CHILD],
                          env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    exit_at = float(next(line for line in proc.stdout.splitlines() if line.startswith("EXIT AT")).split()[2])
    assert ended - exit_at < 4.0, ended - exit_at  # it waited 8 s
