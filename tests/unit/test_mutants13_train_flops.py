"""``estimate_train_flops`` (module_params.py) where single-point mutants passed test_flops_estimate.py,
test_mutants12_module_params.py, test_module.py, test_predict.py and the throughput tests (thirteenth hand mutation
audit): the estimate of the nano model (conf/model/nano.yaml, the default) against a count by hand, and the same
estimate once a sharding strategy has left each parameter a 1-D view of its shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_dtrain.models import build_llama
from lit_dtrain.module_params import estimate_train_flops, remember_parameter_shapes
from tests.unit.test_flops_estimate import B as TINY_B
from tests.unit.test_flops_estimate import D, TinyGPT
from tests.unit.test_flops_estimate import T as TINY_T
from tests.unit.test_mutants12_module_params import SIX_N, config

NANO = dict(vocab_size=257, block_size=256, n_layer=5, n_head=4, n_kv_head=2, d_model=128)  # conf/model/nano.yaml
B, T = 2, 64


def nano_by_hand() -> float:
    """6 N per token over the nano's 955,904 parameters, plus the causal half of the scores (6 L d T per token)."""
    d, layers, kv_width, hidden = 128, 5, 2 * 32, 352  # hidden: 32 * ceil(8 * 128 / 3 / 32)
    block = d * d + 2 * d * kv_width + d * d + 3 * d * hidden + 2 * d  # wq, wk + wv, wo, SwiGLU, two RMSNorms
    n = layers * block + d + 257 * d  # + final norm + the table, tied to the head (counted once)
    assert n == 955_904
    return 6.0 * n * B * T + 6.0 * layers * d * T * B * T


def test_the_nano_estimate_is_the_hand_count() -> None:
    """765,591,552 FLOPs for a 2 x 64 batch: 733,052,928 of matmuls (what torch's FlopCounterMode counts as
    ``aten.mm``; the 11 norm weights' 6 x 1408 per token it does not), 31,457,280 of causal attention (FlopCounterMode
    counts 62,914,560 under the math SDPA backend, the full T x T, and 0 under the CPU's flash kernel, which it does
    not know)."""
    model = build_llama(**NANO)
    assert estimate_train_flops(model, B, T) == nano_by_hand() == 765_591_552


@pytest.mark.parametrize("tie", [True, False])
def test_a_sharded_model_is_estimated_at_its_full_size(tie: bool) -> None:
    """Under FSDP (``use_orig_params=True``) each parameter is a 1-D view of this rank's shard (simulated here by
    halving each one's data): the estimate counts the sizes ``remember_parameter_shapes`` recorded, the model every
    rank computes. Counted from ``p.numel()`` it read about half (an untied table, also 1-D, was subtracted at its
    shard's size)."""
    model = build_llama(**NANO, tie_embeddings=tie)
    remember_parameter_shapes(model)
    want = estimate_train_flops(model, B, T)
    if tie:
        assert want == nano_by_hand()
    for p in model.parameters():
        p.data = p.data.flatten()[: max(1, p.numel() // 2)]
    assert estimate_train_flops(model, B, T) == want


@pytest.mark.parametrize("values", [
    {"n_layer": 3, "num_hidden_layers": 5, "d_model": D, "hidden_size": 2 * D},  # the first name given wins
    {"n_layer": 3, "d_model": D + 0.5, "n_embd": D},  # a width that is no integer is passed over
])
def test_the_depth_and_width_are_the_first_positive_integers_named(values) -> None:
    """``n_layer`` before ``num_hidden_layers``, ``d_model`` before ``n_embd`` and ``hidden_size``, as documented; a
    float is no width (32.5 was taken: 6 L d T at d = 32.5): 3 layers of width D, 6 L d T per token."""
    attention = 6.0 * 3 * D * TINY_T * TINY_B * TINY_T
    assert estimate_train_flops(TinyGPT(True, config(**values)), TINY_B, TINY_T) == SIX_N + attention


def test_a_validation_batch_of_the_train_batchs_shape_counts_its_forward_alone() -> None:
    """``flops_per_batch`` is cached per batch shape and per pass: a validation batch of the train batch's 2 x 16
    shape gets a third of the train estimate (forward only), and the next train batch the whole again (one cache
    entry per shape gave validation the forward + backward FLOPs of the train batch before it, 3x). Predict likewise."""
    from tests.unit._module_helpers import tiny_lit, window_loader

    module = tiny_lit()
    [batch] = window_loader(1, batch_size=2, seq=16)
    whole = estimate_train_flops(module.model, 2, 16)
    seen = []
    for hook in (module.on_train_batch_start, module.on_validation_batch_start, module.on_train_batch_start,
                 module.on_predict_batch_start):
        hook(batch, 0)
        seen.append(module.flops_per_batch)
    assert seen == [whole, whole / 3, whole, whole / 3]


def test_an_untied_table_inside_a_submodule_is_left_out() -> None:
    """Hugging Face's causal LMs keep the table one level down (``model.embed_tokens`` beside ``lm_head``): an untied
    one there is still a lookup, left out of 6 N as at the top level (looking among the direct children only counted
    its 64 x 32 rows as multiplied)."""
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT(tie=False)

    assert estimate_train_flops(Outer(), TINY_B, TINY_T) == estimate_train_flops(TinyGPT(tie=False), TINY_B, TINY_T)


@pytest.mark.parametrize("values", [
    {"n_layer": 3.0, "d_model": float(D)},  # a config read from a JSON or YAML file that wrote 3.0
    {"n_layer": np.int64(3), "n_embd": np.int64(D)},  # sizes computed with numpy
])
def test_a_depth_and_width_that_are_whole_numbers_of_another_type_are_taken(values) -> None:
    """A project of one's own whose model config holds its sizes as floats that are whole numbers (the model's
    modules built with ``int(...)``) or numpy integers: 3 layers of width D, as the config checks take them, not 6 N
    alone (the attention term was dropped, and the MFU read low)."""
    attention = 6.0 * 3 * D * TINY_T * TINY_B * TINY_T
    assert estimate_train_flops(TinyGPT(True, config(**values)), TINY_B, TINY_T) == SIX_N + attention
