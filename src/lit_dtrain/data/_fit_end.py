"""The check that a fit on :class:`~lit_dtrain.data.LMDataModule` ends: its training stream is endless."""

from __future__ import annotations

from lightning.pytorch.callbacks import Timer

from lit_dtrain.errors import ConfigError


def check_the_fit_ends(trainer) -> None:
    """Refuse a Trainer whose fit would never end. The datamodule's step tickets are endless, so an epoch never ends:
    a ``Trainer(max_epochs=1)`` (or Lightning's default) without ``max_steps`` trained on forever, without a word. A
    fit ends with ``max_steps``, ``max_time``, an int ``limit_train_batches`` (an epoch of that many batches) or a
    callback's stop, which ``max_epochs=-1`` asks for (train until a callback stops the fit)."""
    if trainer is None:
        return
    limit = trainer.limit_train_batches
    finite = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    if trainer.fit_loop.min_epochs == 1 and trainer.min_steps is not None and min_epochs_problem(
            1, trainer.max_epochs, trainer.max_steps, finite, trainer.accumulate_grad_batches):
        # Lightning sets min_epochs=1 where only min_steps is given (0 too: loops/utilities.py's _parse_loop_limits),
        # and an epoch of this stream never ends: '+trainer.min_steps=2' with max_time 10 s trained to max_steps (and
        # the check below refused it as min_epochs=1); so did an epoch of more steps than max_steps
        # ('+trainer.min_steps=2 +trainer.limit_train_batches=100 trainer.max_steps=4'). min_steps alone is what was
        # asked: the stop waits for it only (an epoch that can end within max_steps keeps Lightning's 1).
        trainer.fit_loop.min_epochs = 0
    if problem := min_epochs_problem(trainer.fit_loop.min_epochs, trainer.max_epochs, trainer.max_steps, finite,
                                     trainer.accumulate_grad_batches):
        raise ConfigError(problem)
    if trainer.max_steps not in (-1, None) or trainer.max_epochs == -1:
        return
    if finite is not None:
        return
    if any(isinstance(c, Timer) for c in trainer.callbacks):  # Trainer(max_time=...)
        return
    raise ConfigError(
        f"LMDataModule draws training batches by step, so an epoch never ends, and this Trainer (max_steps=-1, "
        f"max_epochs={trainer.max_epochs}) would train forever: give Trainer(max_steps=N) (or max_time=..., or "
        "max_epochs=-1 to train until a callback stops the fit)"
    )


def min_epochs_problem(min_epochs, max_epochs, max_steps, batches_per_epoch, accumulate: int = 1,
                       prefix: str = "") -> str | None:
    """Why ``min_epochs`` cannot be met with :class:`~lit_dtrain.data.LMDataModule`'s stream, or None. Lightning lets
    no stop (``EarlyStopping``, ``max_time``, ``trainer.should_stop``) end a fit before ``min_epochs`` epochs, and
    checks no bound: with the endless stream an epoch never ends, so ``min_epochs=1`` and ``max_time`` 10 s trained on
    past 51 s (to ``max_steps``). ``batches_per_epoch``: an int ``limit_train_batches`` (``overfit_batches`` sets it),
    else None (endless); ``prefix``: ``"trainer."`` for the config's names."""
    if not isinstance(min_epochs, int) or isinstance(min_epochs, bool) or min_epochs <= 0:
        return None
    p = prefix
    if isinstance(max_epochs, int) and max_epochs >= 0 and min_epochs > max_epochs:
        return (f"{p}min_epochs={min_epochs} exceeds {p}max_epochs={max_epochs}: the run stops at max_epochs; lower "
                f"{p}min_epochs or raise {p}max_epochs")
    if batches_per_epoch is None:
        return (f"{p}min_epochs={min_epochs} can never be met: LMDataModule draws training batches by step, so an "
                f"epoch never ends, and no stop (EarlyStopping, max_time) could end the run before max_steps; use "
                f"{p}min_steps=N (optimizer steps before a stop may end the run), or {p}limit_train_batches=N for "
                "epochs of N batches")
    steps = min_epochs * -(-batches_per_epoch // max(accumulate, 1))  # a step at each epoch's last batch
    if isinstance(max_steps, int) and max_steps >= 0 and steps > max_steps:
        return (f"{p}min_epochs={min_epochs} of {batches_per_epoch} batches each is {steps} optimizer steps, past "
                f"{p}max_steps={max_steps}: the run stops at max_steps; lower {p}min_epochs or raise {p}max_steps")
    return None
