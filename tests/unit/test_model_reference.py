"""The Llama model against an independent naive reference: plain matmuls, an explicit causal mask, k/v heads
repeated explicitly, RoPE rotating each pair (x[2i], x[2i+1]) by t * theta^(-2i/hs) in real arithmetic."""

import math

import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.models import build_llama


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of ``model``'s weights, computed in float64 from the textbook formulas."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    B, T = ids.shape
    nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.d_model // cfg.n_head

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    pos = torch.arange(T, dtype=torch.float64)[:, None]
    theta = torch.tensor([cfg.rope_theta ** (-2 * i / hs) for i in range(hs // 2)], dtype=torch.float64)
    cos, sin = torch.cos(pos * theta), torch.sin(pos * theta)  # (T, hs/2)

    def rope(x):  # (B, h, T, hs)
        out = torch.empty_like(x)
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    x = sd["tok_embeddings.weight"][ids]  # (B, T, C)
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        h = rms(x, sd[p + "attn_norm.weight"])
        q = (h @ sd[p + "attn.wq.weight"].T).view(B, T, nh, hs).transpose(1, 2)
        k = (h @ sd[p + "attn.wk.weight"].T).view(B, T, nkv, hs).transpose(1, 2)
        v = (h @ sd[p + "attn.wv.weight"].T).view(B, T, nkv, hs).transpose(1, 2)
        q, k = rope(q), rope(k)
        group = nh // nkv
        k = torch.stack([k[:, j // group] for j in range(nh)], dim=1)  # query head j reads kv head j // group
        v = torch.stack([v[:, j // group] for j in range(nh)], dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.softmax(scores, -1) @ v  # (B, nh, T, hs)
        x = x + y.transpose(1, 2).reshape(B, T, nh * hs) @ sd[p + "attn.wo.weight"].T
        h = rms(x, sd[p + "mlp_norm.weight"])
        gate = h @ sd[p + "mlp.w1.weight"].T
        x = x + ((gate * torch.sigmoid(gate)) * (h @ sd[p + "mlp.w3.weight"].T)) @ sd[p + "mlp.w2.weight"].T
    head = sd["tok_embeddings.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    return rms(x, sd["norm.weight"]) @ head.T


CONFIGS = [
    dict(n_head=4, n_kv_head=2, d_model=32, block_size=17, tie_embeddings=True),
    dict(n_head=4, n_kv_head=1, d_model=32, block_size=9, tie_embeddings=False),
    dict(n_head=6, n_kv_head=3, d_model=24, block_size=13, tie_embeddings=True, rope_theta=500.0),
    dict(n_head=2, n_kv_head=2, d_model=16, block_size=7, tie_embeddings=False, n_layer=3),
    dict(n_head=8, n_kv_head=1, d_model=32, block_size=31, tie_embeddings=True, mlp_hidden=40),
]


def random_model(seed: int, **kw):
    cfg = dict(vocab_size=61, n_layer=2)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = build_llama(**cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so that a norm that ignores them shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(10)  # init_std 0.2: softmaxes far from uniform
    return model


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_equal_the_naive_reference(kw):
    model = random_model(0, **kw)
    gen = torch.Generator().manual_seed(1)
    for T in (kw["block_size"], kw["block_size"] // 2 + 1, 1):  # full context, shorter, a single token
        ids = torch.randint(0, 61, (2, T), generator=gen)
        with torch.no_grad():
            got = model(ids)
        torch.testing.assert_close(got.double(), reference_logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", CONFIGS[:3])
def test_changing_later_tokens_never_changes_earlier_logits(kw):
    model = random_model(2, **kw)
    T = kw["block_size"]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 61, (1, T), generator=gen)
    with torch.no_grad():
        base = model(ids)
        for t in range(T - 1):
            other = ids.clone()
            other[:, t + 1 :] = torch.randint(0, 61, (1, T - t - 1), generator=gen)
            got = model(other)
            assert torch.equal(got[:, : t + 1], base[:, : t + 1]), t
            assert not torch.allclose(got[:, t + 1 :], base[:, t + 1 :])


def test_greedy_generation_is_the_argmax_of_a_full_forward_at_every_step_also_past_block_size():
    model = random_model(4, **CONFIGS[1])  # block_size 9
    prompt = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))  # longer than block_size
    out = model.generate(prompt, 6, temperature=0)
    assert torch.equal(out[:, :12], prompt) and out.shape == (2, 18)
    seq = prompt
    for _ in range(6):
        ref = reference_logits(model, seq[:, -9:])[:, -1]  # the last block_size tokens, positions from 0
        seq = torch.cat([seq, ref.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_top_k_one_is_greedy_and_sampling_draws_from_the_tempered_top_k_distribution():
    model = random_model(6, **CONFIGS[0])
    prompt = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(7))
    greedy = model.generate(prompt, 4, temperature=0)
    for temperature in (0.5, 1.0, 3.0):
        assert torch.equal(model.generate(prompt, 4, temperature=temperature, top_k=1), greedy)
    with torch.no_grad():
        logits = model(prompt)[0, -1].double()
    top = torch.topk(logits, 3).indices
    draws = model.generate(prompt.expand(4000, 5), 1, temperature=2.0, top_k=3,
                           generator=torch.Generator().manual_seed(8))[:, -1]
    assert set(draws.tolist()) <= set(top.tolist())  # only the 3 most likely tokens
    want = torch.softmax(logits[top] / 2.0, -1)
    freq = torch.stack([(draws == t).double().mean() for t in top])
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)


def test_the_initial_loss_is_about_log_vocab():
    """init_std 0.02 with output projections scaled by 1/sqrt(2 n_layer): near-uniform predictions at step 0."""
    torch.manual_seed(0)
    model = build_llama(vocab_size=257, block_size=64, n_layer=4, n_head=4, n_kv_head=2, d_model=64)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            want = 0.02 / math.sqrt(8) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            assert p.std().item() == pytest.approx(want, rel=0.05), name
    ids = torch.randint(0, 257, (4, 64))
    with torch.no_grad():
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    assert abs(loss.item() - math.log(257)) < 0.1


def test_a_float64_model_computes_in_float64_rope_tables_included():
    """precision=64-true converts the model with .to(float64): RMSNorm and RoPE (tables too) must then run in
    float64. They went through fp32 (x.float(), a complex64 rotation, the fp32 table cast up), which left the
    logits of a '64-bit' model only fp32-accurate (~1e-5 off here)."""
    model = random_model(0, **CONFIGS[0]).double()
    ids = torch.randint(0, 61, (2, CONFIGS[0]["block_size"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference_logits(model, ids), rtol=1e-11, atol=1e-11)


def test_a_cast_model_keeps_rope_tables_of_at_least_fp32_computed_in_its_dtype():
    """bf16-true/16-true (module.to(bf16/fp16)) cast the tables to 16 bits (error up to 2e-3); they are recomputed
    in fp32 instead, and in float64 under 64-true (a cast of the fp32 table kept its fp32 error)."""
    model = build_llama(vocab_size=61, block_size=256, n_layer=1, n_head=4, n_kv_head=2, d_model=64)
    angles = torch.arange(256, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 16, 2) / 16).double()
    cos64, sin64 = torch.cos(angles), torch.sin(angles)
    for dtype, table in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                         (torch.float64, torch.float64), (torch.float32, torch.float32)):
        model.to(dtype)
        assert model.tok_embeddings.weight.dtype == dtype
        assert model.rope_cos.dtype == model.rope_sin.dtype == table, dtype
        tol = dict(rtol=0, atol=2e-16 if table == torch.float64 else 0)  # the table is rounded once from float64
        torch.testing.assert_close(model.rope_cos, cos64.to(table), **tol)
        torch.testing.assert_close(model.rope_sin, sin64.to(table), **tol)
