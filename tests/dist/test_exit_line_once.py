"""2-process gloo test of a run's last one-line error under DDP: every rank reached the same refusal (resume=auto
after the compressor changed, strategy=ddp_compressed/int4 then /topk, under trainer=ddp_cpu) and each printed its
'error:' line, so the user read it twice. Rank 0's line alone is printed now, unless the ranks' lines differ."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_dtrain.utils.distributed import print_once_across_ranks
from tests.conftest import free_port, leave_rank

pytestmark = pytest.mark.dist
CASES = {  # case -> each rank's line (None: that rank gives none, as a rank hung in a collective)
    "same": ["error: compressor state is for 'int4'", "error: compressor state is for 'int4'"],
    "differ": ["error: rank 0's refusal", "error: rank 1's refusal"],
    "rank 0 gives none": [None, "error: rank 1's refusal"],
}


def _worker(rank: int, port: int, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    printed = {}
    for case, lines in CASES.items():
        if lines[rank] is not None:
            file = io.StringIO()
            print_once_across_ranks(lines[rank], file, wait_s=3.0)  # ample on a loaded CI machine
            printed[case] = file.getvalue()
        dist.barrier()  # the next case starts afresh: rank 0 drops the keys this one left
        if rank == 0:
            store = dist.distributed_c10d._get_default_store()
            for key in [*(f"lit_dtrain/exit_line/rank{r}" for r in range(2)), "lit_dtrain/exit_line_seen/rank1",
                        "lit_dtrain/exit_line_reached/rank0"]:
                store.delete_key(key)
        dist.barrier()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(printed, f)
    leave_rank()


def test_a_refusal_every_rank_reaches_is_printed_once(tmp_path):
    out = str(tmp_path / "printed")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    rank0, rank1 = (json.loads(open(f"{out}.{r}").read()) for r in range(2))
    # a line some ranks alone give is labelled with the rank (rank 1's alone was not: whose was it?)
    assert rank0 == {"same": "error: compressor state is for 'int4'\n", "differ": "[rank: 0] error: rank 0's refusal\n"}
    assert rank1 == {"same": "", "differ": "[rank: 1] error: rank 1's refusal\n",
                     "rank 0 gives none": "[rank: 1] error: rank 1's refusal\n"}


def _before_the_group(rank: int, port: int, out_path: str) -> None:
    """A torchrun worker refused before init_process_group (a bad config value every rank reads alike)."""
    from lightning.pytorch.utilities import rank_zero_only

    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE="2")
    rank_zero_only.rank = rank  # as Lightning reads RANK when it is imported
    from datetime import timedelta

    started = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    started.add("started", 1)  # both workers reach the refusal together, as two ranks reading one config do
    while int(started.add("started", 0)) < 2:
        time.sleep(0.05)
    file = io.StringIO()
    print_once_across_ranks("error: trainer.max_steps must be a positive step budget, got -5", file, wait_s=3.0)
    with open(f"{out_path}.{rank}", "w") as f:
        f.write(file.getvalue())


def test_a_refusal_before_the_process_group_is_printed_once_under_torchrun(tmp_path):
    """torchrun trainer.max_steps=-5: each worker refused it before any process group, both lines reached the
    console. The workers share the line through torchrun's agent store (here a TCPStore this test holds)."""
    from datetime import timedelta

    port, out = free_port(), str(tmp_path / "printed")
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    mp.spawn(_before_the_group, args=(port, out), nprocs=2, join=True)
    assert [open(f"{out}.{r}").read() for r in range(2)] == [
        "error: trainer.max_steps must be a positive step budget, got -5\n", ""]
    del agent


def _survivor(rank: int, port: int, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()  # both connected: under load rank 1 was still in gloo's connectFullMesh when rank 0 died
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # and its store with it
    time.sleep(1.0)
    import lit_dtrain.sigterm_exit as sigterm_exit
    from lit_dtrain import sweeps
    from lit_dtrain.train import CollectiveError

    sweeps.in_multirun = lambda: True
    sigterm_exit.train_resume_hint = lambda run_name: "the same -m arguments and resume=auto"

    def job(cfg):
        raise CollectiveError("rank 1: a collective failed at step 5 (Connection reset by peer).")

    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT)
    os.dup2(fd, 2)  # torch's C++ warnings too
    try:
        sweeps.reports_user_errors(job)(None)
    except SystemExit as e:
        print(f"exit {e.code}", file=sys.stderr, flush=True)
    os._exit(0)


def test_a_sweep_ending_line_after_rank_0_died_is_printed_alone(tmp_path):
    """Rank 0 killed in a DDP multirun: rank 1's one line came after 16 lines of torch's C++ stack ('sendBytes failed
    ... Broken pipe'), printed by the request to the store rank 0's process held."""
    out = tmp_path / "stderr"
    ctx = mp.start_processes(_survivor, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    for process in ctx.processes:
        process.join(60)
    assert out.read_text().splitlines() == [
        "error: rank 1: a collective failed at step 5 (Connection reset by peer); the sweep stops at this job (its "
        "later jobs would fail in their first collective: the ranks' connections are gone): resume with the same -m "
        "arguments and resume=auto",
        "exit 1",
    ]


def test_a_refusal_without_a_store_is_labelled_only_where_there_are_several_processes(monkeypatch):
    """Rank 1 that Lightning's launcher started, refused before the process group (a config it reads otherwise than
    rank 0): its line was not labelled, so whose it was went unsaid. A single process's line is as before."""
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    monkeypatch.setenv("WORLD_SIZE", "2")  # Lightning's launcher sets it for the ranks it starts
    file = io.StringIO()
    print_once_across_ranks("error: data.sources.0.paths: no such file", file, wait_s=0.1)
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    monkeypatch.delenv("WORLD_SIZE")
    print_once_across_ranks("error: data.sources.0.paths: no such file", file, wait_s=0.1)
    assert file.getvalue().splitlines() == ["[rank: 1] error: data.sources.0.paths: no such file",
                                            "error: data.sources.0.paths: no such file"]


def test_a_torchrun_worker_without_the_agent_store_is_not_labelled(monkeypatch):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torchrun --rdzv-backend=c10d): no agent store to share the line, so each
    worker prints it; rank 1's duplicate read '[rank: 1] error: ...', a refusal it alone gave, though both did."""
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    file = io.StringIO()
    print_once_across_ranks("error: trainer.max_steps must be a positive step budget, got -5", file, wait_s=0.1)
    assert file.getvalue() == "error: trainer.max_steps must be a positive step budget, got -5\n"


def test_a_refusal_rank_1_alone_gives_before_the_group_waits_wait_s_not_twice(monkeypatch):
    """torchrun, a refusal only rank 1 reaches (rank 0 goes on to the process group): rank 1 waited 2 x wait_s for
    rank 0's line (4.0 s measured) before printing its own; it waits twice as long only once rank 0 reached one."""
    from datetime import timedelta

    from lightning.pytorch.utilities import rank_zero_only

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    file, started = io.StringIO(), time.monotonic()
    print_once_across_ranks("error: trainer.max_steps must be a positive step budget, got -5", file, wait_s=1.0)
    elapsed = time.monotonic() - started
    assert file.getvalue() == "[rank: 1] error: trainer.max_steps must be a positive step budget, got -5\n"
    assert 1.0 <= elapsed < 1.8, elapsed
    del agent
