"""OmegaConf resolvers used by conf/ (registered when lit_dtrain is imported).

``${lit.warmup:${trainer.max_steps}}`` is the default warmup: 100 steps, or a tenth of a shorter run,
so that ``python train.py trainer.max_steps=10`` works without also setting the warmup.

``${lit.required:"message"}`` marks a key that a config needs from the command line (an experiment cannot
mark it ``???``: a missing value does not override the root's default in a merge). Reading the key raises
:class:`RequiredValueError` with the message until an override replaces it.
"""

from __future__ import annotations

from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError


class RequiredValueError(InterpolationResolutionError, ValueError):
    """A key marked ``${lit.required:...}`` was read without a value given for it; the message says which."""


def required(message: str) -> None:
    raise RequiredValueError(message)


def default_warmup(max_steps: int, cap: int = 100, fraction: float = 0.1) -> int:
    """min(cap, max(1, int(fraction * max_steps)))."""
    return min(int(cap), max(1, int(float(fraction) * int(max_steps))))


def register() -> None:
    if not OmegaConf.has_resolver("lit.warmup"):
        OmegaConf.register_new_resolver("lit.warmup", default_warmup)
    if not OmegaConf.has_resolver("lit.required"):
        OmegaConf.register_new_resolver("lit.required", required)


register()
