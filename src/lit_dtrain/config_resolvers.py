"""OmegaConf resolvers used by conf/ (registered when lit_dtrain is imported).

``${lit.warmup:${trainer.max_steps}}`` is the default warmup: 100 steps, or a tenth of a shorter run,
so that ``python train.py trainer.max_steps=10`` works without also setting the warmup.
"""

from __future__ import annotations

from omegaconf import OmegaConf


def default_warmup(max_steps: int, cap: int = 100, fraction: float = 0.1) -> int:
    """min(cap, max(1, int(fraction * max_steps)))."""
    return min(int(cap), max(1, int(float(fraction) * int(max_steps))))


def register() -> None:
    if not OmegaConf.has_resolver("lit.warmup"):
        OmegaConf.register_new_resolver("lit.warmup", default_warmup)


register()
