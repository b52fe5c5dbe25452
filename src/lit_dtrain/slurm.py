"""Launching under Slurm's ``srun``: checks of the launch before any compute, and Slurm's requeue signal.

Under ``srun`` every task runs ``train.py`` itself, and Lightning's ``SLURMEnvironment`` takes the world size from
``SLURM_NTASKS`` and the ranks from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``.

- :func:`check_slurm_launch` refuses, in one line naming the variables and the fix, a launch that would train with a
  wrong world size or hang (each was found by starting 2 tasks with srun's environment, ``tests/e2e/test_slurm.py``):
  ``trainer.devices=1`` (or ``auto`` on the CPU) with 2 tasks per node trained 2 single-process runs that both
  wrote the same run dir (Lightning checks the tasks per node only for a strategy of several processes);
  ``python train.py`` without ``srun`` in a batch script of 2 tasks waited for the missing rank until the collective
  timeout (30 min); ``SLURM_JOB_NAME=bash`` (Lightning's switch to ignore Slurm, for interactive jobs) with 2
  tasks made each task launch its own DDP ranks: 4 processes, two runs racing in one run dir. Lightning's own errors
  for tasks per node or nodes that differ from ``trainer.devices``/``trainer.num_nodes`` came with a traceback, a
  missing ``SLURM_PROCID`` as ``KeyError('SLURM_PROCID')`` in Hydra's form.
- :func:`slurm_plugins` gives the Trainer Lightning's ``SLURMEnvironment`` without its auto-requeue, and
  :func:`catch_requeue_signal` (from the start of ``train()``) makes the requeue signal (``SIGUSR1``,
  ``sbatch --signal=USR1@90``) requeue the job without a checkpoint of its own.
  Lightning's auto-requeue saved ``hpc_ckpt_<n>.ckpt`` in the run dir from inside the signal handler (a collective
  save there, as its SIGTERM handler's broadcast was), and then loaded it in place of what ``train()`` asked for:
  the final validation, called without a checkpoint, validated the weights of the moment of the signal (a 300-step
  run reported val_loss 3.0733, the weights it ended with 2.9760), and a fresh start in that run dir resumed from it
  unannounced. Now rank 0 runs ``scontrol requeue <job>`` (Lightning's command), and Slurm then stops the job with
  SIGTERM, which ``PreemptionCheckpoint`` turns into ``last.ckpt`` and exit status 143; the requeued job continues
  with ``resume=auto``; a command without it is not requeued (run again it would not continue the run). A run dir that
  holds such a file (written before) is refused under Slurm
  (:func:`check_no_hpc_checkpoint`): Lightning would still load it there.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, OmegaConf

from lit_dtrain._launch_checks import devices_per_node
from lit_dtrain.errors import ConfigError

log = logging.getLogger(__name__)

_IGNORED_JOB_NAMES = ("bash", "interactive")  # Lightning ignores Slurm in a job of this name (interactive use)
_RANK_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")  # what SLURMEnvironment reads for the ranks


def _number(env, key: str) -> int | None:
    value = str(env.get(key, "")).strip()
    return int(value) if value.isdigit() else None


def check_no_hpc_checkpoint(cfg: DictConfig, env=os.environ) -> None:
    """Refuse a run dir holding ``hpc_ckpt_<n>.ckpt`` (Lightning's auto-requeue checkpoint) under Slurm: there
    Lightning loads the newest one in every ``fit`` and ``validate`` that ``train()`` calls without a checkpoint,
    in place of the fresh start or the trained weights."""
    if "SLURM_NTASKS" not in env or env.get("SLURM_JOB_NAME") in _IGNORED_JOB_NAMES:  # Lightning's Slurm detection
        return
    root = OmegaConf.select(cfg, "trainer.default_root_dir", default=None)
    found = sorted(p.name for p in Path(str(root)).glob("hpc_ckpt_*.ckpt")) if root else []
    if found:
        raise ConfigError(
            f"run dir {str(root)!r} holds {', '.join(found)}, written by Lightning's SLURM auto-requeue: under Slurm "
            "Lightning loads the newest in place of a fresh start and of the weights the final validation is "
            "asked for. Move it out of the run dir (resume=auto continues from checkpoints/; ckpt_path=<its new "
            "path> resumes from it)"
        )


def check_slurm_launch(cfg: DictConfig, env=os.environ) -> None:
    """Refuse a launch under Slurm whose processes Lightning would not form into one run of the right size, or
    whose run dir holds a checkpoint Lightning would load unasked (:func:`check_no_hpc_checkpoint`)."""
    check_no_hpc_checkpoint(cfg, env)
    if "SLURM_NTASKS" not in env or "TORCHELASTIC_RUN_ID" in env:  # torchrun's workers: it started them
        return
    ntasks, step_tasks = _number(env, "SLURM_NTASKS"), _number(env, "SLURM_STEP_NUM_TASKS")
    job_name = env.get("SLURM_JOB_NAME")
    if job_name in _IGNORED_JOB_NAMES:
        if step_tasks is not None and step_tasks > 1:
            raise ConfigError(
                f"srun started {step_tasks} tasks (SLURM_STEP_NUM_TASKS), but SLURM_JOB_NAME={job_name!r} makes "
                f"Lightning ignore Slurm (its switch for interactive jobs): each task would launch trainer.devices "
                f"processes of its own, {step_tasks} runs in one run dir. Name the job otherwise (srun --job-name=...) "
                "to train on the tasks, or start one task (srun --ntasks=1) and let Lightning launch the devices"
            )
        return
    if ntasks is None or ntasks <= 1:
        return
    if step_tasks != ntasks:
        started = (
            "this process was not started by srun (no SLURM_STEP_NUM_TASKS: `python train.py` in a batch script?)"
            if step_tasks is None
            else f"srun started SLURM_STEP_NUM_TASKS={step_tasks} tasks"
        )
        raise ConfigError(
            f"Lightning takes the world size from SLURM_NTASKS={ntasks}, but {started}: rank 0 would wait for the "
            "missing ranks until the collective timeout. Start one train.py per device with srun "
            "(srun --ntasks-per-node=<devices> python train.py ...)"
        )
    missing = [key for key in _RANK_VARIABLES if _number(env, key) is None]
    if missing:
        raise ConfigError(
            f"SLURM_NTASKS={ntasks}, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set to a "
            f"number: Lightning reads each task's ranks from {', '.join(_RANK_VARIABLES)} (srun sets them all; was the "
            "environment replaced?)"
        )
    per_node, nnodes = _number(env, "SLURM_NTASKS_PER_NODE"), _number(env, "SLURM_NNODES")
    if "SLURM_NTASKS_PER_NODE" not in env:
        raise ConfigError(
            f"srun started {ntasks} tasks without --ntasks-per-node (SLURM_NTASKS_PER_NODE is not set), which "
            "Lightning needs to check the tasks of each node against trainer.devices: launch with "
            f"srun --ntasks-per-node=<devices per node> (on one node: --ntasks-per-node={ntasks})"
        )
    devices, num_nodes = devices_per_node(cfg), cfg.trainer.get("num_nodes", 1)
    fix = (
        f"set trainer.devices={per_node} trainer.num_nodes={nnodes}"
        if per_node is not None and nnodes is not None
        else "set trainer.devices to the tasks per node and trainer.num_nodes to the nodes"
    )
    if per_node is not None and devices is not None and devices != per_node:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.get('devices')} starts {devices} process(es) per node, but srun started "
            f"SLURM_NTASKS_PER_NODE={per_node}: {fix}, or srun --ntasks-per-node={devices}"
            + (" (each task would train a run of its own, all in one run dir)" if devices < per_node else "")
        )
    if nnodes is not None and isinstance(num_nodes, int) and num_nodes != nnodes:
        raise ConfigError(f"trainer.num_nodes={num_nodes}, but srun runs on SLURM_NNODES={nnodes} nodes: {fix}")
    if devices is not None and isinstance(num_nodes, int) and devices * num_nodes != ntasks:
        raise ConfigError(
            f"trainer.devices={devices} x trainer.num_nodes={num_nodes} = {devices * num_nodes} processes, but srun "
            f"started SLURM_NTASKS={ntasks} tasks: {fix}"
        )


def warn_about_a_requeued_fresh_start(cfg: DictConfig, ckpt_path: str | None, env=os.environ) -> None:
    """Rank 0 of a job Slurm requeued (``SLURM_RESTART_COUNT`` >= 1: preempted with ``PreemptMode=REQUEUE``, a node
    failure under ``--requeue``, ``scontrol requeue``) that starts fresh without ``resume=auto``: a warning. The
    requeued job runs the same command, and with the default ``run_name`` (a new timestamp) it trained again from step
    0 in a new run dir without a word; the interrupted start's ``last.ckpt`` sat unused in its own run dir."""
    restarts = _number(env, "SLURM_RESTART_COUNT")
    if not restarts or "SLURM_NTASKS" not in env or env.get("SLURM_PROCID", "0") != "0":
        return
    if ckpt_path or cfg.get("resume") == "auto":
        return
    log.warning(
        "SLURM_RESTART_COUNT=%d: Slurm requeued this job, but the command has no resume=auto, so this start trains "
        "from step 0 in run dir %s; the interrupted start's checkpoints stay in its own run dir. To continue a run "
        "when the job is requeued, give resume=auto run_name=<name> in the batch script", restarts,
        OmegaConf.select(cfg, "paths.output_dir", default=None) or cfg.get("run_name"))


def requeue_job(env=os.environ) -> None:
    """Rank 0: ``scontrol requeue <job>`` (a job array's task: ``<array job>_<task>``), as Lightning's auto-requeue
    runs it; its failure is logged, and the run trains on."""
    if env.get("SLURM_PROCID", "0") != "0":
        return
    array_job = env.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{env.get('SLURM_ARRAY_TASK_ID')}" if array_job else env.get("SLURM_JOB_ID", "")
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        status, detail = result.returncode, (result.stderr or result.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        status, detail = None, f"{type(e).__name__}: {e}"
    if status == 0:
        log.warning("Slurm's requeue signal: requeued job %s; Slurm stops it with SIGTERM (a checkpoint, exit "
                    "status 143) and the requeued job continues with resume=auto", job)
    else:
        log.warning("Slurm's requeue signal: `scontrol requeue %s` failed (%s); the job is not requeued and trains "
                    "on", job, detail or f"exit status {status}")


# whether the requeued job, which runs the same command again, continues this run (set by train(): resume=auto)
_requeue_continues = True


def _on_requeue_signal(signum, frame) -> None:
    if _requeue_continues:
        requeue_job()
    elif os.environ.get("SLURM_PROCID", "0") == "0":
        log.warning("Slurm's requeue signal: the job is not requeued, since this command has no resume=auto: run "
                    "again it would not continue this run (from step 0 in a new run dir, or refused in this one). It "
                    "trains on until Slurm stops it with SIGTERM (last.ckpt); add resume=auto (and run_name=<name>) "
                    "to the batch script's command to have it requeued")


def _slurm_environment() -> SLURMEnvironment | None:
    """Under srun (as Lightning detects it), ``SLURMEnvironment(auto_requeue=False)``; else None, also for torchrun's
    workers inside an srun step, whose environment Lightning prefers to Slurm's."""
    if not SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return None
    return SLURMEnvironment(auto_requeue=False)


def catch_requeue_signal(continues: bool | None = None) -> None:
    """Under srun, have Slurm's requeue signal (``SIGUSR1``) run :func:`requeue_job` from now on; ``train()`` calls
    it first, with ``continues``: whether the command, run again by the requeued job, continues this run
    (``resume=auto``). Where it does not, the signal requeues nothing and says why: a requeued job without
    ``resume=auto`` and with the default ``run_name`` trained again from step 0 in a new run dir, without a word
    (with a ``run_name`` it was refused, a fresh start in a run dir holding checkpoints). None keeps the setting.
    Registered only with the Trainer (:func:`slurm_plugins`) it came too late for a signal during the
    config checks, the model's build or a checkpoint's checks: Python's default action for ``SIGUSR1`` ended the
    process (exit status 138) and the job was not requeued. Before training nothing is lost: Slurm's SIGTERM after
    the requeue stops the process, and the requeued job starts again."""
    global _requeue_continues
    if continues is not None:
        _requeue_continues = continues
    environment = _slurm_environment()
    if environment is not None and environment.requeue_signal is not None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(environment.requeue_signal, _on_requeue_signal)


def slurm_plugins() -> list:
    """Under srun: ``[SLURMEnvironment(auto_requeue=False)]``, with the requeue signal (``SIGUSR1``) handled by
    :func:`requeue_job` (:func:`catch_requeue_signal`); else ``[]``, also for torchrun's workers inside an srun step
    (a ``SLURMEnvironment`` given there took the step's one task for the world of every worker). For
    ``Trainer(plugins=...)``."""
    environment = _slurm_environment()
    if environment is None:
        return []
    catch_requeue_signal()
    return [environment]
