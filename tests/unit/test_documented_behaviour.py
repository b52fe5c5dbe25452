"""Behaviours that README.md and docs/*.md state in prose and that no other test pins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM, NonFiniteError


def _module_with_nan_grads(scaler) -> tuple[LitLLM, torch.optim.Optimizer]:
    module = LitLLM(build_llama(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=8))
    for p in module.parameters():
        p.grad = torch.full_like(p, float("nan"))
    module._trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler), global_step=3,
                                      callback_metrics={})
    return module, torch.optim.SGD(module.parameters(), lr=0.1)


def test_the_non_finite_stop_stands_aside_for_a_grad_scaler():
    """docs/loss_spikes.md, "Limitations and notes": under 16-mixed an fp16 overflow is the GradScaler's to skip,
    so ``module.check_finite`` does not stop the run on it (the doc said it would, an outdated note); without a
    scaler the same gradients stop it before the optimizer step (docs/reliability.md row 8)."""
    module, optimizer = _module_with_nan_grads(scaler=object())
    module.on_before_optimizer_step(optimizer)  # no error: the scaler skips the step
    module, optimizer = _module_with_nan_grads(scaler=None)
    with pytest.raises(NonFiniteError, match="non-finite gradients at step 3"):
        module.on_before_optimizer_step(optimizer)
