"""``AdaptiveGradClip``'s gradient norm helpers with stand-in trainers: the loss scale still on the gradients, and the
norm under local updates (each rank its own gradients), and ``max_norm`` beside the adaptive threshold."""

from __future__ import annotations

import math
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


def test_max_norm_is_a_ceiling_that_never_loosens_the_adaptive_threshold():
    """After the warmup the threshold is the lower of mean + z * std and ``max_norm``: a ``max_norm`` far above
    leaves the adaptive clip as it is."""
    from tests.unit._grad_clip_helpers import run_clip

    norms = [1.0 + 0.05 * math.sin(i) for i in range(30)] + [10.0]
    _, _, adaptive = run_clip(norms, warmup_steps=25, z_threshold=2.5)
    clip, _, ceiled = run_clip(norms, warmup_steps=25, z_threshold=2.5, max_norm=100.0)
    assert ceiled[30][1] == adaptive[30][1] < 2.0  # the spike clipped to the adaptive threshold, not to 100
    assert clip.threshold() < 100.0
