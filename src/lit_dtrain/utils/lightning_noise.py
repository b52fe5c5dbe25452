"""Silence the messages that every Lightning run prints and a user cannot act on (:func:`quiet_lightning_noise`)."""

from __future__ import annotations

import logging
import warnings


class _DropLightningTips(logging.Filter):
    """Drop Lightning's '💡 Tip: ... try installing litlogger/litmodels' adverts (printed on every run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning_noise() -> None:
    """Silence messages every run prints that a user cannot act on (idempotent).

    - Lightning's litlogger / litmodels adverts;
    - torch's FutureWarning about ``LeafSpec``, raised inside Lightning's own ``_pytree`` helper;
    - Lightning's "use sync_dist=True" hint for ``val/*``: LitLLM logs values of torchmetrics metrics, whose
      ``compute()`` has already reduced them over the ranks;
    - ModelCheckpoint's "Checkpoint directory ... exists and is not empty", printed by every resume: ``train(cfg)``
      refuses a fresh run in a dir that holds checkpoints, so the ones there are the run's own.
    - ModelCheckpoint's "The dirpath has changed from <the checkpoint's run> to <this run>, therefore
      `best_model_score` ... won't be reloaded", printed by each rank of a decay branch or a ``ckpt_path`` of another
      run: a new run dir is what they ask for (a moved run dir keeps its state: ``moved_dirpath_state``).
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())
    leafspec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leafspec, category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty\.")
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from .* won't be reloaded")
