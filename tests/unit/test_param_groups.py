"""``param_groups``: what AdamW's two groups hold when some parameters are frozen."""

from __future__ import annotations

from lit_dtrain.models import build_llama
from lit_dtrain.module_params import param_groups


def test_frozen_parameters_are_in_no_group():
    """A frozen embedding (fine-tuning the blocks alone) is left out of the optimizer: its logged group sizes are
    the trained parameters', and no weight decay or state is kept for it."""
    model = build_llama(vocab_size=257, block_size=16, n_layer=2, n_head=2, n_kv_head=2, d_model=16)
    model.tok_embeddings.weight.requires_grad_(False)
    model.blocks[0].attn.wq.weight.requires_grad_(False)
    decay, no_decay = param_groups(model, weight_decay=0.1)
    grouped = {id(p) for p in decay["params"] + no_decay["params"]}
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert grouped == trained and id(model.tok_embeddings.weight) not in grouped
    assert len(decay["params"]) == 13 and decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
