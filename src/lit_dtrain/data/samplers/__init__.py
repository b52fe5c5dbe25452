"""Samplers of training windows: a pure function of (seed, step, sampler state)."""

from typing import TYPE_CHECKING

from lit_dtrain.data.samplers.base import IndexSampler, RandomSampler, step_generator

if TYPE_CHECKING:  # what type checkers and IDEs read (they never call __getattr__)
    from lit_dtrain.data.samplers.fourier import FourierSampler as FourierSampler

# FourierSampler is resolved lazily (the spectral sampler is optional), but it is public: ``import *`` and ``dir()``
# list it too
__all__ = ["FourierSampler", "IndexSampler", "RandomSampler", "step_generator"]


def __getattr__(name: str):
    if name == "FourierSampler":  # lazy: the spectral sampler is optional
        from lit_dtrain.data.samplers.fourier import FourierSampler

        return FourierSampler
    raise AttributeError(f"module 'lit_dtrain.data.samplers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
