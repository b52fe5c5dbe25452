"""Byte-level tokenizer: 256 byte values plus one EOS token, so it encodes any input."""

from __future__ import annotations

import numpy as np

from lit_dtrain.data.corpus import CorpusError


class ByteTokenizer:
    """Maps text (or raw bytes) to token ids 0..255 and appends EOS (256) between documents.

    The token dtype is uint16, which is what the memory-mapped token cache stores.
    """

    name = "byte-v1"  # part of the token-cache key: change it if the encoding ever changes
    vocab_size = 257
    eos_id = 256
    bytewise = True  # each byte is one token: a file encodes chunk by chunk (the token cache relies on it)

    def encode(self, data: str | bytes, add_eos: bool = False) -> np.ndarray:
        """Token ids (uint16) of ``data``; with ``add_eos`` an EOS id is appended."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        if add_eos:
            ids = np.append(ids, np.uint16(self.eos_id))
        return ids

    def prompt_ids(self, text: str) -> np.ndarray:
        """Token ids to start generation from: ``text``, or EOS alone for an empty prompt (a document start)."""
        ids = self.encode(text)
        return ids if len(ids) else np.array([self.eos_id], dtype=np.uint16)

    def decode(self, ids) -> str:
        """Text of token ids; EOS becomes a newline and invalid UTF-8 is replaced, never raised. An id that is no
        byte and not EOS (a model with ``vocab_size`` above 257 can sample one) becomes U+FFFD; it was dropped."""
        return self.to_bytes(ids).decode("utf-8", errors="replace")

    def to_bytes(self, ids) -> bytes:
        """The UTF-8 bytes :meth:`decode` decodes (a stream decodes them piece by piece to the same text)."""
        out = bytearray()
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == self.eos_id:
                out += b"\n"
            elif 0 <= i < 256:
                out.append(i)
            else:
                out += "\ufffd".encode()
        return bytes(out)


def as_token_ids(ids, tokenizer) -> np.ndarray:
    """``ids``, what ``tokenizer.encode`` returned, as the token cache's uint16 array; :class:`CorpusError` for ids it
    cannot hold. The cache wrote the returned array's bytes as they were: a tokenizer of one's own that returned
    numpy's default int64 ids had each written as four uint16 tokens (the id and three zeros, a stream 4x long trained
    on without a word), and an id past 65535 would wrap around."""
    arr = np.asarray(ids)
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint16)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise CorpusError(f"tokenizer {name!r}: encode() must return a 1-D sequence of integer token ids, got an "
                          f"array of shape {arr.shape} and dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= _id_limit(tokenizer):
        raise CorpusError(f"tokenizer {name!r}: encode() returned token id {low if low < 0 else high}, "
                          f"{_outside(tokenizer)}")
    return arr.astype(np.uint16, copy=False)


def eos_token(tokenizer) -> np.ndarray:
    """``tokenizer.eos_id`` as the token cache's one-token uint16 array (a bytewise tokenizer's documents end with
    it); :class:`CorpusError` for an id the cache or the vocabulary cannot hold. An eos_id of 70000 ended the build
    in numpy's ``OverflowError: Python integer 70000 out of bounds for uint16`` traceback, and one of 300 under a
    ``vocab_size`` of 300 was written as it was."""
    eos = getattr(tokenizer, "eos_id", None)
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    if isinstance(eos, bool) or not isinstance(eos, (int, np.integer)):
        raise CorpusError(f"tokenizer {name!r}: eos_id must be an integer token id, got {eos!r}")
    if not 0 <= int(eos) < _id_limit(tokenizer):
        raise CorpusError(f"tokenizer {name!r}: eos_id {int(eos)} is {_outside(tokenizer)}")
    return np.array([int(eos)], dtype=np.uint16)


def _id_limit(tokenizer) -> int:
    """One past the largest id the token cache holds for ``tokenizer``: its ``vocab_size``, at most 65536 (uint16)."""
    return min(int(getattr(tokenizer, "vocab_size", 1 << 16)), 1 << 16)


def _outside(tokenizer) -> str:
    vocab = int(getattr(tokenizer, "vocab_size", 1 << 16))
    return (f"outside 0..{_id_limit(tokenizer) - 1} (its vocab_size is {vocab}; the token cache stores ids as uint16, "
            "so at most 65536 of them)")
