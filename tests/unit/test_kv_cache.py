"""The k/v cache of ``Llama.generate`` (lit_dtrain.models.kv_cache): the tokens of the uncached path, which runs the
whole context through ``forward`` for every token (``use_cache=False``)."""

import pytest
import torch

from lit_dtrain.models import build_llama
from lit_dtrain.models.kv_cache import DecodeState
from lit_dtrain.models.llama import Attention


def tiny(**kw):
    # init_std 0.5: logits spread as a trained model's (no near-ties decided by rounding), and attention that moves
    # them (at 0.02 greedy decoding repeated the last prompt token whatever attention computed)
    cfg = dict(vocab_size=257, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, init_std=0.5)
    cfg.update(kw)
    torch.manual_seed(0)
    return build_llama(**cfg).eval()


PROMPTS = torch.tensor([[5, 6, 7, 8, 9], [200, 3, 3, 41, 17]])


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_greedy_cached_tokens_are_the_uncached_tokens_past_block_size(n_kv_head):
    """Two prompts of 5, 30 new tokens in a block of 16: 11 cached steps, then the sliding window; MHA and GQA."""
    m = tiny(n_kv_head=n_kv_head)
    cached = m.generate(PROMPTS, 30, temperature=0)
    uncached = m.generate(PROMPTS, 30, temperature=0, use_cache=False)
    assert cached.shape == (2, 35) and torch.equal(cached, uncached)
    assert not torch.equal(cached[0, 5:], cached[1, 5:])  # the rows are not one row twice


def test_seeded_sampling_draws_the_uncached_tokens():
    m = tiny()
    for temperature, top_k in ((0.8, 40), (1.0, None), (1.5, 3)):
        a = m.generate(PROMPTS, 25, temperature, top_k, generator=torch.Generator().manual_seed(3))
        b = m.generate(PROMPTS, 25, temperature, top_k, generator=torch.Generator().manual_seed(3), use_cache=False)
        assert torch.equal(a, b), (temperature, top_k)


def test_a_prompt_longer_than_the_block_and_one_that_fills_it():
    m = tiny()
    for length in (16, 15, 40):
        prompt = torch.randint(0, 257, (1, length), generator=torch.Generator().manual_seed(length))
        a = m.generate(prompt, 6, temperature=0)
        assert torch.equal(a, m.generate(prompt, 6, temperature=0, use_cache=False)) and a.shape == (1, length + 6)


def test_cached_logits_are_the_forward_logits_of_the_last_position():
    """Each cached step (a 1-token query at its RoPE position) against the full forward's last position, to fp32
    rounding; a prefill of several new tokens after cached ones (the masked case) too; past the block, the window's
    forward itself."""
    m = tiny(n_kv_head=1)
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        state = DecodeState(m, 24)
        for t in [4, *range(5, 12), 15, 16]:  # 12..15 is a chunk of 4 new tokens after 11 cached ones
            got, want = state.logits(ids[:, :t]), m(ids[:, :t])[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)  # |logits| up to ~10: fp32 rounding
            assert state.pos == t
        for t in (17, 24):  # slid: a forward of the last 16 tokens, bitwise
            assert torch.equal(state.logits(ids[:, :t]), m(ids[:, t - 16:t])[:, -1])
        assert state.keys == [] and state.values == []  # the cache is let go once the window slides
        fresh = DecodeState(m, 24)
        fresh.logits(ids[:, :5])
        with pytest.raises(ValueError, match="3 tokens given, 5 already cached"):
            fresh.logits(ids[:, :3])


def test_the_cache_runs_only_the_new_positions_and_forward_is_not_called():
    """The point of the cache: one forward of the prompt, then one position per token (not the context again)."""
    m = tiny()
    seen = []
    for block in m.blocks:
        block.attn.wq.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    m.generate(PROMPTS, 8, temperature=0)
    assert seen == [5, 5] + [1, 1] * 7 and calls == []  # the last token drawn needs no forward of itself
    seen.clear()
    m.generate(PROMPTS, 8, temperature=0, use_cache=False)
    assert seen == [t for t in range(5, 13) for _ in range(2)] and len(calls) == 8


def test_a_model_with_wrapped_blocks_is_sampled_without_the_cache():
    """Blocks that are not plain Blocks (an FSDP unit, a wrapper module) run through forward, as before."""

    class Wrapper(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.inner = block

        def forward(self, x, rope):
            return self.inner(x, rope)

    m = tiny()
    want = m.generate(PROMPTS, 6, temperature=0)
    m.blocks = torch.nn.ModuleList(Wrapper(b) for b in m.blocks)
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    assert torch.equal(m.generate(PROMPTS, 6, temperature=0), want) and len(calls) == 6


def test_a_subclass_of_attention_is_sampled_through_its_own_forward():
    """The cache re-implements Attention.forward: a subclass's forward (here one that scales its output) would be
    skipped, and the text drawn from another model than the one trained."""

    class Scaled(Attention):
        def forward(self, x, rope):
            return 3.0 * super().forward(x, rope)

    m = tiny()
    for block in m.blocks:
        scaled = Scaled(m.config)
        scaled.load_state_dict(block.attn.state_dict())
        block.attn = scaled
    want = m.generate(PROMPTS, 20, temperature=0, use_cache=False)
    assert torch.equal(m.generate(PROMPTS, 20, temperature=0), want)
    assert not torch.equal(tiny().generate(PROMPTS, 20, temperature=0), want)  # the scale changes the text


def test_training_mode_is_restored_and_bf16_weights_sample_with_the_cache():
    m = tiny(dropout=0.1).train()
    a = m.generate(PROMPTS, 6, temperature=0)
    assert m.training and all(mod.training for mod in m.modules())
    assert torch.equal(a, m.generate(PROMPTS, 6, temperature=0, use_cache=False))
    b16 = tiny().to(torch.bfloat16)
    out = b16.generate(PROMPTS, 6, temperature=0)
    assert out.shape == (2, 11) and out.dtype == torch.long


def test_use_cache_that_is_not_a_bool_is_refused():
    """use_cache='false' (a string, truthy) sampled with the cache without a word."""
    with pytest.raises(ValueError, match=r"^generate: use_cache must be True or False, got 'false' \(str\)$"):
        tiny().generate(PROMPTS, 2, temperature=0, use_cache="false")


def test_use_cache_may_be_a_numpy_bool():
    """use_cache=np.False_ (a flag read from an array) was refused as 'got np.False_ (bool)', naming numpy's bool
    as if it were Python's: it is taken, and np.False_ samples uncached (the same greedy tokens)."""
    import numpy as np

    m = tiny()
    assert torch.equal(m.generate(PROMPTS, 3, temperature=0, use_cache=np.False_),
                       m.generate(PROMPTS, 3, temperature=0, use_cache=True))
    with pytest.raises(ValueError, match=r"^generate: use_cache must be True or False, got np.str_\('no'\) "
                                         r"\(numpy.str_\)$"):
        m.generate(PROMPTS, 2, temperature=0, use_cache=np.str_("no"))
