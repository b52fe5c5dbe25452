"""Dropout under activation checkpointing: recomputation must apply the masks that forward applied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe
from lit_dtrain.callbacks._checkpoint_policies import apply_checkpointing, every_k_plan, set_plan, uniform_plan
from lit_dtrain.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=257, block_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=64, dropout=0.2)
IDS = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(1))


def llama() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


def loss_fn(model):
    return lambda: F.cross_entropy(model(IDS[:, :-1]).flatten(0, 1), IDS[:, 1:].flatten())


def grads(model, forward) -> list[torch.Tensor]:
    """Gradients of two steps from one seed (the second step's masks come after the first's)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    for _ in range(2):
        forward().backward()
    return [p.grad.clone() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("policy", ["full", "every_k", "selective", "mixed", "budget"])
def test_dropout_gradients_equal_no_checkpointing(policy):
    model = llama()
    ref = grads(model, loss_fn(model))
    wrappers = apply_checkpointing(list(model.blocks), uniform_plan(3, "none"))
    if policy == "budget":
        plan, _ = budget_plan_from_probe(loss_fn(model), model, list(model.blocks), wrappers, 0.5)
        assert set(plan) - {"none"}, plan
    else:
        plan = {"every_k": every_k_plan(3, 2), "mixed": ["full", "selective", "none"]}.get(policy) or \
            uniform_plan(3, policy)
        set_plan(wrappers, plan)
    assert max_diff(grads(model, loss_fn(model)), ref) == 0.0  # same masks, same ops: bit for bit
    assert all(w.calls >= 2 for w, m in zip(wrappers, plan) if m != "none")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dropout_gradients_equal_no_checkpointing_compiled(mode):
    """Under torch.compile (aot_eager: dynamo + AOTAutograd's partitioner) the compiled run with checkpointing
    matches the compiled run without it (inductor was checked by hand: docs/activation_checkpointing.md)."""
    torch._dynamo.reset()
    try:
        model = llama()
        ref = grads(model, loss_fn(torch.compile(model, backend="aot_eager")))
        apply_checkpointing(list(model.blocks), uniform_plan(3, mode))
        torch._dynamo.reset()
        assert max_diff(grads(model, loss_fn(torch.compile(model, backend="aot_eager"))), ref) <= 1e-6
    finally:
        torch._dynamo.reset()
