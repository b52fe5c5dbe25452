"""``train.py`` under torchrun (docs/running.md: "Launch with torchrun or SLURM"): every rank runs Hydra and ``train()``
itself and Lightning reads the ranks from torchrun's environment instead of launching rank 1."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env
from tests.e2e._reliability_helpers import assert_refused_once

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_torchrun_two_ranks_train_and_resume_exactly(tmp_path, corpus):
    """2 gloo ranks launched by torchrun train one run (one run dir, rank 0's summary); a resume=auto of a run
    stopped at step 4 ends bitwise where the uninterrupted 6-step run does, compressor state included."""
    common = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer=ddp_cpu",
              "strategy=ddp_compressed/powersgd", "scheduler.total_steps=6", "sample.max_new_tokens=0",
              "trainer.enable_progress_bar=false"]

    def torchrun(*args):
        proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(ROOT / "train.py"), *common, *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    torchrun("run_name=straight", "trainer.max_steps=6")
    torchrun("run_name=split", "trainer.max_steps=4")
    torchrun("run_name=split", "trainer.max_steps=6", "resume=auto")
    runs = tmp_path / "outputs" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["split", "straight"]
    ckpts = {name: torch.load(runs / name / "checkpoints" / "last.ckpt", weights_only=True)
             for name in ("straight", "split")}
    assert ckpts["split"]["global_step"] == ckpts["straight"]["global_step"] == 6
    for key, value in ckpts["straight"]["state_dict"].items():
        assert torch.equal(ckpts["split"]["state_dict"][key], value), key
    summaries = {name: json.loads((runs / name / "summary.json").read_text()) for name in ("straight", "split")}
    assert summaries["split"]["steps"] == 6
    assert summaries["split"]["val_loss"] == summaries["straight"]["val_loss"]


def delayed_rank1_env(tmp_path):
    """The environment of a torchrun launch whose rank 1 starts 1.2 s after rank 0 (a sitecustomize on its path
    sleeps), as ranks on a busy machine or on several nodes do."""
    delay = tmp_path / "delay_rank1"
    delay.mkdir()
    (delay / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '1' and os.environ.get('TORCHELASTIC_RUN_ID'):\n"
        "    time.sleep(1.2)\n"
    )
    env = subprocess_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(delay), env["PYTHONPATH"]])
    return env


def test_torchrun_without_run_name_gives_every_rank_the_same_run_dir(tmp_path, corpus):
    """Each rank composes the config itself, and the default run_name was each process's start time: rank 1,
    started here 1.2 s after rank 0 (a sitecustomize on its path sleeps), wrote a run dir of its own (its .hydra/
    and train.log). The default is now torchrun's run id (a uuid under --standalone), the same on both ranks."""
    env = delayed_rank1_env(tmp_path)
    args = [
        *TINY,
        "data=textfiles",
        f"data.sources.0.paths=[{corpus}]",
        "trainer=ddp_cpu",
        "trainer.max_steps=2",
        "sample.max_new_tokens=0",
        "trainer.enable_progress_bar=false",
    ]
    launch = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py")]
    proc = subprocess.run([*launch, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "outputs" / "runs").iterdir())
    assert len(runs) == 1 and runs[0].startswith("torchrun-"), runs
    assert json.loads((tmp_path / "outputs" / "runs" / runs[0] / "summary.json").read_text())["steps"] == 2


def test_a_multirun_under_torchrun_writes_one_sweep_dir_and_resumes_in_it(tmp_path, corpus):
    """Each rank composes hydra.sweep.dir itself, and its default was each process's start time to the microsecond:
    every `torchrun ... train.py -m` wrote two sweep dirs, rank 1's holding only .hydra/ and train.log of each job.
    It is torchrun's run id now (as run_name's default). A re-run with resume=auto and no hydra.sweep.dir (a new
    id under --standalone) is refused as in a new timestamped sweep dir; with hydra.sweep.dir each job resumes."""
    env = delayed_rank1_env(tmp_path)
    args = [
        "-m",
        *TINY,
        "data=textfiles",
        f"data.sources.0.paths=[{corpus}]",
        "trainer=ddp_cpu",
        "trainer.val_check_interval=2",
        "sample.max_new_tokens=0",
        "optimizer.lr=1e-3,1e-2",
    ]
    launch = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py")]

    def torchrun(*extra):
        return subprocess.run(
            [*launch, *args, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )

    proc = torchrun("trainer.max_steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = sorted((tmp_path / "outputs" / "multiruns").iterdir())
    assert len(sweeps) == 1 and sweeps[0].name.startswith("torchrun-"), sweeps
    summaries = [json.loads((sweeps[0] / job / "summary.json").read_text()) for job in ("0", "1")]
    assert [s["steps"] for s in summaries] == [2, 2]

    refused = torchrun("trainer.max_steps=4", "resume=auto")
    assert refused.returncode != 0
    assert "resume=auto in a multirun needs hydra.sweep.dir=" in refused.stdout + refused.stderr
    # refused before Hydra wrote a sweep dir for the new id (it left one of .hydra/ and train.log files behind)
    assert sorted((tmp_path / "outputs" / "multiruns").iterdir()) == sweeps

    proc = torchrun("trainer.max_steps=4", "resume=auto", f"hydra.sweep.dir={sweeps[0]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = [json.loads((sweeps[0] / job / "summary.json").read_text()) for job in ("0", "1")]
    assert [s["steps"] for s in summaries] == [4, 4]


def test_torchrun_workers_that_the_trainer_does_not_expect_are_refused(tmp_path, corpus):
    """`torchrun --nproc_per_node=2 train.py` without trainer.devices=2: each worker trained a single-process run of
    its own into the one run dir (last.ckpt and last-v1.ckpt), and torchrun exited 0. Every worker now stops before
    any compute, naming the setting, and nothing is written to the run dir's checkpoints."""
    args = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer.max_steps=2",
            "sample.max_new_tokens=0", "trainer.enable_progress_bar=false", "run_name=mismatch"]
    launch = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py")]
    proc = subprocess.run([*launch, *args], cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    # once: each worker printed it (before any process group; the workers share it through the agent's store)
    assert out.count("error: trainer.devices=1 starts 1 process(es) per node, but torchrun started "
                     "LOCAL_WORLD_SIZE=2 workers per node") == 1, out[-3000:]
    assert not list((tmp_path / "outputs" / "runs" / "mismatch").glob("checkpoints/*.ckpt"))


def test_a_rank_0_that_fails_to_save_the_final_checkpoint_is_named_by_rank_1(tmp_path, corpus):
    """Rank 0's disk full in the final last.ckpt (``trainer.save_checkpoint`` after fit) left rank 1's last line at
    gloo's 'RuntimeError: ... Connection closed by peer' under Hydra's traceback: the error was recorded only inside
    ``fit``, and only a failed collective inside it became a ``CollectiveError``. Rank 1 now names rank 0's error."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '0' and os.environ.get('TORCHELASTIC_RUN_ID'):\n"
        "    import lightning.pytorch as pl\n"
        "    from lightning.pytorch.trainer.states import TrainerStatus\n"
        "    _save = pl.Trainer.save_checkpoint\n"
        "    def save_checkpoint(self, *args, **kwargs):\n"
        "        if self.state.status == TrainerStatus.FINISHED:  # after fit: the final last.ckpt\n"
        "            raise OSError(28, 'No space left on device')\n"
        "        return _save(self, *args, **kwargs)\n"
        "    pl.Trainer.save_checkpoint = save_checkpoint\n"
    )
    env = subprocess_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(inject), env["PYTHONPATH"]])
    args = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer=ddp_cpu", "trainer.max_steps=2",
            "sample.max_new_tokens=0", "trainer.enable_progress_bar=false", "run_name=full"]
    proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: rank 1: rank 0 stopped at step 2: OSError: [Errno 28] No space left on device; this rank's next " \
           "collective then failed at step 2 (" in out, out[-4000:]


def test_a_sweep_job_refused_on_every_rank_before_the_group_is_reported_once(tmp_path, corpus):
    """A DDP sweep job refused alike on every rank is reported by rank 0 alone, through the process group's store;
    job 0, refused before any fit made the group, was still reported by both torchrun workers: 'job 0 failed: ...'
    twice on the console and Hydra's four lines of it twice. The agent's store serves before the group, as for a
    run's last line."""
    args = ["-m", *TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer=ddp_cpu",
            "trainer.val_check_interval=2", "sample.max_new_tokens=0", "trainer.max_steps=-5,2"]
    proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert_refused_once(proc, 0, "trainer.max_steps must be a positive step budget, got -5")
    sweep = next((tmp_path / "outputs" / "multiruns").iterdir())
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 2  # the next job ran on both ranks
