"""What eager recomputation replays besides the ops: RNG states after saved random ops, and the block's buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_dtrain.callbacks._checkpoint_policies import apply_checkpointing, uniform_plan


def grads(model, forward) -> list[torch.Tensor]:
    """Gradients of two steps from one seed (the second step's masks come after the first's)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    for _ in range(2):
        forward().backward()
    return [p.grad.clone() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


class SavedRandomOpBlock(nn.Module):
    """A random op whose output ``selective`` saves, then dropout (recomputed): on a GPU, SDPA's flash/efficient
    kernel with ``dropout_p > 0`` (in the default save list) followed by the residual dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l1(x) * torch.bernoulli(torch.full((16,), 0.7))
        return F.dropout(self.l2(h).relu(), 0.3, training=True)


def test_a_saved_random_op_does_not_change_the_masks_recomputed_after_it():
    """The saved op is not run again in recomputation, so it drew nothing there and the dropout after it got another
    mask than forward applied: gradients off by 1.13 (max abs), silently."""
    torch.manual_seed(0)
    model = nn.Sequential(SavedRandomOpBlock(), SavedRandomOpBlock())
    x = torch.randn(4, 16)

    def forward():
        return model(x).square().sum()

    ref = grads(model, forward)
    wrappers = apply_checkpointing(list(model), uniform_plan(2, "selective"), ["aten.addmm", "aten.bernoulli"])
    assert max_diff(grads(model, forward), ref) == 0.0
    assert [w.calls for w in wrappers] == [2, 2]


class CountingBlock(nn.Module):
    """Reads a buffer it updates in its forward (a step counter, a running normalizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.lin(x) * (self.n + 0)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_reads_the_buffers_forward_read(mode):
    """Recomputation ran on the buffers forward had already updated (n = 2 instead of 1 in the first step): gradients
    off by 7.6 (max abs), silently. The update still counts once."""
    torch.manual_seed(0)
    model = nn.Sequential(CountingBlock(), CountingBlock())
    x = torch.randn(4, 8)

    def forward():
        return model(x).square().sum()

    ref = grads(model, forward)
    assert [float(b.n) for b in model] == [2.0, 2.0]
    for b in model:
        b.n.zero_()
    wrappers = apply_checkpointing(list(model), uniform_plan(2, mode))
    assert max_diff(grads(model, forward), ref) == 0.0
    assert [float(b.n) for b in model] == [2.0, 2.0]  # one update per forward, none in recomputation
    assert [w.calls for w in wrappers] == [2, 2]
