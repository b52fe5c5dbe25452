"""Byte-level tokenizer: 256 byte values plus one EOS token, so it encodes any input."""

from __future__ import annotations

import numpy as np


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
        out = bytearray()
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == self.eos_id:
                out += b"\n"
            elif 0 <= i < 256:
                out.append(i)
            else:
                out += "\ufffd".encode()
        return out.decode("utf-8", errors="replace")
