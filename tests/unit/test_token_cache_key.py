"""The token cache's key covers every setting its streams depend on: a cache dir that holds the cache of another
setting gives what a fresh cache dir gives. Without ``val_fraction`` in the key the first split was reused for every
other fraction; without ``min_tokens`` (one window, ``block_size + 1``) a by-document split was reused where the
longer window needs the tail split; without the tokenizer's name one tokenizer's ids were read as another's."""

from __future__ import annotations

import numpy as np
import pytest

from lit_dtrain.data.corpus import CorpusSource
from lit_dtrain.data.token_cache import build_token_cache
from tests.conftest import make_corpus


class _Words:
    """A tokenizer of one's own: a word's length as its id."""

    eos_id = 0
    vocab_size = 1000

    def __init__(self, name: str) -> None:
        self.name = name

    def encode(self, data, add_eos: bool = False):
        step = 1 if self.name == "words-a" else 2
        return np.array([min(step * len(w), 999) for w in bytes(data).split()] + ([0] if add_eos else []))


SETTINGS = {  # (what differs, the first build's arguments, the second's)
    "val_fraction": (dict(min_tokens=33, val_fraction=0.2), dict(min_tokens=33, val_fraction=0.6)),
    "min_tokens": (dict(min_tokens=33, val_fraction=0.1), dict(min_tokens=12000, val_fraction=0.1)),
    "tokenizer": (dict(min_tokens=9, val_fraction=0.3, tokenizer=_Words("words-a")),
                  dict(min_tokens=9, val_fraction=0.3, tokenizer=_Words("words-b"))),
    "byte_tokenizer": (dict(min_tokens=9, val_fraction=0.3), dict(min_tokens=9, val_fraction=0.3,
                                                                  tokenizer=_Words("words-a"))),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_cache_of_another_setting_is_not_reused(tmp_path, setting):
    source = CorpusSource(name="t", kind="files", paths=[str(make_corpus(tmp_path / "corpus", n_files=16))])
    before, after = SETTINGS[setting]
    first = build_token_cache(source, tmp_path / "shared", progress=False, **before)
    again = build_token_cache(source, tmp_path / "shared", progress=False, **after)
    fresh = build_token_cache(source, tmp_path / "fresh", progress=False, **after)
    assert not (np.array_equal(first.train, fresh.train) and np.array_equal(first.val, fresh.val))  # (they differ)
    assert np.array_equal(again.train, fresh.train) and np.array_equal(again.val, fresh.val)
    assert again.meta == fresh.meta


def test_val_fraction_is_the_share_of_documents_held_out(tmp_path):
    """data.val_fraction=0.1 holds out about a tenth of the documents (the other 90 % inverted were not seen: the
    tests took the held-out documents from the same rule)."""
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i in range(400):
        (corpus / f"{i:03d}.txt").write_text(f"document {i:03d} " * 10)  # 130 bytes each, 131 tokens with its EOS
    source = CorpusSource(name="d", kind="files", paths=[str(corpus)])
    splits = build_token_cache(source, tmp_path / "cache", 33, val_fraction=0.1, progress=False)
    assert splits.meta["split"] == "by_document"
    held_out = len(splits.val) / 131
    assert held_out == int(held_out) and 25 <= held_out <= 55, held_out  # binomial(400, 0.1): 40 +- 6
