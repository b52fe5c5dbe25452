"""lit_dtrain destroys the default process group at exit for every backend (Lightning does so for NCCL only)."""

from __future__ import annotations

import os
import subprocess
import textwrap

import lightning as L
import pytest
import torch.distributed as dist

from tests.conftest import PYTHON, ROOT

SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist

    # registered first, so it runs last (atexit is LIFO): what the interpreter's own teardown will meet
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    from lit_dtrain.utils.distributed import destroy_process_group_at_exit

    before = atexit._ncallbacks()
    if sys.argv[2] == "1":
        destroy_process_group_at_exit()
        destroy_process_group_at_exit()  # once per process, however often it is called
    print("handlers added:", atexit._ncallbacks() - before, flush=True)
""")


@pytest.mark.parametrize("register", [True, False])
def test_the_gloo_group_is_destroyed_before_the_interpreter_exits(tmp_path, register):
    """A gloo group left alive can abort the process at exit (SIGABRT, "terminate called without an active
    exception"): 2 of 20 two-rank scripts here, and one CI run of ``train.py -m`` with DDP."""
    proc = subprocess.run([PYTHON, "-c", SCRIPT, str(tmp_path / "store"), "1" if register else "0"],
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert f"initialized at exit: {not register}" in lines, proc.stdout
    assert f"handlers added: {int(register)}" in lines, proc.stdout


class GroupProbe(L.Callback):
    """Records, at train start, whether a process group exists and its world size."""

    seen: list = []

    def on_train_start(self, trainer, pl_module):
        GroupProbe.seen.append((dist.is_initialized(), dist.get_world_size() if dist.is_initialized() else 0))


@pytest.mark.parametrize("group_before", [False, True])
def test_a_one_process_group_the_run_started_is_destroyed_when_train_returns(tiny_cfg, tmp_path, group_before):
    """An NCCL group that FSDP or DDP on one device left behind made a later CPU train() in the same process fail
    at its first collective; train() now destroys a one-process group it started, and leaves one it found."""
    from lit_dtrain.train import train

    if group_before:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    GroupProbe.seen = []
    try:
        ddp1 = ["strategy=ddp", "trainer.devices=1", "trainer.accelerator=cpu", "sample.max_new_tokens=0",
                f"+callbacks.probe._target_={__name__}.GroupProbe"]
        train(tiny_cfg(*ddp1))
        assert GroupProbe.seen == [(True, 1)]  # DDP on one device ran in a one-process group
        assert dist.is_initialized() == group_before
        if not group_before:  # and the launch variables Lightning exported for it are gone with it
            assert [k for k in ("LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT") if k in os.environ] == []
        _, objects = train(tiny_cfg(*ddp1, run="second"))  # a second one in this process starts a group again
        assert objects["trainer"].global_step == 6 and GroupProbe.seen == [(True, 1)] * 2
        assert dist.is_initialized() == group_before
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_threads_lightnings_launcher_set_for_the_run_above_are_not_left_for_later_tests():
    """Runs after the test above in this file's order. Its one-device DDP runs had Lightning's launcher give torch
    ``cores // 1`` threads and export ``OMP_NUM_THREADS`` to match (2 on a 2-core machine): every later test in this
    process ran on 2 threads instead of ``_one_torch_thread``'s 1, and every ``train.py`` it started inherited
    ``OMP_NUM_THREADS=2`` (conftest's ``_restore_lightning_env`` puts both back now)."""
    import torch

    from tests.conftest import SESSION_OMP_NUM_THREADS

    assert (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")) == (1, SESSION_OMP_NUM_THREADS)


def test_all_gather_stacked_stacks_by_rank_without_torchs_deprecation_warning(tmp_path):
    """Lightning's strategy.all_gather goes through torch.distributed.nn.functional.all_gather, which torch 2.13
    deprecates with a FutureWarning on the console (a spike exclusion or a stop signal under DDP printed it)."""
    import warnings

    import torch

    from lit_dtrain.utils.distributed import all_gather_stacked

    assert torch.equal(all_gather_stacked(torch.tensor([3, 4])), torch.tensor([[3, 4]]))  # no group: one rank
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test
            gathered = all_gather_stacked(torch.tensor([7.5]))
        assert gathered.shape == (1, 1) and gathered.item() == 7.5
    finally:
        dist.destroy_process_group()


def test_only_a_rank_that_was_interrupted_is_read_as_an_interruption():
    """An error whose own text says 'was interrupted' (an OSError's) was read as a Ctrl-C: its line lost 'fix that
    rank's error'."""
    from lit_dtrain.utils.distributed import failure_line, only_interruptions

    error = failure_line(OSError("the read was interrupted by the NFS server"), 1, " at step 3")
    assert error == "rank 1 stopped at step 3: OSError: the read was interrupted by the NFS server"
    interrupt = failure_line(KeyboardInterrupt(), 1, " at step 2")
    assert interrupt == "rank 1 was interrupted at step 2 (KeyboardInterrupt)"
    read = [only_interruptions(f) for f in ([error], [interrupt], [interrupt, error], [])]
    assert read == [False, True, False, False]


def test_a_rank_a_stop_signal_ended_before_training_is_read_as_interrupted_not_as_an_error():
    """SIGTERM to rank 0 alone while a 2-rank resume set up (``LogsKeptUntilTraining`` turns it into
    ``StoppedBeforeTraining``, a ``SystemExit`` of 143) ended rank 1 with 'rank 1: rank 0 stopped before training:
    StoppedBeforeTraining: 143; ... fix that rank's error.'"""
    import signal

    from lit_dtrain.logs_kept import StoppedBeforeTraining
    from lit_dtrain.utils.distributed import failure_line, only_interruptions

    line = failure_line(StoppedBeforeTraining(signal.SIGTERM), 0, " before training, resuming from step 4")
    assert line == "rank 0 was interrupted before training, resuming from step 4 (SIGTERM)"
    assert only_interruptions([line])
