"""A ``64-true`` model's end-of-run sample leaves its weights bitwise as they were, also their bits below fp32's
(sampled from an fp32 copy: a cast to fp32 and back in place would round them)."""

from __future__ import annotations

import torch

from lit_dtrain.data import ByteTokenizer
from lit_dtrain.end_sample import generate_sample
from lit_dtrain.models import build_llama


def test_a_float64_models_weights_keep_their_low_bits_through_the_sample():
    torch.manual_seed(0)
    model = build_llama(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 1e-12)  # bits an fp32 copy does not hold
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(v, v.float().double()) for v in before.values())
    cfg = {"prompt": "def ", "max_new_tokens": 8, "temperature": 1.0, "top_k": None}
    assert len(generate_sample(model, ByteTokenizer(), cfg, 7, torch.device("cpu"))) > 0
    assert all(v.dtype == torch.float64 and torch.equal(v, before[k]) for k, v in model.state_dict().items())
