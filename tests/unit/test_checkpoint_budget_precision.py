"""The ``budget`` probe measures in the precision FSDP trains in (FSDP cannot run on CPU under Lightning: a trainer
stand-in carries FSDP's precision plugin)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.module import LitLLM


@pytest.mark.parametrize("precision, dtype, autocast", [
    ("bf16-true", torch.bfloat16, False),  # FSDP converts the module to bf16 after setup: the probe ran in fp32
    ("bf16-mixed", torch.float32, True),  # FSDP's autocast is CUDA's only, and the probe runs before the move
    ("32-true", torch.float32, False),
])
def test_budget_probe_under_fsdp_precision(precision, dtype, autocast):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=257, block_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=64))
    module = LitLLM(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = SimpleNamespace(precision_plugin=FSDPPrecision(precision), datamodule=None,
                              strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, torch.is_autocast_enabled("cpu"))))
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.5, probe_batch_size=2)
    cb.setup(trainer, module, "fit")
    assert seen and set(seen) == {(dtype, autocast)}  # (under autocast the residual stream stays fp32)
    after = module.state_dict()  # the probe gave the fp32 weights back, bit for bit
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert cb.budget_report is not None and len(cb.plan) == 3
