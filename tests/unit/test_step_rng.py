"""The forward's random draws are a function of (seed, step, micro-batch, rank), and leave the process RNG alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_dtrain.step_rng import forward_rng, step_seed


def _mask(seed: int) -> torch.Tensor:
    with forward_rng(seed, torch.device("cpu")):
        return F.dropout(torch.ones(64), 0.5, training=True)


def test_masks_follow_the_step_not_the_process_history():
    seeds = {step_seed(1337, s, m, r) for s in range(3) for m in range(2) for r in range(2)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)
    first = _mask(step_seed(1337, 5, 0, 0))
    torch.rand(1000)  # a process that drew other numbers before (a resumed run) draws the same mask at step 5
    assert torch.equal(_mask(step_seed(1337, 5, 0, 0)), first)
    assert not torch.equal(_mask(step_seed(1337, 6, 0, 0)), first)


def test_the_generator_outside_is_untouched():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    _mask(123)
    assert torch.equal(torch.rand(4), expected)


def test_only_a_model_that_draws_random_numbers_runs_on_forked_generators():
    from lit_dtrain.models.llama import Llama, LlamaConfig
    from lit_dtrain.step_rng import draws_random

    small = dict(vocab_size=16, d_model=16, n_layer=1, n_head=2, block_size=8)
    assert not draws_random(Llama(LlamaConfig(**small)))  # the default dropout 0: unforked, no generator touched
    assert draws_random(Llama(LlamaConfig(**small, dropout=0.1)))
    assert not draws_random(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    assert draws_random(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout2d(0.2)))
