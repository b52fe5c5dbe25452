"""Key/value cache for :meth:`Llama.generate`: the prompt runs through the model once (prefill), then each new token
alone, attending to the keys and values of the earlier positions kept per layer, at its own RoPE position.

It reads the model's weights through its submodules and leaves ``Llama.forward`` (training, validation) untouched:
the training path neither runs nor pays for any of it.

Exactness. ``generate`` conditions each token on the last ``block_size`` tokens at positions ``0 .. block_size - 1``.
While the sequence fits the block, the cached step computes what ``model(ids)[:, -1]`` computes, to fp32 rounding
(the matrix products run on one row instead of many). Once it is longer, the window slides by one token a step,
every position moves and every layer's keys and values change (the hidden states of the tokens left in the window no
longer see the one that fell out), so no cache can be reused: each such step is a full forward of the window, as it
was without the cache. The cache speeds up the tokens until the sequence fills ``block_size``.

A model whose blocks are not plain :class:`Block` s (FSDP units, wrappers that replace the module, subclasses) is
sampled without the cache: :func:`cacheable`. (A :class:`Block` whose ``forward`` an activation-checkpointing
callback patched is plain: checkpointing changes nothing without grad.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_dtrain.models.llama import Attention, Block, Llama, apply_rope, compute_dtype, expand_kv_heads


def cacheable(model) -> bool:
    """Whether :class:`DecodeState` computes what ``model`` (a ``Llama``) computes: it re-implements ``Llama.forward``,
    ``Block.forward`` and ``Attention.forward``, so none may be a subclass's (a user's Attention with a QK norm would
    be sampled without it) or a wrapper (an FSDP unit)."""
    return type(model).forward is Llama.forward and all(
        type(b) is Block and type(b.attn) is Attention for b in model.blocks)


class DecodeState:
    """The k/v cache of one ``generate`` call: ``logits(ids)`` is ``model(ids[:, -block_size:])[:, -1]``, computing
    only the positions it has not seen. Holds (B, n_kv_head, S, head_dim) keys and values per layer, S the longest
    sequence that fits in the block (``min(block_size, prompt + max_new_tokens)``)."""

    def __init__(self, model, max_len: int) -> None:
        self.model = model
        self.size = min(model.config.block_size, max_len)
        self.keys: list[torch.Tensor] = []  # allocated at the first prefill, in the dtype and device of the keys
        self.values: list[torch.Tensor] = []
        self.pos = 0  # positions 0 .. pos - 1 are cached

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, vocab) logits of the token after ``ids`` (B, T): ``ids[:, :pos]`` must be the tokens cached so far."""
        T = ids.size(1)
        if T > self.model.config.block_size:  # the window slides: nothing cached holds (module docstring)
            self.pos, self.keys, self.values = 0, [], []  # nor will: the sequence only grows
            return self.model(ids[:, -self.model.config.block_size:])[:, -1]
        if T <= self.pos:
            raise ValueError(f"DecodeState: {T} tokens given, {self.pos} already cached")
        return self._forward(ids[:, self.pos:], self.pos)

    def _forward(self, new: torch.Tensor, start: int) -> torch.Tensor:
        model = self.model
        end = start + new.size(1)
        rope_dtype = compute_dtype(model.rope_cos.dtype)
        rope = torch.complex(model.rope_cos[start:end].to(rope_dtype), model.rope_sin[start:end].to(rope_dtype))
        x = model.tok_embeddings(new)
        for i, block in enumerate(model.blocks):
            x = x + self._attend(i, block.attn, block.attn_norm(x), rope[None, None], start)
            x = x + block.mlp(block.mlp_norm(x))
        self.pos = end
        return model.lm_head(model.norm(x[:, -1]))

    def _attend(self, layer: int, attn: Attention, x: torch.Tensor, rope: torch.Tensor, start: int) -> torch.Tensor:
        """``Attention.forward`` (eval mode) for the new positions ``start ..``, keys and values of the earlier ones
        from the cache, this step's written into it."""
        B, T, _ = x.shape
        end = start + T
        q = attn.wq(x).view(B, T, attn.n_head, attn.head_dim).transpose(1, 2)
        k = attn.wk(x).view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
        v = attn.wv(x).view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if layer == len(self.keys):  # first call: allocate this layer's cache
            shape = (B, attn.n_kv_head, self.size, attn.head_dim)
            self.keys.append(k.new_empty(shape))
            self.values.append(v.new_empty(shape))
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        k, v = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        gqa = attn.n_kv_head != attn.n_head
        if gqa and expand_kv_heads(q):  # as Attention.forward: fp32 CUDA kernels take no grouped heads
            k, v = (t.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1) for t in (k, v))
            gqa = False
        if T == 1 or start == 0:  # one query sees every cached key; a prefill from 0 is the causal square
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        else:  # new positions after cached ones: query i sees keys 0 .. start + i
            mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return attn.wo(y.transpose(1, 2).reshape(B, T, attn.n_head * attn.head_dim))
