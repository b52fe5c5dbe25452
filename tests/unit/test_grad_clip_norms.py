"""``AdaptiveGradClip``'s gradient norm helpers with stand-in trainers: the loss scale still on the gradients, and the
norm under local updates (each rank its own gradients)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_dtrain.callbacks.adaptive_grad_clip import global_grad_norm, loss_scale


def test_only_an_optimizer_that_unscales_inside_step_sees_scaled_gradients():
    """Lightning unscales before ``on_before_optimizer_step`` except for an optimizer that unscales inside ``step``
    (fused AdamW): only there are the gradients still multiplied by the GradScaler's scale."""
    param = torch.nn.Parameter(torch.zeros(2))
    scaler = SimpleNamespace(get_scale=lambda: 1024.0)
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))
    assert loss_scale(trainer, torch.optim.AdamW([param], foreach=True)) == 1.0
    assert loss_scale(trainer, torch.optim.AdamW([param], fused=True)) == 1024.0
    no_scaler = SimpleNamespace(precision_plugin=SimpleNamespace())
    assert loss_scale(no_scaler, torch.optim.AdamW([param], fused=True)) == 1.0


def test_under_local_updates_the_norm_is_the_root_mean_square_of_the_ranks_norms():
    """This rank's norm 3, the other's 4: sqrt((9 + 16) / 2), the same on both ranks, not the norm of their sum."""
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 0.0])
    strategy = SimpleNamespace(local_update=object(), reduce=lambda t, reduce_op: t + 16.0)
    trainer = SimpleNamespace(world_size=2, strategy=strategy)
    assert float(global_grad_norm([param], trainer)) == pytest.approx((25 / 2) ** 0.5)
