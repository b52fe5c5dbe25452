"""``lit_dtrain.models.llama`` against a second independent reference (thirteenth hand mutation audit): attention
head by head with an explicit softmax (``exp`` over the unmasked past, divided by its sum) and RoPE as a complex
multiplication by ``exp(i t theta^(-2j/hs))``, in float64, on tiny sizes with grouped-query heads; through both
attention paths (``enable_gqa``, and k/v repeated to every query head as on CUDA in fp32, which no CPU test ran);
dropout exactly at its documented places and nowhere in eval; the parameter count by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lit_dtrain.models import build_llama
from lit_dtrain.models import llama as llama_module


def complex_reference(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of ``model``'s weights in float64: every head and every position written out."""
    cfg = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    B, T = ids.shape
    nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.d_model // cfg.n_head
    freqs = torch.tensor([cfg.rope_theta ** (-2 * j / hs) for j in range(hs // 2)], dtype=torch.float64)
    rotation = torch.polar(torch.ones(T, hs // 2, dtype=torch.float64),
                           torch.arange(T, dtype=torch.float64)[:, None] * freqs)  # (T, hs/2): e^(i t f_j)

    def rope(x):  # (T, hs): pairs (x[2j], x[2j+1]) as x[2j] + i x[2j+1], rotated
        z = torch.complex(x[:, 0::2], x[:, 1::2]) * rotation
        return torch.stack([z.real, z.imag], dim=-1).reshape(T, hs)

    def rms(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    x = w["tok_embeddings.weight"][ids]
    for layer in range(cfg.n_layer):
        p = f"blocks.{layer}."
        h = rms(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn.{name}.weight"].T for name in ("wq", "wk", "wv"))
        out = torch.zeros(B, T, nh * hs, dtype=torch.float64)
        for b in range(B):
            for head in range(nh):
                g = head // (nh // nkv)  # query heads 0..nh/nkv-1 share kv head 0, and so on
                qh = rope(q[b, :, head * hs:(head + 1) * hs])
                kh, vh = rope(k[b, :, g * hs:(g + 1) * hs]), v[b, :, g * hs:(g + 1) * hs]
                for t in range(T):
                    scores = (kh[: t + 1] @ qh[t]) / math.sqrt(hs)  # positions 0..t only
                    weights = torch.exp(scores - scores.max())
                    out[b, t, head * hs:(head + 1) * hs] = (weights / weights.sum()) @ vh[: t + 1]
        x = x + out @ w[p + "attn.wo.weight"].T
        h = rms(x, w[p + "mlp_norm.weight"])
        gate = h @ w[p + "mlp.w1.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (h @ w[p + "mlp.w3.weight"].T)) @ w[p + "mlp.w2.weight"].T
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["tok_embeddings.weight"]
    return rms(x, w["norm.weight"]) @ head.T


CONFIGS = [  # (n_head, n_kv_head): 2 query heads a kv head, 3, one kv head for all, none shared
    dict(n_head=4, n_kv_head=2, d_model=16, tie_embeddings=True),
    dict(n_head=6, n_kv_head=2, d_model=24, tie_embeddings=False, rope_theta=300.0),
    dict(n_head=4, n_kv_head=1, d_model=16, tie_embeddings=False, n_layer=1),
    dict(n_head=2, n_kv_head=2, d_model=8, tie_embeddings=True),
]


def perturbed(seed: int, **kw):
    """A model whose two norms of a block differ (ones at init: swapping them passed), weights scaled up."""
    torch.manual_seed(seed)
    model = build_llama(**{"vocab_size": 23, "block_size": 8, "n_layer": 2, **kw}).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.3, 2.0)
            else:
                p.mul_(8)
    return model


@pytest.mark.parametrize("repeat_kv", [False, True], ids=["enable_gqa", "kv_repeated"])
@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_equal_the_head_by_head_complex_rope_reference(monkeypatch, kw, repeat_kv):
    monkeypatch.setattr(llama_module, "expand_kv_heads", lambda q: repeat_kv)  # repeat_kv: CUDA fp32's path
    model = perturbed(0, **kw)
    ids = torch.randint(0, 23, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).double()
    torch.testing.assert_close(got, complex_reference(model, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :3], complex_reference(model, ids[:, :3]), rtol=1e-5, atol=1e-5)


def test_a_model_in_eval_mode_drops_nothing_and_in_training_drops_at_each_documented_place(monkeypatch):
    """``dropout=0.5``: in eval the logits are the reference's. In training ``F.dropout`` runs on the embeddings and
    on each block's attention and MLP outputs (``1 + 2 n_layer`` times, at p), and SDPA gets ``dropout_p=p``."""
    model = perturbed(2, dropout=0.5, **CONFIGS[0])
    ids = torch.randint(0, 23, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).double(), complex_reference(model, ids), rtol=1e-5, atol=1e-5)

    dropped, sdpa_p = [], []
    real_dropout, real_sdpa = llama_module.F.dropout, llama_module.F.scaled_dot_product_attention

    def dropout(x, p, training):
        dropped.append((tuple(x.shape), p, training))
        return real_dropout(x, p, training=training)

    def sdpa(*args, dropout_p=0.0, **kwargs):
        sdpa_p.append(dropout_p)
        return real_sdpa(*args, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(llama_module.F, "dropout", dropout)
    monkeypatch.setattr(llama_module.F, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        model(ids)
        assert dropped == [] and sdpa_p == [0.0, 0.0]
        model.train()
        model(ids)
    assert dropped == [((2, 8, 16), 0.5, True)] * 5 and sdpa_p == [0.0, 0.0, 0.5, 0.5]


@pytest.mark.parametrize(("kw", "hidden"), [
    (dict(n_head=2, n_kv_head=1, d_model=100, tie_embeddings=True), 288),  # 8 * 100 / 3 = 266.7 -> 9 x 32
    (dict(n_head=4, n_kv_head=1, d_model=96, tie_embeddings=False), 256),  # exactly 256
    (dict(n_head=2, n_kv_head=2, d_model=40, tie_embeddings=False, mlp_hidden=50), 50),
])
def test_the_parameter_count_is_the_hand_count(kw, hidden):
    V, C, L = 23, kw["d_model"], 3
    model = build_llama(vocab_size=V, block_size=8, n_layer=L, **kw)
    assert model.config.mlp_hidden == hidden
    hs = C // kw["n_head"]
    attention = C * kw["n_head"] * hs * 2 + C * kw["n_kv_head"] * hs * 2  # wq, wo; wk, wv
    per_block = attention + 3 * C * hidden + 2 * C  # w1, w2, w3; two RMSNorm weights
    want = V * C + L * per_block + C + (0 if kw["tie_embeddings"] else V * C)
    assert sum(p.numel() for p in model.parameters()) == want
    assert sorted(model.state_dict()) == sorted(name for name, _ in model.named_parameters(remove_duplicate=False))


def test_a_token_id_equal_to_the_vocab_size_is_refused_by_name():
    """``hi >= vocab``: an id of exactly ``vocab_size`` (``> vocab`` passed) reached the embedding's IndexError."""
    model = perturbed(4, **CONFIGS[3])
    with pytest.raises(ValueError, match=r"generate: token ids must be in \[0, 23\), got 23"):
        model.generate(torch.tensor([[1, 23]]), 1)
    assert model.generate(torch.tensor([[1, 22]]), 1, temperature=0).shape == (1, 3)


def test_an_odd_head_dim_is_refused_by_name():
    """RoPE rotates pairs: head dim 3 (d_model 12, 4 heads) is the config's ValueError, not view_as_complex's."""
    with pytest.raises(ValueError, match=r"head dim \(d_model / n_head\) must be even for RoPE"):
        build_llama(vocab_size=23, block_size=8, n_layer=1, n_head=4, n_kv_head=2, d_model=12)
