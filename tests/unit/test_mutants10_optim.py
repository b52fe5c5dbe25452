"""Exact results of the optimizer factories (``optim/__init__.py``) where single-point mutants passed
test_mutants8_optim.py, test_tensor_lr.py, test_module_optimizer.py and test_configs_bad_values.py (tenth hand mutation
audit)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.optim import adamw, adamw8bit


@pytest.mark.parametrize("factory", [adamw, adamw8bit])
@pytest.mark.parametrize("lr", [0.0, -1e-3, float("nan")])
def test_a_factory_called_directly_refuses_an_lr_that_is_not_positive(factory, lr):
    """The config check refuses ``optimizer.lr <= 0`` before a Hydra run builds the optimizer, but a project that
    calls the factory itself has only this check: ``lr=0`` trains nothing and ``lr=nan`` turns every weight NaN at
    the first step. Both are refused (``not lr > 0``; an ``lr < 0`` test let 0 and NaN through), before bitsandbytes
    is imported."""
    with pytest.raises(ValueError, match=r"optimizer\.lr must be > 0, got (0\.0|-0\.001|nan)$"):
        factory([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    assert adamw([torch.nn.Parameter(torch.zeros(2))], lr=1e-12).defaults["lr"] == 1e-12


def test_a_complex_parameter_makes_adamw_foreach_which_steps_it():
    """``fused=None`` asks every parameter to be a floating tensor on CPU/CUDA: a complex one is not (torch's fused
    AdamW is built with it but refuses it at the first ``step``: '`fused=True` requires all the params to be floating
    point Tensors'). Foreach steps it: from 0 with gradient 1+0j, AdamW's first step is ``-lr`` (the bias-corrected
    ``m / sqrt(v)`` is 1)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    opt = adamw([torch.nn.Parameter(torch.zeros(2)), p], lr=1e-3)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    p.grad = torch.ones(2, dtype=torch.complex64)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((2,), -1e-3, dtype=torch.complex64), rtol=0, atol=1e-9)
