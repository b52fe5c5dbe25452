"""A tokenizer of one's own in the token cache: its ids are stored as uint16, whatever integer type it returns."""

from __future__ import annotations

import numpy as np
import pytest

from lit_dtrain.data import CorpusError, CorpusSource, build_token_cache


class _Words:
    """Word ids as numpy's default int64, as most tokenizers of one's own return them."""

    name = "words-test"
    eos_id = 0

    def __init__(self, vocab_size: int = 1000, offset: int = 1) -> None:
        self.vocab_size, self.offset = vocab_size, offset

    def encode(self, data, add_eos: bool = False):
        ids = [len(word) + self.offset for word in bytes(data).split()]
        return np.array(ids + ([self.eos_id] if add_eos else []))


def _corpus(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(3):
        (tmp_path / "c" / f"{i}.txt").write_text(" ".join(["ab", "abc", "a" * (i + 1)] * 20))
    return CorpusSource(name="w", kind="files", paths=[str(tmp_path / "c")])


def test_int64_ids_are_cached_as_the_ids(tmp_path):
    """They were written as their bytes: each id and three zero tokens, a stream 4x long (244 tokens for 61 ids)."""
    splits = build_token_cache(_corpus(tmp_path), tmp_path / "cache", 9, 0.3, tokenizer=_Words(), progress=False)
    tokens = np.concatenate([splits.train, splits.val])
    assert len(tokens) == 3 * 61
    assert sorted(set(tokens.tolist())) == [0, 2, 3, 4]


@pytest.mark.parametrize("vocab_size, offset, bad", [(1000, -5, -4), (3, 1, 4), (100_000, 70_000, 70_003)])
def test_ids_the_cache_or_the_vocab_cannot_hold_are_refused(tmp_path, vocab_size, offset, bad):
    message = rf"tokenizer 'words-test': encode\(\) returned token id {bad}, outside 0\.\."
    with pytest.raises(CorpusError, match=message):
        build_token_cache(_corpus(tmp_path), tmp_path / "cache", 9, 0.3, tokenizer=_Words(vocab_size, offset),
                          progress=False)


def test_a_cache_written_before_ids_were_cast_is_rebuilt(tmp_path, monkeypatch):
    """A cache of int64 ids written byte for byte (732 tokens for 183 ids) was reused under the same key."""
    from lit_dtrain.data import token_cache

    with monkeypatch.context() as old:  # the build before 3c00409: the key it had, the ids written as they were
        old.setattr(token_cache, "ByteTokenizer", _Words)
        old.setattr(token_cache, "as_token_ids", lambda ids, tokenizer: np.asarray(ids))
        corpus = _corpus(tmp_path)
        stale = build_token_cache(corpus, tmp_path / "cache", 9, 0.3, tokenizer=_Words(), progress=False)
    assert len(stale.train) + len(stale.val) == 4 * 3 * 61
    splits = build_token_cache(corpus, tmp_path / "cache", 9, 0.3, tokenizer=_Words(), progress=False)
    assert len(splits.train) + len(splits.val) == 3 * 61


class _Bytes(_Words):
    """A bytewise tokenizer of one's own: the cache appends its ``eos_id`` after each file itself."""

    bytewise = True

    def encode(self, data, add_eos: bool = False):
        return np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int64)


@pytest.mark.parametrize("eos_id, vocab_size, message", [
    (70_000, 100_000, r"eos_id 70000 is outside 0\.\.65535 \(its vocab_size is 100000;"),  # numpy 2: OverflowError
    (300, 300, r"eos_id 300 is outside 0\.\.299 \(its vocab_size is 300;"),  # was written as it was
    (-1, 300, r"eos_id -1 is outside 0\.\.299"),
    (256.0, 300, r"eos_id must be an integer token id, got 256\.0"),
])
def test_a_bytewise_tokenizers_eos_id_the_cache_cannot_hold_is_refused(tmp_path, eos_id, vocab_size, message):
    tokenizer = _Bytes(vocab_size)
    tokenizer.eos_id = eos_id
    with pytest.raises(CorpusError, match=rf"^tokenizer 'words-test': {message}"):
        build_token_cache(_corpus(tmp_path), tmp_path / "cache", 9, 0.3, tokenizer=tokenizer, progress=False)
    assert not list((tmp_path / "cache").glob("*/train.bin"))  # refused before a cache was written


def test_a_bytewise_tokenizers_eos_id_ends_each_file(tmp_path):
    tokenizer = _Bytes(300)
    tokenizer.eos_id = 299
    splits = build_token_cache(_corpus(tmp_path), tmp_path / "cache", 9, 0.3, tokenizer=tokenizer, progress=False)
    tokens = np.concatenate([splits.train, splits.val])
    assert (tokens == 299).sum() == 3 and tokens.dtype == np.uint16
