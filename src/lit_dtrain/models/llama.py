"""A Llama-style decoder-only language model in plain PyTorch (no Lightning).

Token embedding -> n_layer x [RMSNorm -> grouped-query causal attention (RoPE) -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head. Reads top to bottom like nanoGPT.
The transformer blocks live in ``self.blocks`` (an ``nn.ModuleList``): the contract that
lit_dtrain's model-rewriting callbacks (activation checkpointing, ...) rely on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lit_dtrain.utils.args import is_flag, is_number, type_name


@dataclass
class LlamaConfig:
    """Shape of a :class:`Llama` model. Unknown keys are rejected by :meth:`from_dict`."""

    vocab_size: int = 257  # byte-level tokenizer: 256 bytes + EOS
    block_size: int = 256  # maximum sequence length (RoPE table size)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention: n_head must be divisible by n_kv_head
    d_model: int = 128
    mlp_hidden: int | None = None  # SwiGLU hidden size; None -> ~8/3 * d_model rounded to 32
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    depth_scaled_init: bool = True  # output projections get std / sqrt(2 * n_layer)
    dropout: float = 0.0  # training only: attention probabilities, residual branches, embeddings (nanoGPT's places)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.mlp_hidden is not None and not self.mlp_hidden > 0:  # 0 built a model without MLPs, silently
            raise ValueError(f"LlamaConfig.mlp_hidden must be positive or None, got {self.mlp_hidden}")
        if not self.rope_theta > 0:  # 0 gives a NaN RoPE table
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.init_std > 0:  # 0: every weight and every gradient is zero, so nothing can ever learn
            raise ValueError(f"LlamaConfig.init_std must be > 0, got {self.init_std}")
        if not 0.0 <= self.dropout < 1.0:  # 1 zeroes every activation; NaN passed every comparison downstream
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps >= 0:
            raise ValueError(f"LlamaConfig.norm_eps must be >= 0, got {self.norm_eps}")
        if self.d_model % self.n_head:
            raise ValueError(f"LlamaConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("LlamaConfig: head dim (d_model / n_head) must be even for RoPE")
        if self.mlp_hidden is None:
            self.mlp_hidden = 32 * math.ceil(8 * self.d_model / 3 / 32)

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Unknown LlamaConfig key(s) {unknown}; expected a subset of {sorted(known)}")
        return cls(**d)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that RMSNorm, RoPE and the loss compute in: fp32 for bf16/fp16 activations, float64 kept as it is
    (``precision=64-true``: an fp32 detour there made its logits, RoPE tables and loss fp32-accurate, silently)."""
    return torch.promote_types(dtype, torch.float32)


SAMPLING_RULES = {"max_new_tokens": "an integer >= 0", "temperature": "a finite number >= 0 (0: greedy)",
                  "top_k": "an integer >= 0 (0: all tokens)", "top_p": "a number in (0, 1] (1: all tokens)"}


def check_sampling(
    max_new_tokens, temperature, top_k, names: Mapping[str, str] | None = None, prefix: str = "", top_p=None
) -> None:
    """``ValueError`` naming the first bad sampling argument, as ``names`` calls it (``sample.temperature``,
    ``--temperature``): the one check of :meth:`Llama.generate`, ``scripts/generate.py`` and the config's ``sample.*``.
    A temperature of inf (or nan) is refused: the logits divided by it are all 0, a uniform draw over every token
    whatever ``top_k`` says; ``sample.temperature=inf`` passed the config check while ``generate.py`` refused it.
    ``top_p`` 0 would keep no token (nan refused as well)."""
    good = {"max_new_tokens": is_number(max_new_tokens, integer=True) and max_new_tokens >= 0,
            "temperature": is_number(temperature) and math.isfinite(temperature) and temperature >= 0,
            "top_k": top_k is None or (is_number(top_k, integer=True) and top_k >= 0),
            "top_p": top_p is None or (is_number(top_p) and 0 < top_p <= 1)}
    values = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    for key, ok in good.items():
        if not ok:
            name = (names or {}).get(key, key)
            raise ValueError(f"{prefix}{name} must be {SAMPLING_RULES[key]}, got {values[key]!r}")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in fp32 (float64 under 64-true)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cache(
    seq_len: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of rotary position embeddings, each (seq_len, head_dim // 2), in ``dtype`` (float32).

    Computed with numpy in float64 and rounded once, so the table is the same in every process.
    ``torch.cos`` on CPU goes through MKL VML in 2048-element chunks across threads, and at model
    construction in a full training process the second chunk was sometimes less accurate (1 in 5
    processes, in float32 and in float64 alike): two identical runs then trained on RoPE tables
    that differed in the last bit, and ended at different losses.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    return torch.from_numpy(np.cos(angles)).to(dtype), torch.from_numpy(np.sin(angles)).to(dtype)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[..., 2i], x[..., 2i+1]) of x (B, nh, T, hs) by the position angles.

    ``rope`` is ``cos + i sin`` as a complex tensor broadcastable to (B, nh, T, hs/2), e.g. (1, 1, T, hs/2):
    one complex multiply. It is built once per forward by :class:`Llama`. Against the real-valued
    half-split form (split, 4 mul, sub, add, cat) it is ~2.4x faster forward + backward on CPU and
    dispatches 3 fewer ops, which op-level selective checkpointing pays twice more in Python.
    """
    xc = torch.view_as_complex(x.to(compute_dtype(x.dtype)).unflatten(-1, (-1, 2)))  # (B, nh, T, hs/2) complex
    return torch.view_as_real(xc * rope).flatten(-2).type_as(x)


def expand_kv_heads(q: torch.Tensor) -> bool:
    """Whether to repeat k and v to all query heads rather than pass ``enable_gqa``: in fp32 on CUDA. Of torch's
    fused CUDA kernels, flash and cuDNN take grouped heads but run fp16/bf16 only, and the memory-efficient kernel
    runs fp32 but takes no grouped heads (its ``check_batch_size_and_num_heads_dense<false>`` in ``sdp_utils.cpp``),
    so fp32 with grouped heads ran the math path, which keeps the (T x T) scores for backward. Copies of k and v
    cost (nh/nkv - 1) x B x T x d_kv; the scores B x nh x T x T."""
    return q.is_cuda and q.dtype == torch.float32


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout`` in training with ``p > 0``; otherwise ``x`` itself, dispatching no op and drawing no random number
    (so ``dropout=0`` runs exactly the ops, and draws exactly the random numbers, of a model without dropout)."""
    return F.dropout(x, p, training=True) if training and p > 0 else x


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``F.scaled_dot_product_attention``; in training, ``cfg.dropout``
    drops attention probabilities (SDPA's ``dropout_p``) and the output projection's output."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # enable_gqa: SDPA maps query head h to kv head h // (nh / nkv) itself (the same grouping as
        # repeat_interleave), without materializing nh/nkv copies of k and v.
        gqa = self.n_kv_head != self.n_head
        if gqa and expand_kv_heads(q):
            k, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k, v))
            gqa = False
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, C)
        return dropout(self.wo(y), self.dropout, self.training)


class SwiGLU(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x), its output dropped out with ``cfg.dropout`` in training."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.w1 = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.w2 = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.dropout, self.training)


class Block(nn.Module):
    """One pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(nn.Module):
    """Llama-style decoder. ``forward(input_ids (B, T)) -> logits (B, T, vocab_size)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(cfg.block_size, cfg.d_model // cfg.n_head, cfg.rope_theta)
        # Non-persistent: derived from the config, so checkpoints stay small and shape-agnostic.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._rope_dtype = cos.dtype  # the dtype the tables were computed in (see _apply)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """After a cast of the module (Lightning's ``bf16-true``, ``16-true`` and ``64-true`` call ``.to(dtype)``),
        recompute the RoPE tables from the config in :func:`compute_dtype` of the new dtype: a bf16 table is off by
        up to 2e-3 (1.2e-3 relative error of a rotated vector, on top of bf16's own rounding of it), and under
        ``64-true`` a cast of the fp32 table kept its fp32 error."""
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != self._rope_dtype and not self.rope_cos.is_meta:
            cos, sin = rope_cache(self.config.block_size, self.config.d_model // self.config.n_head,
                                  self.config.rope_theta, compute_dtype(self.rope_cos.dtype))
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
            self._rope_dtype = cos.dtype
        return self

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2*n_layer)."""
        cfg = self.config
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layer) if cfg.depth_scaled_init else cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # RMSNorm weights keep their ones
            std = out_std if name.endswith(("attn.wo.weight", "mlp.w2.weight")) else cfg.init_std
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:  # a 1-D sequence failed with "not enough values to unpack"
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}; "
                             f"one sequence is input_ids[None]")
        B, T = input_ids.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds model block_size {self.config.block_size}")
        x = dropout(self.tok_embeddings(input_ids), self.config.dropout, self.training)  # (B, T, C)
        # cos + i sin, (1, 1, T, hs/2): built per forward from real buffers (buffers stay real so that
        # DDP/FSDP can broadcast and cast them like any other).
        dtype = compute_dtype(self.rope_cos.dtype)
        rope = torch.complex(self.rope_cos[:T].to(dtype), self.rope_sin[:T].to(dtype))[None, None]
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.norm(x))  # (B, T, V)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
        generator: torch.Generator | None = None, use_cache: bool = True, on_token=None, top_p: float | None = None,
    ) -> torch.Tensor:
        """Autoregressive sampling (temperature, optional top-k and top-p); returns prompt + new tokens. Runs in eval
        mode (no dropout) and gives the module its mode back.

        ``temperature=0`` (or one below fp32's smallest normal, 1.2e-38) is greedy; ``top_k`` None or 0 samples among
        all tokens; ``top_p`` (nucleus sampling) keeps the most likely tokens, after top-k and temperature, down to the
        first whose cumulative probability reaches it (None or 1: all). Each token is drawn from the last
        ``block_size`` tokens. ``use_cache`` keeps the keys and values
        of earlier positions (:mod:`lit_dtrain.models.kv_cache`): the same tokens, the logits equal to fp32
        rounding; ``False`` runs the whole context through :meth:`forward` for every token. ``on_token``, if given,
        is called with each step's new tokens, ``(batch, 1)``, as they are drawn (``generate.py`` streams them)."""
        check_sampling(max_new_tokens, temperature, top_k, prefix="generate: ", top_p=top_p)
        if not is_flag(use_cache):  # 'false' is truthy: it sampled with the cache
            raise ValueError(f"generate: use_cache must be True or False, got {use_cache!r} ({type_name(use_cache)})")
        use_cache = bool(use_cache)
        shape = tuple(input_ids.shape)
        if input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError(f"generate: input_ids must be (batch, tokens) with at least one token, got shape {shape}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"generate: input_ids must hold integer token ids, got {input_ids.dtype}")
        lo, hi, vocab = int(input_ids.min()), int(input_ids.max()), self.config.vocab_size
        if lo < 0 or hi >= vocab:
            raise ValueError(f"generate: token ids must be in [0, {vocab}), got {hi if hi >= vocab else lo}")
        top_k = top_k or None
        top_p = None if top_p is None or top_p >= 1 else float(top_p)  # 1 keeps every token: no filter
        input_ids = input_ids.long()  # uint8 (bytes: torch.frombuffer) and int16 ids were the embedding's RuntimeError
        modes = [(m, m.training) for m in self.modules()]
        self.eval()  # dropout off: a model left in train mode sampled through random dropout masks
        try:
            return self._sample(input_ids, max_new_tokens, temperature, top_k, top_p, generator, use_cache, on_token)
        finally:
            for m, training in modes:
                m.training = training

    def _sample(self, input_ids, max_new_tokens, temperature, top_k, top_p, generator, use_cache,
                on_token) -> torch.Tensor:
        from lit_dtrain.models.kv_cache import DecodeState, cacheable

        state = None
        if use_cache and cacheable(self):
            state = DecodeState(self, input_ids.size(1) + max_new_tokens)
        for _ in range(max_new_tokens):
            if state is not None:
                logits = state.logits(input_ids).float()
            else:
                logits = self(input_ids[:, -self.config.block_size :])[:, -1, :].float()
            if temperature < torch.finfo(logits.dtype).tiny:  # 0, or below fp32's range: the greedy limit
                nxt = logits.argmax(-1, keepdim=True)
            else:
                if top_k is not None:  # on the logits themselves: divided by a huge temperature they underflow to 0,
                    # all tied with the k-th, and every token was kept. Tokens tied with the k-th stay (HF, nanoGPT)
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                # the max at 0 first: a tiny temperature gives -inf, not inf (softmax of inf - inf was NaN); one past
                # fp32's range is its max (in fp32 it was inf, and the masked -inf / inf NaN)
                t = min(temperature, torch.finfo(logits.dtype).max)
                logits = (logits - logits.amax(-1, keepdim=True)) / t
                if top_p is not None:  # after the temperature, as HF's TopPLogitsWarper
                    logits = nucleus(logits, top_p)
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            input_ids = torch.cat([input_ids, nxt], dim=1)
            if on_token is not None:
                on_token(nxt)
        return input_ids


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` (batch, vocab) with -inf outside each row's nucleus: its most likely tokens, down to the first at
    which their cumulative probability reaches ``top_p`` (that one included, so the most likely is always kept)."""
    probs, order = F.softmax(logits, -1).sort(dim=-1, descending=True, stable=True)  # (B, V), most likely first
    outside = probs.cumsum(-1) - probs >= top_p  # the tokens before it already hold top_p
    return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
