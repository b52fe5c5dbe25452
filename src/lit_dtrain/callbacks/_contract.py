"""The step-output contract between a LightningModule and the callbacks that read its outputs.

A module declares what ``training_step`` returns in ``step_output_keys`` (``LitLLM`` returns
``("loss", "token_loss", "index")``); a callback declares what it reads in ``required_step_outputs``.
:func:`check_step_outputs` compares them before any compute, so a mismatch is a config error that
names the callback and the key, not a crash at step 1. Modules that do not declare their keys are
checked by each callback at its first ``on_train_batch_end`` instead. A callback that reads step outputs calls
:func:`check_step_outputs` on itself in ``setup``, so the early check also holds outside lit_dtrain's ``train()``.
"""

from __future__ import annotations

from collections.abc import Iterable

OUTPUT_KEYS = {
    "loss": "the scalar loss",
    "token_loss": "the per-token loss [B, T], detached (e.g. cross_entropy(..., reduction='none'))",
    "index": "the batch's sample indices [B], passed through (LMDataModule batches carry them as 'index')",
}
"""What each step-output key a callback may read holds, for the error messages."""


def _how(missing: Iterable[str]) -> str:
    described = ", ".join(f"{key!r}: {OUTPUT_KEYS.get(key, 'see the callback')}" for key in missing)
    return f"return a dict with 'loss' and {described}"


class StepOutputError(KeyError):
    """A callback needs a key that the module's ``training_step`` does not return."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def check_step_outputs(callbacks: Iterable, pl_module) -> None:
    """Raise :class:`StepOutputError` if a callback requires a key the module does not return."""
    provided = getattr(pl_module, "step_output_keys", None)
    if provided is None:
        return
    for cb in callbacks:
        missing = [k for k in getattr(cb, "required_step_outputs", ()) if k not in provided]
        if missing:
            raise StepOutputError(
                f"{type(cb).__name__} needs training_step to return {missing}, but "
                f"{type(pl_module).__name__}.training_step returns only {list(provided)} (its step_output_keys); "
                f"{_how(missing)}"
            )


def require_outputs(callback, outputs, keys: Iterable[str]) -> None:
    """Runtime check of one step's ``outputs`` (for modules that do not declare ``step_output_keys``)."""
    if not isinstance(outputs, dict):
        raise StepOutputError(
            f"{type(callback).__name__} needs training_step to return a dict with {list(keys)}, got "
            f"{type(outputs).__name__}; {_how(keys)}"
        )
    missing = [k for k in keys if outputs.get(k) is None]
    if missing:
        raise StepOutputError(
            f"{type(callback).__name__} needs training_step to return {missing}; got keys {sorted(outputs)}; "
            f"{_how(missing)}"
        )
