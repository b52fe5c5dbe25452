"""Behaviours that README.md and docs/*.md state in prose and that no other test pins."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch
import yaml

from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM, NonFiniteError
from tests.conftest import ROOT


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


def _yaml_defaults():
    """(file, target, key, value) of every literal key of a lit_dtrain ``_target_`` in conf/callbacks/ and
    conf/data/sampler/ (interpolations such as ``${paths.checkpoint_dir}`` left out)."""
    out = []
    conf = ROOT / "conf"
    for path in sorted([*(conf / "callbacks").glob("*.yaml"), *(conf / "data" / "sampler").glob("*.yaml")]):
        doc = yaml.safe_load(path.read_text()) or {}
        for node in [doc] if "_target_" in doc else doc.values():
            if not isinstance(node, dict) or not str(node.get("_target_", "")).startswith("lit_dtrain."):
                continue
            for key, value in node.items():
                if not key.startswith("_") and not (isinstance(value, str) and "${" in value):
                    out.append((path.name, node["_target_"], key, value))
    return out


def test_the_config_defaults_the_docs_state_are_the_classes_defaults_too():
    """The docs state each callback's and sampler's defaults once (docs/loss_spikes.md: "`z_threshold` (6)",
    "`warmup_steps` (25)"; docs/fourier_sampler.md's key table), for ``train.py`` and for another Lightning project
    alike (``LossSpikeMonitor()``, ``FourierSampler()``): the YAML value of every key is the constructor's
    default."""
    rows = _yaml_defaults()
    assert len(rows) > 60
    differ = []
    for file, target, key, value in rows:
        module, _, name = target.rpartition(".")
        target_obj = getattr(importlib.import_module(module), name)
        if not (target_obj.__init__ if inspect.isclass(target_obj) else target_obj).__module__.startswith("lit_dtrain"):
            continue  # Lightning's constructor (lit_dtrain.callbacks.ModelCheckpoint): its defaults are Lightning's
        parameters = inspect.signature(target_obj).parameters
        if key not in parameters:  # passed through **kwargs (OncePerStepLRMonitor's logging_interval)
            continue
        default = parameters[key].default
        default = list(default) if isinstance(default, tuple) else default
        if default is inspect.Parameter.empty or default != value:
            differ.append(f"{file}: {name}({key}=...): yaml {value!r}, class default {default!r}")
    assert differ == []

