"""lit_dtrain's training techniques as Lightning callbacks, one file per technique.

Import them into any Lightning project: ``from lit_dtrain.callbacks import LossSpikeMonitor``.
Names are resolved lazily so that importing one callback does not import every technique.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and IDEs read (they never call __getattr__): the names of _EXPORTS
    from lit_dtrain.callbacks.adaptive_grad_clip import AdaptiveGradClip as AdaptiveGradClip
    from lit_dtrain.callbacks.fourier_sampler import FourierSamplerCallback as FourierSamplerCallback
    from lit_dtrain.callbacks.loss_spike import LossSpikeMonitor as LossSpikeMonitor
    from lit_dtrain.callbacks.lr_monitor import OncePerStepLRMonitor as OncePerStepLRMonitor
    from lit_dtrain.callbacks.memory_monitor import MemoryMonitor as MemoryMonitor
    from lit_dtrain.callbacks.model_checkpoint import ModelCheckpoint as ModelCheckpoint
    from lit_dtrain.callbacks.optimizer_diagnostics import OptimizerDiagnostics as OptimizerDiagnostics
    from lit_dtrain.callbacks.preemption import PreemptionCheckpoint as PreemptionCheckpoint
    from lit_dtrain.callbacks.selective_checkpointing import SelectiveCheckpointing as SelectiveCheckpointing
    from lit_dtrain.callbacks.step_end_timer import StepEndTimer as StepEndTimer
    from lit_dtrain.callbacks.throughput import token_throughput_monitor as token_throughput_monitor
    from lit_dtrain.callbacks.wsd import WSDScheduler as WSDScheduler

_EXPORTS = {
    "LossSpikeMonitor": "lit_dtrain.callbacks.loss_spike",
    "AdaptiveGradClip": "lit_dtrain.callbacks.adaptive_grad_clip",
    "OptimizerDiagnostics": "lit_dtrain.callbacks.optimizer_diagnostics",
    "WSDScheduler": "lit_dtrain.callbacks.wsd",
    "SelectiveCheckpointing": "lit_dtrain.callbacks.selective_checkpointing",
    "FourierSamplerCallback": "lit_dtrain.callbacks.fourier_sampler",
    "token_throughput_monitor": "lit_dtrain.callbacks.throughput",
    "PreemptionCheckpoint": "lit_dtrain.callbacks.preemption",
    "OncePerStepLRMonitor": "lit_dtrain.callbacks.lr_monitor",
    "ModelCheckpoint": "lit_dtrain.callbacks.model_checkpoint",
    "StepEndTimer": "lit_dtrain.callbacks.step_end_timer",
    "MemoryMonitor": "lit_dtrain.callbacks.memory_monitor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lit_dtrain.callbacks' has no attribute {name!r}; available: {__all__}")


def __dir__() -> list[str]:  # the lazy names too (tab completion, help())
    return sorted(set(globals()) | set(__all__))
