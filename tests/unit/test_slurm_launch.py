"""lit_dtrain.slurm: the checks of an srun launch, and Slurm's requeue signal (the real 2-task runs are in
tests/e2e/test_slurm.py)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.slurm import (
    catch_requeue_signal,
    check_slurm_launch,
    requeue_job,
    slurm_plugins,
    warn_about_a_requeued_fresh_start,
)


def srun_env(ntasks: int = 2, per_node: int = 2, nnodes: int = 1, rank: int = 0, **extra) -> dict:
    env = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "lit", "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(ntasks),
           "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_NNODES": str(nnodes),
           "SLURM_NODEID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODELIST": "127.0.0.1"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def cfg(devices=2, num_nodes=1, accelerator="cpu"):
    return OmegaConf.create({"trainer": {"devices": devices, "num_nodes": num_nodes, "accelerator": accelerator}})


@pytest.mark.parametrize(("devices", "num_nodes", "env"), [
    (2, 1, srun_env()),
    ([0, 1], 1, srun_env()),
    (4, 2, srun_env(ntasks=8, per_node=4, nnodes=2)),
    (1, 1, srun_env(ntasks=1, per_node=1)),  # one task: Lightning's world of 1
    (2, 1, {}),  # not under Slurm
    (2, 1, srun_env(SLURM_JOB_NAME="interactive", SLURM_STEP_NUM_TASKS="1")),  # salloc shell: Lightning launches
])
def test_a_launch_that_forms_one_run_passes(devices, num_nodes, env):
    check_slurm_launch(cfg(devices, num_nodes), env)


@pytest.mark.parametrize(("conf", "env", "message"), [
    (cfg(1), srun_env(), "trainer.devices=1 starts 1 process(es) per node, but srun started SLURM_NTASKS_PER_NODE=2: "
                         "set trainer.devices=2 trainer.num_nodes=1, or srun --ntasks-per-node=1 (each task would"),
    (cfg("auto"), srun_env(), "trainer.devices=auto starts 1 process(es) per node"),
    (cfg(4), srun_env(), "trainer.devices=4 starts 4 process(es) per node, but srun started SLURM_NTASKS_PER_NODE=2"),
    (cfg(2, 2), srun_env(), "trainer.num_nodes=2, but srun runs on SLURM_NNODES=1 nodes"),
    (cfg(), srun_env(SLURM_STEP_NUM_TASKS=None), "this process was not started by srun"),
    (cfg(), srun_env(SLURM_STEP_NUM_TASKS="1"), "SLURM_NTASKS=2, but srun started SLURM_STEP_NUM_TASKS=1 tasks"),
    (cfg(), srun_env(SLURM_JOB_NAME="bash"), "SLURM_JOB_NAME='bash' makes Lightning ignore Slurm"),
    (cfg(), srun_env(SLURM_NTASKS_PER_NODE=None), "without --ntasks-per-node (SLURM_NTASKS_PER_NODE is not set)"),
    (cfg(), srun_env(SLURM_PROCID=None), "SLURM_PROCID is not set to a number"),
])
def test_a_launch_with_a_wrong_world_size_or_a_missing_rank_is_refused(conf, env, message):
    with pytest.raises(ConfigError) as e:
        check_slurm_launch(conf, env)
    assert message in str(e.value)


def fake_scontrol(tmp_path, status: int = 0) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\nexit {status}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_the_requeue_signal_requeues_the_job_from_rank_0_only(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path)["PATH"])
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.slurm"):
        requeue_job(srun_env(rank=1))
        # the second node's first task (SLURM_LOCALID 0): Slurm signals every task, one requeue is the job's
        requeue_job(srun_env(ntasks=4, nnodes=2, rank=2, SLURM_LOCALID="0", SLURM_NODEID="1"))
        assert not (tmp_path / "calls").exists()
        requeue_job(srun_env(rank=0))
        requeue_job(srun_env(rank=0, SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3"))
    assert (tmp_path / "calls").read_text() == "requeue 1234\nrequeue 77_3\n"
    assert "requeued job 1234" in caplog.text


def test_a_failed_requeue_is_logged_and_the_run_trains_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.slurm"):
        requeue_job(srun_env())
    assert "`scontrol requeue 1234` failed (FileNotFoundError" in caplog.text
    assert "the job is not requeued and trains on" in caplog.text


def test_under_srun_lightning_gets_slurm_without_its_auto_requeue(monkeypatch):
    """Lightning's auto-requeue saved hpc_ckpt_<n>.ckpt in the run dir at SIGUSR1 and loaded it in the final
    validation, in place of the trained weights."""
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    assert slurm_plugins() == []  # not under Slurm
    for key, value in srun_env().items():
        monkeypatch.setenv(key, value)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        (environment,) = slurm_plugins()
        assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is False
        assert signal.getsignal(signal.SIGUSR1).__name__ == "_on_requeue_signal"
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_torchruns_workers_in_an_srun_step_are_left_to_torchruns_environment(monkeypatch):
    """Lightning prefers torchrun's environment to Slurm's; a SLURMEnvironment given to the Trainer took the step's
    single task for the world of both workers (rank 0 of 1 each)."""
    torchrun = {"TORCHELASTIC_RUN_ID": "r1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for key, value in {**srun_env(ntasks=1, per_node=1), **torchrun}.items():
        monkeypatch.setenv(key, value)
    assert slurm_plugins() == []
    check_slurm_launch(cfg(2), os.environ)  # torchrun's workers, not srun's tasks: nothing to check against Slurm


@pytest.mark.parametrize(("continues", "calls", "rank"), [
    (True, "requeue 1234\n", 0), (False, None, 0), (False, None, 1),  # rank 0 says it, once for the job
])
def test_the_requeue_signal_requeues_only_a_run_the_requeued_job_continues(tmp_path, monkeypatch, caplog, continues,
                                                                           calls, rank):
    """A 1-task srun job with the default run_name and no resume=auto, sent SIGUSR1 at step 5: it was requeued, and
    the requeued job, the same command, trained again from step 0 in a new run dir without a word. Without
    resume=auto the signal now requeues nothing and says why; the run trains on (Slurm's SIGTERM saves last.ckpt)."""
    env = srun_env(ntasks=1, per_node=1) if rank == 0 else srun_env(rank=rank)
    for key, value in {**env, "PATH": fake_scontrol(tmp_path)["PATH"]}.items():
        monkeypatch.setenv(key, value)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.slurm"):
            catch_requeue_signal(continues=continues)
            slurm_plugins()  # the Trainer's plugins keep the setting train() gave
            os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        catch_requeue_signal(continues=True)  # (under the srun environment, this registers the handler again)
        signal.signal(signal.SIGUSR1, previous)
    assert ((tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else None) == calls
    assert ("the job is not requeued, since this command has no resume=auto" in caplog.text) is (
        not continues and rank == 0)
    assert signal.getsignal(signal.SIGUSR1) == previous  # a later SIGUSR1 to pytest ran `scontrol requeue`


@pytest.mark.parametrize(("conf", "env", "ckpt_path", "warned"), [
    ({}, srun_env(ntasks=1, per_node=1, SLURM_RESTART_COUNT="1"), None, True),
    ({"resume": "auto"}, srun_env(ntasks=1, per_node=1, SLURM_RESTART_COUNT="1"), None, False),
    ({}, srun_env(ntasks=1, per_node=1, SLURM_RESTART_COUNT="1"), "x/last.ckpt", False),  # it resumes that file
    ({}, srun_env(ntasks=1, per_node=1, SLURM_RESTART_COUNT="0"), None, False),  # the job's first start
    ({}, srun_env(rank=1, SLURM_RESTART_COUNT="2"), None, False),  # rank 0 says it
])
def test_a_requeued_job_that_starts_over_says_so(caplog, conf, env, ckpt_path, warned):
    """A 1-task job requeued by Slurm (SLURM_RESTART_COUNT=1) whose command has no resume=auto and the default run_name
    trained again from step 0 in a new run dir, without a word; the interrupted start's last.ckpt sat unused."""
    run = "2026-12-06_10-22-11"
    config = OmegaConf.create({"run_name": run, "paths": {"output_dir": f"out/runs/{run}"}, **conf})
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.slurm"):
        warn_about_a_requeued_fresh_start(config, ckpt_path, env)
    assert ("Slurm requeued this job" in caplog.text) is warned  # (rank 1's count is 2)
    assert ("SLURM_RESTART_COUNT=1: Slurm requeued this job, but the command has no resume=auto, so this start trains "
            "from step 0 in run dir out/runs/2026-12-06_10-22-11" in caplog.text) is warned


def test_torchruns_workers_are_not_checked_against_the_srun_tasks():
    """One srun task per node, each running torchrun with 4 workers: the workers' world is torchrun's, not Slurm's
    tasks (2 tasks, 1 per node, for trainer.devices=4 x 2 nodes)."""
    env = srun_env(ntasks=2, per_node=1, nnodes=2, TORCHELASTIC_RUN_ID="job")
    check_slurm_launch(cfg(devices=4, num_nodes=2), env)
    with pytest.raises(ConfigError, match="SLURM_NTASKS_PER_NODE=1"):
        check_slurm_launch(cfg(devices=4, num_nodes=2), {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"})


def test_one_slurm_task_is_not_checked_and_uneven_tasks_per_node_are_checked_by_their_total():
    """A batch script's one task running ``python train.py`` (no srun step) trains on its own; tasks per node that
    differ (SLURM_NTASKS_PER_NODE=2,1, no one number) are checked by the total, devices x nodes."""
    check_slurm_launch(cfg(devices=1), srun_env(ntasks=1, per_node=1, SLURM_STEP_NUM_TASKS=None))
    env = srun_env(ntasks=3, nnodes=2, SLURM_NTASKS_PER_NODE="2,1")
    with pytest.raises(ConfigError, match=r"trainer.devices=2 x trainer.num_nodes=2 = 4 processes, .*SLURM_NTASKS=3"):
        check_slurm_launch(cfg(devices=2, num_nodes=2), env)
