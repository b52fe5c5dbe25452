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
