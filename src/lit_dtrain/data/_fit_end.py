"""The check that a fit on :class:`~lit_dtrain.data.LMDataModule` ends: its training stream is endless."""

from __future__ import annotations

from lightning.pytorch.callbacks import Timer

from lit_dtrain.errors import ConfigError


def check_the_fit_ends(trainer) -> None:
    """Refuse a Trainer whose fit would never end. The datamodule's step tickets are endless, so an epoch never ends:
    a ``Trainer(max_epochs=1)`` (or Lightning's default) without ``max_steps`` trained on forever, without a word. A
    fit ends with ``max_steps``, ``max_time``, an int ``limit_train_batches`` (an epoch of that many batches) or a
    callback's stop, which ``max_epochs=-1`` asks for (train until a callback stops the fit)."""
    if trainer is None or trainer.max_steps not in (-1, None) or trainer.max_epochs == -1:
        return
    limit = trainer.limit_train_batches
    if isinstance(limit, int) and not isinstance(limit, bool):
        return
    if any(isinstance(c, Timer) for c in trainer.callbacks):  # Trainer(max_time=...)
        return
    raise ConfigError(
        f"LMDataModule draws training batches by step, so an epoch never ends, and this Trainer (max_steps=-1, "
        f"max_epochs={trainer.max_epochs}) would train forever: give Trainer(max_steps=N) (or max_time=..., or "
        "max_epochs=-1 to train until a callback stops the fit)"
    )
