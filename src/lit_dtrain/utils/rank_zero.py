"""Per-run facts are logged by rank 0 alone: every rank of a DDP run (re-launched by Lightning, or under torchrun
or srun) reaches the same finding (the checkpoint resume=auto chose, a corpus's val split, a stop after the last
step) and each printed the same line. Each rank still does its own checks; only the printing is rank 0's."""

from __future__ import annotations

import logging


def log_once(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """``logger.log(level, msg, *args)`` on rank 0 only (``rank_zero_only.rank``, which Lightning sets from the
    launcher's rank variables when it is imported). Imported here, not at the top: the pure schedule functions
    (``lit_dtrain.schedules.lr``) use it and stay importable without Lightning's import time."""
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:
        logger.log(level, msg, *args)


def rank_labelled(message: str, world_size: int) -> str:
    """``message`` with Lightning's ``[rank: N]`` prefix (N: this process's global rank, ``rank_zero_only.rank``) in a
    run of several processes, as Lightning's own per-process lines in ``train.log`` have it (``[rank: 1] Seed set to
    ...``); unchanged in a single process. For a line each process prints about itself: under torchrun the workers
    share one ``train.log``, where two unlabelled lines did not say whose they were."""
    from lightning.fabric.utilities.rank_zero import rank_prefixed_message
    from lightning.pytorch.utilities import rank_zero_only

    return rank_prefixed_message(message, rank_zero_only.rank if world_size > 1 else None)


def launched_world_size() -> int:
    """The number of processes of this run, where no Trainer says it (a Ctrl-C during start-up, before the process
    group exists): the group's size, else the launcher's ``WORLD_SIZE`` (torchrun, srun's Lightning environment,
    Lightning's own launcher for the ranks it starts), else 1."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1
