"""``fourier/prob_max_ratio`` and ``fourier/prob_min_ratio``: how far the sampler's distribution is from its target."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.callbacks import FourierSamplerCallback
from lit_dtrain.data.samplers import FourierSampler
from tests.unit._fourier_helpers import _FakeTrainer, _Recorder


def test_the_logged_spread_is_that_of_the_distribution_the_batch_was_drawn_from():
    s = FourierSampler(variant="magnitude", stages=False)
    s.setup(20)
    s.exclude([3])  # not drawable: left out of both ratios (its probability is 0)
    cb, trainer = FourierSamplerCallback(log_every_n_steps=1), _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, 1
    module, expected = _Recorder(trainer), []
    for step in range(5):
        idx = s.global_batch(step, 8)
        probs = s.probabilities(step)
        ratio = probs[probs > 0] * 19  # over the uniform share of the 19 drawable samples
        expected.append((float(ratio.max()), float(ratio.min())))
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        token_loss = torch.rand(8, 32, generator=torch.Generator().manual_seed(step)) * (1 + idx[:, None] % 4)
        cb.on_train_batch_end(trainer, module, {"token_loss": token_loss, "index": idx}, None, step)
    logged = [(module.logged[k + 1]["fourier/prob_max_ratio"], module.logged[k + 1]["fourier/prob_min_ratio"])
              for k in range(5)]
    assert logged[0] == pytest.approx((1.0, 1.0))  # nothing learned yet: the target itself
    assert [v for pair in logged for v in pair] == pytest.approx([v for pair in expected for v in pair], rel=1e-12)
    assert logged[-1][0] > 1.2 and logged[-1][1] < 0.8  # and it does move
