"""``lit_dtrain.models.kv_cache`` where the sixteenth hand mutation audit's single-point mutants passed its tests: the
cached decode against the model's forward with RMSNorm weights that are not all ones. Every cache test ran fresh
models, whose two norms per block are equal (ones), so a cached step that normed the MLP input with the attention's
norm computed the same logits, and the same tokens. And a ``Llama`` subclass with its own ``forward``: without the
check of ``cacheable`` on it, ``generate`` sampled through the cache what ``Llama.forward`` computes."""

from __future__ import annotations

import torch

from lit_dtrain.models import build_llama
from lit_dtrain.models.kv_cache import DecodeState


def test_cached_logits_equal_the_forward_with_distinct_norm_weights():
    """A model whose RMSNorm weights differ (each block's attention and MLP norm, and the final norm, as after
    training): each cached step's logits are the forward's last position, to fp32 rounding, and differ from those of
    the same model with the two norms of each block swapped (so the comparison can tell them apart)."""
    torch.manual_seed(0)
    m = build_llama(vocab_size=257, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, init_std=0.5).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 + 0.25)
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        state = DecodeState(m, 12)
        for t in range(5, 13):  # a prefill of 5, then one token a step
            torch.testing.assert_close(state.logits(ids[:, :t]), m(ids[:, :t])[:, -1], rtol=1e-5, atol=5e-5)
        want = m(ids)[:, -1]
        for block in m.blocks:
            block.attn_norm, block.mlp_norm = block.mlp_norm, block.attn_norm
        assert (m(ids)[:, -1] - want).abs().max() > 0.1


def test_a_llama_subclass_with_its_own_forward_is_sampled_through_it():
    """A subclass of ``Llama`` whose ``forward`` changes the logits (here: bans the token greedy decoding picks
    first, as a user's logit processor might) samples what its forward says, with the cache asked for as without it
    (the cache re-implements ``Llama.forward``; without the forward check it sampled the banned token)."""
    from lit_dtrain.models.kv_cache import cacheable
    from lit_dtrain.models.llama import Llama

    torch.manual_seed(0)
    base = build_llama(vocab_size=257, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, init_std=0.5)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    banned = int(base.generate(prompt, 1, temperature=0)[0, -1])

    class Banning(Llama):
        def forward(self, input_ids):
            logits = super().forward(input_ids)
            logits[..., banned] = float("-inf")
            return logits

    model = Banning(base.config)
    model.load_state_dict(base.state_dict())
    assert not cacheable(model)
    cached = model.generate(prompt, 6, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 6, temperature=0, use_cache=False))
    assert banned not in cached[0, 5:].tolist()
