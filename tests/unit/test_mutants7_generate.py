"""A seventh hand mutation audit: ``Llama.generate``, ``nucleus`` and the k/v cache pinned by exact results where a
single-point mutant of ``models/llama.py`` or ``models/kv_cache.py`` passed their test files (test_model.py,
test_kv_cache.py, test_top_p.py, test_model_reference.py, test_end_sample*.py, test_generate_streaming.py)."""

from __future__ import annotations

import pytest
import torch

import lit_dtrain.models.llama as llama
from lit_dtrain.models.kv_cache import DecodeState
from lit_dtrain.models.llama import nucleus
from tests.unit.test_kv_cache import PROMPTS, tiny


def test_nucleus_ties_keep_the_lower_token_ids():
    """Tied probabilities cross ``top_p`` in token-id order (a stable sort): the same tokens on every device and
    vocabulary size. An unstable sort kept other ids of the 257 tied tokens (CPU's sort reorders ties from ~257)."""
    logits = torch.zeros(2, 257)
    logits[1, ::2] = 1.0  # row 1: 129 tied tokens on top, then 128 tied tokens below them
    kept = torch.isfinite(nucleus(logits, 0.5))
    assert kept[0].nonzero().flatten().tolist() == list(range(129))  # 128/257 < 0.5 <= 129/257
    ids = kept[1].nonzero().flatten().tolist()
    top = torch.softmax(logits[1], -1)[0].item()
    n = next(i for i in range(1, 130) if i * top >= 0.5)
    assert ids == list(range(0, 2 * n, 2))  # the lowest n ids of the top level


def test_top_p_one_runs_no_filter(monkeypatch):
    """``top_p=1`` keeps every token without calling ``nucleus``: there a cumulative sum that rounds to 1.0 before the
    last token (fp32: a token of probability 1 - 1e-13 first) would cut the tail; with ``>= 1`` taken as ``> 1`` that
    tail was cut. (``nucleus`` itself is free to keep every token at 1.0: it is not pinned here.)"""
    m = tiny()
    a = m.generate(PROMPTS, 6, generator=torch.Generator().manual_seed(3), top_p=1.0)
    assert torch.equal(a, m.generate(PROMPTS, 6, generator=torch.Generator().manual_seed(3)))
    calls = []
    monkeypatch.setattr(llama, "nucleus", lambda logits, p: calls.append(p) or logits)
    m.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0), top_p=1.0)
    m.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0), top_p=1)
    assert calls == []
    m.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0), top_p=0.9)
    assert calls == [0.9, 0.9]


def test_a_top_k_above_the_vocabulary_keeps_every_token():
    """``top_k`` above ``vocab_size`` is every token, as ``top_k=None`` (torch.topk raised 'selected index k out of
    range' without the ``min``)."""
    m = tiny()
    for k in (257, 258, 10_000):
        a = m.generate(PROMPTS, 6, top_k=k, generator=torch.Generator().manual_seed(5))
        b = m.generate(PROMPTS, 6, top_k=None, generator=torch.Generator().manual_seed(5))
        assert torch.equal(a, b), k


def test_a_token_id_equal_to_the_vocabulary_size_is_named():
    m = tiny()
    with pytest.raises(ValueError, match=r"generate: token ids must be in \[0, 257\), got 257"):
        m.generate(torch.tensor([[1, 257]]), 2)
    with pytest.raises(ValueError, match=r"generate: token ids must be in \[0, 257\), got -1"):
        m.generate(torch.tensor([[-1, 3]]), 2)
    assert m.generate(torch.tensor([[0, 256]]), 1, temperature=0).shape == (1, 3)  # both ends are ids


def test_forward_refuses_one_token_past_the_block():
    m = tiny()  # block_size 16
    assert m(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 257)
    with pytest.raises(ValueError, match=r"^sequence length 17 exceeds model block_size 16$"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_the_default_mlp_width_rounds_8_3_of_d_model_up_to_32():
    from lit_dtrain.models.llama import LlamaConfig

    widths = {d: LlamaConfig(d_model=d, n_head=4, n_kv_head=2).mlp_hidden for d in (32, 64, 128, 256, 768)}
    assert widths == {32: 96, 64: 192, 128: 352, 256: 704, 768: 2048}  # 64: 170.7 -> 192, not round's 160


def test_the_cache_holds_the_longest_sequence_that_fits_the_block_and_names_no_new_token():
    """``DecodeState`` keeps ``min(block_size, prompt + max_new_tokens)`` positions per layer (not always the block's),
    and ids with no token past the cached ones are a ValueError (an IndexError of an empty slice without the ``=``)."""
    m = tiny()  # block_size 16
    ids = torch.randint(0, 257, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        short, full = DecodeState(m, 7), DecodeState(m, 40)
        short.logits(ids), full.logits(ids)
        with pytest.raises(ValueError, match="^DecodeState: 5 tokens given, 5 already cached$"):
            short.logits(ids)
    assert [tuple(k.shape) for k in short.keys] == [(2, 2, 7, 8)] * 2 == [tuple(v.shape) for v in short.values]
    assert [tuple(k.shape) for k in full.keys] == [(2, 2, 16, 8)] * 2
