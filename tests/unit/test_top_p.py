"""Nucleus (top-p) sampling in ``Llama.generate`` and ``scripts/generate.py --top-p``: a drawn token is always inside
the nucleus (the most likely tokens, after top-k and temperature, down to the first whose cumulative probability
reaches ``top_p``), ``top_p=1`` is no filter, and the k/v cache draws the uncached tokens. generate.py had no
``--top-p`` (argparse's 'unrecognized arguments: --top-p 0.9')."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.models.llama import nucleus
from tests.conftest import load_script
from tests.unit.test_kv_cache import PROMPTS, tiny
from tests.unit.test_script_checkpoint_errors import _tiny_checkpoint, script_error


def test_the_nucleus_is_the_likeliest_tokens_down_to_the_one_that_reaches_top_p():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()  # most likely first: 1, 3, 0, 2 (cumulative .5 .8 .95 1)
    for top_p, kept in ((0.3, [1]), (0.5, [1]), (0.7, [1, 3]), (0.8, [1, 3]), (0.9, [0, 1, 3]), (0.99, [0, 1, 2, 3])):
        got = nucleus(logits, top_p)
        assert torch.isfinite(got[0]).nonzero().flatten().tolist() == kept, top_p
        assert torch.equal(got[0, kept], logits[0, kept])  # the kept logits untouched: renormalized by the softmax


def _nucleus_of(model, ids, temperature, top_k, top_p) -> torch.Tensor:
    """The tokens (batch, vocab) bool that may follow ``ids``: its uncached forward's logits, filtered as generate
    filters them."""
    with torch.no_grad():
        logits = model(ids[:, -model.config.block_size:])[:, -1].float()
    if top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1, None], float("-inf"))
    return torch.isfinite(nucleus((logits - logits.amax(-1, keepdim=True)) / temperature, top_p))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, 0.5), (1.5, 40, 0.8), (0.7, None, 0.95)])
def test_no_token_outside_the_nucleus_is_ever_drawn(temperature, top_k, top_p):
    m = tiny()
    prompts = PROMPTS.repeat(16, 1)  # 32 rows, 20 new tokens each: 640 draws
    seeded = {"generator": torch.Generator().manual_seed(7), "temperature": temperature, "top_k": top_k}
    out = m.generate(prompts, 20, top_p=top_p, use_cache=False, **seeded)
    unfiltered = m.generate(prompts, 20, use_cache=False, **{**seeded, "generator": torch.Generator().manual_seed(7)})
    outside_unfiltered, sizes = 0, []
    for t in range(prompts.size(1), out.size(1)):
        allowed = _nucleus_of(m, out[:, :t], temperature, top_k, top_p)
        assert allowed.gather(1, out[:, t, None]).all(), f"a token outside the nucleus at position {t}"
        sizes += allowed.sum(1).tolist()
        allowed = _nucleus_of(m, unfiltered[:, :t], temperature, top_k, top_p)
        outside_unfiltered += int((~allowed.gather(1, unfiltered[:, t, None])).sum())
    assert 1 <= min(sizes) and max(sizes) < (top_k or 257)  # the filter cut tokens, and never all of them
    assert outside_unfiltered > 0  # without top_p the same draws leave the nucleus: the check above can fail


def test_top_p_one_is_no_filter_and_the_cache_draws_the_uncached_tokens():
    m = tiny()
    for temperature, top_k, top_p in ((0.8, 40, 0.9), (1.0, None, 0.6), (1.5, 3, 0.5), (1.0, None, 1.0)):
        def drawn(temperature=temperature, top_k=top_k, **kw):
            return m.generate(PROMPTS, 25, temperature, top_k, generator=torch.Generator().manual_seed(3), **kw)

        cached = drawn(top_p=top_p)
        assert torch.equal(cached, drawn(top_p=top_p, use_cache=False)), (temperature, top_k, top_p)
        if top_p == 1.0:
            assert torch.equal(cached, drawn()) and torch.equal(cached, drawn(top_p=None))
        else:
            assert not torch.equal(cached, drawn())  # the nucleus changed what was drawn


def test_top_p_is_sampled_as_nucleus_of_the_softmax_not_of_the_raw_logits():
    """The temperature comes first (HF's order): at temperature 2 a wider nucleus than at 1."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.isfinite(nucleus(logits, 0.8)).sum() == 2  # softmax .64 .24 .09 .03
    assert torch.isfinite(nucleus(logits / 2, 0.8)).sum() == 3  # .47 .29 .17 .07
    assert F.softmax(nucleus(logits, 0.5), -1)[0].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan"])
def test_generate_py_refuses_a_top_p_outside_0_1(tmp_path, capsys, value):
    with script_error(capsys, rf"--top-p must be a number in \(0, 1\] \(1: all tokens\), got {value}"):
        load_script("generate").main([str(tmp_path / "never_read.ckpt"), "--top-p", value])


def test_generate_py_top_p_draws_what_the_model_draws_with_that_seed(tmp_path, capsys):
    from lit_dtrain.data import ByteTokenizer
    from lit_dtrain.end_sample import generated_text
    from lit_dtrain.schedules.workflows import model_from_checkpoint

    ckpt = str(_tiny_checkpoint(tmp_path / "tiny.ckpt"))
    args = [ckpt, "--prompt", "ab", "--max-new-tokens", "12", "--device", "cpu", "--seed", "5", "--top-k", "0"]
    texts = {}
    for top_p in ("0.3", "1.0", None):
        load_script("generate").main(args + (["--top-p", top_p] if top_p else []))
        texts[top_p] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    model, _ = model_from_checkpoint(ckpt)
    ids = torch.tensor([[ord("a"), ord("b")]])
    want = model.generate(ids, 12, temperature=0.8, top_p=0.3, generator=torch.Generator().manual_seed(5))
    assert texts["0.3"] == generated_text(ByteTokenizer(), want[0], b"ab")
    assert texts["1.0"] == texts[None] != texts["0.3"]
