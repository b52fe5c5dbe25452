"""lit_dtrain's training techniques as Lightning callbacks, one file per technique.

Import them into any Lightning project: ``from lit_dtrain.callbacks import LossSpikeMonitor``.
Names are resolved lazily so that importing one callback does not import every technique.
"""

from __future__ import annotations

import importlib

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
