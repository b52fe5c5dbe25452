"""lit_dtrain.utils.memory.ATTENTION_FLOPS: SDPA FLOPs with fewer k/v heads than query heads (grouped-query attention)
count as if k and v were expanded to the query's heads, and MHA counts exactly as torch's own formulas.

Torch 2.11's SDPA formulas assert equal q/k/v head counts (2.13's accept GQA), which broke FLOP counting of our
Llama on CUDA. The tests swap in such strict formulas so they check the expansion whatever torch is installed.
Every entry is called directly with meta tensors; the CPU kernel runs under FlopCounterMode on CPU tensors and
the CUDA kernels on meta tensors (their meta kernels stand in for the GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.flop_counter as flop_counter

from lit_dtrain.utils.memory import ATTENTION_FLOPS, backward_flops_by_op

B, HQ, HKV, T, D = 2, 8, 2, 64, 16
SDPA_OPS = [
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
]


@pytest.fixture(autouse=True)
def mha_only_formulas(monkeypatch):
    """Torch's SDPA FLOP formulas made to reject different q/k/v head counts, as torch 2.11's do."""
    for name in ("sdpa_flop_count", "sdpa_backward_flop_count"):
        formula = getattr(flop_counter, name)

        def strict(*shapes, formula=formula):
            heads = {shape[1] for shape in shapes}
            assert len(heads) == 1, f"heads differ: {shapes}"
            return formula(*shapes)

        monkeypatch.setattr(flop_counter, name, strict)


def meta(heads: int) -> torch.Tensor:
    return torch.empty(B, heads, T, D, device="meta")  # (B, H, T, D)


def test_every_sdpa_kernel_of_this_torch_has_an_entry():
    ops = [getattr(torch.ops.aten, name + suffix) for name in SDPA_OPS for suffix in ("", "_backward")]
    assert set(ATTENTION_FLOPS) == set(ops)


@pytest.mark.parametrize("op", list(ATTENTION_FLOPS), ids=str)
def test_gqa_counts_kv_expanded_and_mha_counts_as_torch(op):
    names = [arg.name for arg in op.default._schema.arguments]
    backward = op.__name__.endswith("_backward")
    assert names[backward:backward + 3] == ["query", "key", "value"]  # backward ops take grad_out first
    grad_out = [meta(HQ)] if backward else []
    # torch's own formula for the op; the CPU kernel has none, it takes the CUDA kernels' formula
    torch_formula = flop_counter.flop_registry.get(
        op, flop_counter.sdpa_backward_flop if backward else flop_counter.sdpa_flop)

    gqa = ATTENTION_FLOPS[op](*grad_out, meta(HQ), meta(HKV), meta(HKV))
    expanded = torch_formula(*grad_out, meta(HQ), meta(HQ), meta(HQ))
    # two (T x D) @ (D x T)-sized matmuls forward, five backward, at 2 FLOPs per multiply-add, per query head
    assert gqa == expanded == (5 if backward else 2) * 2 * B * HQ * T * T * D

    mha = [meta(HQ), meta(HQ), meta(HQ)]
    assert ATTENTION_FLOPS[op](*grad_out, *mha) == torch_formula(*grad_out, *mha)
    with pytest.raises(AssertionError, match="heads differ"):  # the strict formulas are in force
        torch_formula(*grad_out, meta(HQ), meta(HKV), meta(HKV))


def test_gqa_attention_backward_under_flop_counter_mode_on_cpu():
    torch.manual_seed(0)
    q = torch.randn(B, HQ, T, D, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, D, requires_grad=True) for _ in range(2))
    flops = backward_flops_by_op(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum())
    assert flops == {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: 10 * B * HQ * T * T * D}


CUDA_KERNEL_CALLS = {  # the ops as CUDA SDPA calls them (meta kernels stand in for the GPU), with scale= as a kwarg
    "flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.25),
    "efficient": lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=0.25),
    "cudnn": lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=0.25),
}


@pytest.mark.parametrize("kernel", list(CUDA_KERNEL_CALLS))
def test_gqa_cuda_kernels_under_flop_counter_mode_on_meta_tensors(kernel):
    q, k, v = meta(HQ), meta(HKV), meta(HKV)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
        outputs = CUDA_KERNEL_CALLS[kernel](q, k, v)
        if kernel == "flash":  # the backward of the kernel the H200 run failed in
            out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, _ = outputs
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                meta(HQ), q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, True, philox_seed,
                philox_offset, scale=0.25)
    expected = (2 + (5 if kernel == "flash" else 0)) * 2 * B * HQ * T * T * D
    assert counter.get_total_flops() == expected
