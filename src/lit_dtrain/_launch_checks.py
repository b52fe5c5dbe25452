"""The launch checks of a composed config (:mod:`lit_dtrain.config_checks` runs and re-exports them): the devices and
nodes a torchrun or multi-node launch gives against the config's, and torchrun restarts that cannot continue a run."""

from __future__ import annotations

import logging
import os

import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.launcher_watch import CLUSTER_LAUNCH_KEYS

log = logging.getLogger("lit_dtrain.config_checks")


def devices_per_node(cfg: DictConfig) -> int | None:
    """The processes per node that ``trainer.devices`` asks Lightning for (``auto`` on a CPU: 1); None where it
    cannot be told before Lightning looks at the accelerator. What an external launcher (srun, torchrun) must have
    started on each node."""
    devices = cfg.trainer.get("devices", "auto")
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        return int(devices)
    if not isinstance(devices, (int, str)):  # a list of device ids
        try:
            return len(devices)
        except TypeError:
            return None
    if str(devices).strip() in ("auto", "-1"):  # all devices of the accelerator: one CPU process
        accelerator = str(cfg.trainer.get("accelerator", "auto"))
        if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
            return 1
        if accelerator in ("gpu", "cuda", "auto"):
            return torch.cuda.device_count()
    return None


def check_torchrun_launch(cfg: DictConfig, env=os.environ) -> None:
    """Under torchrun (its workers have ``TORCHELASTIC_RUN_ID``), refuse a config whose processes per node or nodes
    differ from the workers torchrun started, before any compute. ``torchrun --nproc_per_node=2 train.py`` with the
    default ``trainer.devices`` (``auto``: one process on a CPU) trained 2 single-process runs into one run dir, both
    exiting 0 (``last.ckpt`` and ``last-v1.ckpt``): Lightning checks the world size only for a strategy of several
    processes. The nodes' count it checks itself, with a traceback; here it is one line."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if not (world.isdigit() and local.isdigit()) or int(world) <= 1 or int(local) < 1:
        return
    world, local = int(world), int(local)
    devices, num_nodes = devices_per_node(cfg), cfg.trainer.get("num_nodes", 1)
    fix = f"set trainer.devices={local} trainer.num_nodes={world // local}"
    if devices is not None and devices != local:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.get('devices')} starts {devices} process(es) per node, but torchrun "
            f"started LOCAL_WORLD_SIZE={local} workers per node: {fix} (on a CPU: trainer=ddp_cpu "
            f"trainer.devices={local}), or torchrun --nproc_per_node={devices}"
            + (" (each worker would train a run of its own, all in one run dir)" if devices < local else "")
        )
    if isinstance(num_nodes, int) and num_nodes * local != world:
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} x {local} workers per node = {num_nodes * local} processes, but torchrun's "
            f"WORLD_SIZE={world}: {fix}"
        )


def check_multinode_launch(cfg: DictConfig, env=os.environ) -> None:
    """``trainer.num_nodes`` above 1 without a cluster launcher means Lightning's own launch on every node, which
    reads the first node's address and this node's rank from ``MASTER_ADDR`` and ``NODE_RANK``. Without them
    ``python train.py trainer=ddp_cpu trainer.num_nodes=2`` waited for the other node's ranks on 127.0.0.1 until
    the collective timeout (30 min), every node taking itself for node 0; refused before any compute."""
    num_nodes = cfg.trainer.get("num_nodes", 1)
    if not isinstance(num_nodes, int) or num_nodes <= 1 or any(key in env for key in CLUSTER_LAUNCH_KEYS):
        return
    missing = [key for key in ("MASTER_ADDR", "NODE_RANK") if not str(env.get(key, "")).strip()]
    if missing:
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} without torchrun or srun: Lightning's own launch on each node reads the "
            f"first node's address and this node's rank from MASTER_ADDR and NODE_RANK, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set, so this process would wait for the other nodes on "
            "127.0.0.1 until the collective timeout. Launch with torchrun or srun, set MASTER_ADDR, MASTER_PORT and "
            "NODE_RANK on every node, or train on this node alone (trainer.num_nodes=1)"
        )


def warn_about_torchrun_restarts(cfg: DictConfig, env=os.environ) -> None:
    """Under ``torchrun --max-restarts N`` (N > 0), at the first start: warn when a restart cannot continue the run.
    A restarted worker runs the same command: without ``resume=auto`` it is a fresh start in a run dir that holds
    checkpoints, which is refused (and each refusal uses up a restart). On several nodes with the agent's shared
    store a restarted rank can read the failed attempt's addresses from it and fail to connect (pytorch#135712): there
    ``--rdzv-backend=c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a new store (static
    rendezvous, ``--master-port``, always shares it: the variable changes nothing there). On one node each attempt
    connects under keys of its own (:func:`lit_dtrain.strategies._connect.torchrun_attempt_store`): the warning here
    advised that variable for every gloo launch, and under ``--master-port`` every restart still failed in seconds."""
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if restarts <= 0 or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or rank_zero_only.rank != 0:
        return
    if cfg.get("resume") != "auto":
        log.warning("torchrun --max-restarts=%d: a restarted worker continues this run only with resume=auto; "
                    "without it the restart is a fresh start in a run dir that holds checkpoints, which is refused",
                    restarts)
    nodes = env.get("GROUP_WORLD_SIZE", "1")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and nodes != "1":
        log.warning("torchrun --max-restarts=%d on %s nodes with torchrun's shared store: a restarted rank can read "
                    "the failed attempt's addresses from it and fail to connect (pytorch#135712); launch with "
                    "--rdzv-backend=c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (static "
                    "rendezvous, --master-port or --rdzv-endpoint without --rdzv-backend, always shares it)",
                    restarts, nodes)
