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

import torch

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


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def require_token_losses(callback, outputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``outputs["token_loss"]`` ``[B, T]`` and ``outputs["index"]`` ``[B]`` (integers; a list is taken as a tensor),
    checked: a flattened ``[B*T]`` loss, a per-sample ``[B]`` one or a list index failed inside the sampler, with a
    message that named neither the callback nor the key (``'list' object has no attribute 'shape'``)."""
    token_loss, index = outputs["token_loss"], outputs["index"]
    if not isinstance(index, torch.Tensor):
        try:
            index = torch.as_tensor(index)
        except (TypeError, ValueError, RuntimeError):
            pass
    rows = token_loss.shape[0] if isinstance(token_loss, torch.Tensor) and token_loss.dim() == 2 else None
    wrong = []
    if rows is None:
        wrong.append(f"'token_loss' is a {_shape(token_loss)}, not {OUTPUT_KEYS['token_loss']}: keep the tokens' "
                     f"shape, e.g. cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction='none')"
                     f".view_as(labels)")
    is_int = isinstance(index, torch.Tensor) and not index.is_floating_point() and not index.is_complex()
    if not is_int or index.dim() != 1:
        wrong.append(f"'index' is a {_shape(index)}, not {OUTPUT_KEYS['index']}")
    elif rows is not None and index.shape[0] != rows:
        wrong.append(f"'index' holds {index.shape[0]} sample indices for the {rows} rows of 'token_loss' "
                     f"{tuple(token_loss.shape)}, which must be [B, T] (one row per sample)")
    if wrong:
        raise StepOutputError(f"{type(callback).__name__}: in what training_step returned, {'; '.join(wrong)}")
    return token_loss, index


def token_mask_of(callback, outputs, token_loss: torch.Tensor) -> torch.Tensor | None:
    """``outputs["token_mask"]`` (optional: true for a real token, false for padding), checked to be ``token_loss``'s
    shape."""
    mask = outputs.get("token_mask")
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(token_loss.shape):
        raise StepOutputError(f"{type(callback).__name__}: in what training_step returned, 'token_mask' is a "
                              f"{_shape(mask)}, not token_loss's shape {tuple(token_loss.shape)} (true: a real token, "
                              "false: padding), e.g. labels != -100")
    return mask.detach()
