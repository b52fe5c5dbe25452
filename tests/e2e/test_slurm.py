"""``train.py`` under Slurm's ``srun`` (docs/running.md: "Launch with torchrun or SLURM"), simulated: the test
starts the 2 tasks itself, each with the environment srun gives a task of ``srun --ntasks-per-node=2`` on one node
(``SLURM_NODELIST=127.0.0.1``; Lightning's ``SLURMEnvironment`` takes ``MASTER_PORT`` from the job id's last 4
digits + 15000, so the job id is drawn for a free port). Lightning reads the world size and ranks from that
environment instead of launching rank 1; ``scontrol`` is a stand-in on ``PATH`` that acts as Slurm does on a
requeue: it sends SIGTERM to every task of the job."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 8
ARGS = [*TINY, "trainer=ddp_cpu", *[o for o in TINY if o.startswith("trainer.")], "trainer.devices=2",
        f"trainer.max_steps={STEPS}", "trainer.val_check_interval=4", "sample.max_new_tokens=0"]


def job_id_with_a_free_port() -> str:
    """A Slurm job id whose port under Lightning (15000 + its last 4 digits) is free on 127.0.0.1."""
    for _ in range(100):
        suffix = random.randrange(10000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + suffix))
            except OSError:
                continue
        return f"7{suffix:04d}"
    raise RuntimeError("no free port in 15000-24999")


def srun_env(tmp_path: Path, job: str, rank: int, ntasks: int = 2) -> dict:
    env = {k: v for k, v in subprocess_env(tmp_path).items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_", "PL_")) and k not in ("RANK", "LOCAL_RANK",
                                                                                        "WORLD_SIZE", "NODE_RANK")}
    env.update(SLURM_JOB_ID=job, SLURM_JOB_NAME="lit", SLURM_STEP_ID="0", SLURM_NTASKS=str(ntasks),
               SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_NNODES="1",
               SLURM_NODEID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODELIST="127.0.0.1",
               PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def fake_scontrol(tmp_path: Path) -> None:
    """``scontrol requeue <job>``: records its arguments, then sends SIGTERM to the tasks (pids in ``pids``)."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    script = tmp_path / "bin" / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\nkill -TERM $(cat {tmp_path}/pids)\n')
    script.chmod(0o755)


def srun(tmp_path: Path, corpus: Path, job: str, *extra: str, env: dict | None = None,
         timeout: float = 240) -> list[tuple[int, str]]:
    """Start the 2 tasks of a job step (``env``: variables to change); (exit status, output) of each."""
    args = [PYTHON, str(ROOT / "train.py"), *ARGS, "data=textfiles", f"data.sources.0.paths=[{corpus}]", *extra]
    procs = [subprocess.Popen(args, cwd=tmp_path, env={**srun_env(tmp_path, job, rank), **(env or {})},
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in range(2)]
    (tmp_path / "pids").write_text(" ".join(str(p.pid) for p in procs))
    deadline, results = time.monotonic() + timeout, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out = proc.communicate()[0]
            pytest.fail(f"srun task hung past {timeout} s:\n{out[-3000:]}")
        results.append((proc.returncode, out))
    return results


def test_srun_trains_one_run_of_two_ranks_and_a_requeue_resumes_it_exactly(tmp_path, corpus):
    """(1) 2 srun tasks form one process group of 2 (Lightning launches no rank of its own), write one run dir,
    slurm-<job>.<step>, and end bitwise where Lightning's own launcher of 2 processes does (same seed).
    (2) Slurm's requeue signal (SIGUSR1) at step 3: rank 0 runs `scontrol requeue <job>`, and Slurm's SIGTERM to
    both tasks stops them with 143 and last.ckpt; the requeued job (same job and step ids, resume=auto) ends bitwise
    where the uninterrupted run does. Lightning's auto-requeue saved hpc_ckpt_1.ckpt at the signal and the final
    validation loaded it: the requeued run reported the val_loss of the weights of step 3."""
    fake_scontrol(tmp_path)
    straight_job, requeued_job = job_id_with_a_free_port(), job_id_with_a_free_port()
    straight = srun(tmp_path, corpus, straight_job)
    for rank, (status, out) in enumerate(straight):
        assert status == 0, out[-3000:]
        assert f"GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in out, out[-3000:]  # one group of 2, one member each
        assert out.count("Initializing distributed") == 1, out[-3000:]  # no rank launched by Lightning
    runs = tmp_path / "outputs" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [f"slurm-{straight_job}.0"]

    env = subprocess_env(tmp_path)  # Lightning's own launcher: this process starts rank 1
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *ARGS, "data=textfiles", f"data.sources.0.paths=[{corpus}]",
                           "run_name=lightning"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    signal_at_3 = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=3",
                   "+callbacks.fault.signal=SIGUSR1"]  # on both tasks, as `sbatch --signal=USR1@<s>` sends it
    stopped = srun(tmp_path, corpus, requeued_job, "resume=auto", *signal_at_3)
    assert [status for status, _ in stopped] == [143, 143], stopped[0][1][-3000:] + stopped[1][1][-3000:]
    assert (tmp_path / "scontrol.calls").read_text() == f"requeue {requeued_job}\n"  # rank 0 only, once
    run = runs / f"slurm-{requeued_job}.0"
    assert not (run / "summary.json").exists()
    assert 3 <= torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] < STEPS
    requeued = srun(tmp_path, corpus, requeued_job, "resume=auto")
    assert [status for status, _ in requeued] == [0, 0], requeued[0][1][-3000:]
    assert "Restoring states from the checkpoint path at" in requeued[0][1]

    names = {"straight": f"slurm-{straight_job}.0", "lightning": "lightning", "requeued": f"slurm-{requeued_job}.0"}
    ckpts = {k: torch.load(runs / n / "checkpoints" / "last.ckpt", weights_only=True) for k, n in names.items()}
    summaries = {k: json.loads((runs / n / "summary.json").read_text()) for k, n in names.items()}
    for name in ("lightning", "requeued"):
        assert ckpts[name]["global_step"] == summaries[name]["steps"] == STEPS
        for key, value in ckpts["straight"]["state_dict"].items():
            assert torch.equal(ckpts[name]["state_dict"][key], value), (name, key)
        assert summaries[name]["val_loss"] == summaries["straight"]["val_loss"], name
    opt = [ckpts[k]["optimizer_states"][0]["state"] for k in ("straight", "requeued")]
    for param, state in opt[0].items():
        assert all(torch.equal(opt[1][param][k], v) for k, v in state.items() if torch.is_tensor(v)), param
    assert not list(run.glob("hpc_ckpt_*.ckpt"))  # Lightning's auto-requeue checkpoint, which it loaded unasked


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        (["trainer.devices=1"], {}, "trainer.devices=1 starts 1 process(es) per node, but srun started "
                                    "SLURM_NTASKS_PER_NODE=2: set trainer.devices=2 trainer.num_nodes=1"),
        ([], {"SLURM_JOB_NAME": "bash"}, "SLURM_JOB_NAME='bash' makes Lightning ignore Slurm"),
    ],
    ids=["devices_below_tasks", "job_name_bash"],
)
def test_a_launch_that_would_not_form_one_run_of_two_ranks_is_refused(tmp_path, corpus, extra, env, message):
    """trainer.devices=1 under 2 tasks per node trained 2 single-process runs into one run dir, both exiting 0;
    SLURM_JOB_NAME=bash made each task launch a rank of its own (4 processes, 2 runs racing for one run dir, one
    killed). Each task now exits 1 with one line naming the variables and the fix, before any compute."""
    for status, out in srun(tmp_path, corpus, job_id_with_a_free_port(), *extra, env=env, timeout=120):
        assert status == 1, out[-3000:]
        assert message in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]


def test_torchrun_inside_an_srun_step_trains_one_run_of_its_workers(tmp_path, corpus):
    """`srun --ntasks-per-node=1 torchrun --nproc_per_node=2 train.py`: the workers form torchrun's world of 2, as
    Lightning chooses by itself. (lit_dtrain's Slurm plugin, given to the Trainer there, took the step's one task for
    the world: with trainer.devices=2 it refused the tasks per node, with trainer.devices=1 each worker trained as
    rank 0 of 1 in one run dir.)"""
    env = {**srun_env(tmp_path, job_id_with_a_free_port(), 0, ntasks=1), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train.py"), *ARGS, "data=textfiles", f"data.sources.0.paths=[{corpus}]",
                           "trainer.max_steps=2", "run_name=inside"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in out and "GLOBAL_RANK: 1, MEMBER: 2/2" in out, out[-3000:]
    assert json.loads((tmp_path / "outputs" / "runs" / "inside" / "summary.json").read_text())["steps"] == 2


EARLY_SIGUSR1 = """
import os, runpy, signal, sys
import lit_dtrain.train as train_module
checks = train_module.check_slurm_launch
def signalled_checks(cfg):  # Slurm's requeue signal during the config checks, before the Trainer exists
    os.kill(os.getpid(), signal.SIGUSR1)
    return checks(cfg)
train_module.check_slurm_launch = signalled_checks
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_requeue_signal_before_the_trainer_exists_requeues_the_job(tmp_path, corpus):
    """`sbatch --signal=USR1@<s>` during the config checks (or the model's build, a checkpoint's checks): the handler
    was registered only with the Trainer, and Python's default action for SIGUSR1 ended the task (-10, exit status
    138) without a requeue. Now rank 0 runs `scontrol requeue <job>` at once, and Slurm's SIGTERM stops it (143, with
    its line): nothing was trained, the requeued job starts again."""
    fake_scontrol(tmp_path)
    job = job_id_with_a_free_port()
    args = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer.devices=1", "run_name=early",
            "resume=auto"]  # a requeue continues the run (without resume=auto the signal requeues nothing)
    proc = subprocess.Popen([PYTHON, "-c", EARLY_SIGUSR1, str(ROOT / "train.py"), *args], cwd=tmp_path,
                            env=srun_env(tmp_path, job, 0, ntasks=1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    (tmp_path / "pids").write_text(str(proc.pid))
    out = proc.communicate(timeout=120)[0]
    # Slurm's stop after the requeue, said and with 143 as any stop before training (not SIGUSR1's -10; -15 with no
    # line until stop 50 held the stop signals from train()'s start)
    assert proc.returncode == 143 and "stopped by SIGTERM before training" in out, out[-3000:]
    assert (tmp_path / "scontrol.calls").read_text() == f"requeue {job}\n"
    assert not list((tmp_path / "outputs").glob("runs/early/checkpoints/*.ckpt"))
