"""``estimate_train_flops`` (``flops_per_batch``: FLOP/s and MFU) against hand counts and torch's FlopCounterMode, for
the Llama and for models of one's own: a GPT-2-style tied head without ``config.tie_embeddings``, a nanoGPT-style
``config`` (``n_layer``, ``n_embd``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lit_dtrain.models import build_llama
from lit_dtrain.module import estimate_train_flops

V, D, B, T = 64, 32, 2, 8


class TinyGPT(nn.Module):
    """Embedding -> Linear -> head, the head tied to the embedding (GPT-2's ``lm_head.weight = wte.weight``) or not."""

    def __init__(self, tie: bool, config=None) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.wte = nn.Embedding(V, D)
        self.body = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.wte(ids)))


def matmul_flops_of_a_step(model: nn.Module, ids: torch.Tensor) -> int:
    """FLOPs of the matrix products (``aten.mm``, ``aten.addmm``) of a forward and backward, as torch counts them."""
    with FlopCounterMode(display=False) as counter:
        model(ids).float().logsumexp(-1).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if str(op).split(".")[1] in ("mm", "addmm"))


@pytest.mark.parametrize("tie", [True, False])
def test_a_tied_head_of_ones_own_model_is_counted_without_a_config(tie: bool) -> None:
    """The embedding table was left out of 6N unless ``config.tie_embeddings`` said it was tied: a GPT-2-style model
    of one's own (no such config) had its LM head's FLOPs dropped (a fit of one estimated 202752 FLOPs per batch where
    595968 ran; GPT-2 small's head is 38.6M of its 124M parameters): FLOP/s and MFU a third of the truth. Its
    matmuls are counted by torch too."""
    model = TinyGPT(tie)
    matmul_params = D * D + D * V  # body and head weights: 6 FLOPs per token each in forward + backward
    want = 6.0 * (matmul_params + D) * B * T  # + the bias, which 6N counts as well
    assert estimate_train_flops(model, B, T) == want
    assert matmul_flops_of_a_step(model, torch.randint(0, V, (B, T))) == 6 * matmul_params * B * T


def test_an_embedding_shared_with_another_embedding_only_is_left_out() -> None:
    """Two lookups of one table (an encoder's and a decoder's) multiply nothing: not a tied head. The table was
    subtracted once per embedding module, though counted once: 101376 FLOPs where 297984 ran."""
    model = TinyGPT(tie=False)
    model.wpe = nn.Embedding(V, D)
    model.wpe.weight = model.wte.weight
    assert estimate_train_flops(model, B, T) == estimate_train_flops(TinyGPT(tie=False), B, T)


@dataclasses.dataclass
class GPTConfig:  # nanoGPT's names
    n_layer: int = 3
    n_embd: int = D


@dataclasses.dataclass
class HFConfig:  # Hugging Face's names
    num_hidden_layers: int = 3
    hidden_size: int = D


@pytest.mark.parametrize("config", [GPTConfig(), HFConfig()])
def test_a_config_with_another_name_for_the_width_gets_the_attention_term(config) -> None:
    """A nanoGPT-style ``config`` (``n_layer``, ``n_embd``) made the fit fail at its first training batch,
    ``AttributeError: 'GPTConfig' object has no attribute 'd_model'`` (the estimate read ``config.d_model``)."""
    model = TinyGPT(tie=True, config=config)
    attention = 6.0 * 3 * D * T * B * T  # QK^T and AV over the causal half, forward + backward
    assert estimate_train_flops(model, B, T) == estimate_train_flops(TinyGPT(tie=True), B, T) + attention


def test_a_config_without_a_width_gets_six_n_alone() -> None:
    model = TinyGPT(tie=False, config=dataclasses.make_dataclass("C", [("n_layer", int, 3)])())
    assert estimate_train_flops(model, B, T) == estimate_train_flops(TinyGPT(tie=False), B, T)


@pytest.mark.parametrize("tie", [True, False])
def test_the_llama_estimate_is_the_hand_count_and_torch_counts_its_matmuls(tie: bool) -> None:
    """6 N (matrices and norm weights, the tied table once, an untied one left out) + 6 L d T per token; torch's
    FlopCounterMode gives the matmul part, 6 N less the norm weights' 6 x 9 d."""
    torch.manual_seed(0)
    model = build_llama(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_kv_head=1, d_model=D, tie_embeddings=tie)
    n = sum(p.numel() for p in model.parameters()) - (0 if tie else V * D)
    norms = (2 * 2 + 1) * D
    assert estimate_train_flops(model, B, T) == 6.0 * n * B * T + 6.0 * 2 * D * T * B * T
    assert matmul_flops_of_a_step(model, torch.randint(0, V, (B, T))) == 6 * (n - norms) * B * T


@dataclasses.dataclass
class QwenConfig:  # Hugging Face's names, with a head_dim that is not hidden_size / num_attention_heads (Qwen3, Gemma)
    num_hidden_layers: int = 1
    hidden_size: int = D
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16  # 4 x 16 = 64 query dims for a width of 32


class HeadDimAttention(nn.Module):
    """One causal attention layer whose query heads are ``num_attention_heads x head_dim`` wide (GQA keys and values),
    the scores and their product with the values as plain batched matmuls, which torch's FlopCounterMode counts."""

    def __init__(self, config=None) -> None:
        super().__init__()
        c = QwenConfig()
        if config is not None:
            self.config = config
        self.h, self.kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.wte = nn.Embedding(V, D)
        self.q, self.k, self.v = (nn.Linear(D, n * c.head_dim, bias=False) for n in (self.h, self.kv, self.kv))
        self.o = nn.Linear(self.h * c.head_dim, D, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k, v = (f(x).view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kv, 1)
                for f in (self.k, self.v))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1)
        h = self.o((scores @ v).transpose(1, 2).reshape(b, t, -1))
        return h @ self.wte.weight.t()


def test_a_config_with_a_head_dim_gets_the_attention_term_of_its_query_heads() -> None:
    """QK^T and AV run at num_attention_heads x head_dim (64 here), not hidden_size (32): read as the width, the
    attention term of a Qwen3-0.6B-style config (16 x 128 for 1024) was half of what ran. The causal half of the
    scores' and values' matmuls that torch counts (forward + backward)."""
    ids = torch.randint(0, V, (B, T))
    with FlopCounterMode(display=False) as counter:
        HeadDimAttention()(ids).float().logsumexp(-1).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    scores_and_values = sum(v for op, v in counts.items() if str(op).split(".")[1] == "bmm")
    term = estimate_train_flops(HeadDimAttention(QwenConfig()), B, T) - estimate_train_flops(HeadDimAttention(), B, T)
    assert term == scores_and_values / 2 == 6.0 * 1 * 64 * T * B * T
