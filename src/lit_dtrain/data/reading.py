"""Reading corpus files: their bytes in chunks (a UTF-8 byte-order mark at the start left out), their content
hash, and what their first bytes say about their encoding (UTF-16 or UTF-32 text, text that is not UTF-8), for the
token cache's warnings."""

from __future__ import annotations

import codecs
import hashlib
import os
import re
from pathlib import Path

from lit_dtrain.data.corpus import CorpusError

READ_CHUNK_BYTES = 1 << 26  # corpus files are read 64 MB at a time: a huge file never is in memory whole


def _chunks(path: Path, left_out: list[int] | None = None):
    """The bytes of ``path``, READ_CHUNK_BYTES at a time, without a UTF-8 byte-order mark at its start (its length
    is appended to ``left_out`` when one was dropped); :class:`CorpusError` naming a file that cannot be read.

    A BOM (EF BB BF, which Windows editors write) is a signature, not text: read as it is, every such document
    began with those 3 tokens after EOS, so the model learned to emit them (an invisible U+FEFF) at each document
    start. It goes as ``open(encoding='utf-8-sig')`` drops it; every other byte stays as it is, including a
    U+FEFF inside the text and UTF-16/UTF-32 BOMs (those files are named in a warning)."""
    try:
        with open(path, "rb") as f:
            size = min(READ_CHUNK_BYTES, os.fstat(f.fileno()).st_size + 1)  # read(n) allocates n bytes up front
            chunk = f.read(max(size, len(codecs.BOM_UTF8)))
            if chunk.startswith(codecs.BOM_UTF8):
                chunk = chunk[len(codecs.BOM_UTF8) :]
                if left_out is not None:
                    left_out.append(len(codecs.BOM_UTF8))
            while chunk:
                yield chunk
                chunk = f.read(size)
    except OSError as e:  # permission denied, is a directory, I/O error ...
        raise CorpusError(f"cannot read corpus file {str(path)!r}: {e.strerror or e}") from e


def _hash_file(path: Path, on_chunk=None) -> tuple[bytes, int, bytes, int]:
    """``(sha256 digest, size, first 8192 bytes, start)`` of ``path``'s text, read in chunks: ``start`` is the
    offset in the file where the text (and ``head``) starts, 3 after a UTF-8 byte-order mark, else 0. ``on_chunk``
    is called with each chunk's length (a progress bar's ``update``)."""
    digest, size, head, left_out = hashlib.sha256(), 0, b"", []
    for chunk in _chunks(path, left_out):
        digest.update(chunk)
        size += len(chunk)
        if on_chunk is not None:
            on_chunk(len(chunk))
        if len(head) < 8192:
            head = (head + chunk[:8192])[:8192]
    if on_chunk is not None and left_out:  # the BOM is in the file's size, the bar's total
        on_chunk(sum(left_out))
    return digest.digest(), size, head, sum(left_out)


_BOMS = (  # UTF-32 first: its little-endian BOM starts with UTF-16's
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def wide_encoding(head: bytes) -> str | None:
    """``'UTF-16'``/``'UTF-32'`` (with a byte-order mark), ``'UTF-16LE'`` ... (without one), or None: the encoding
    of a text file that starts with ``head``, when it is UTF-16 or UTF-32 rather than UTF-8 or binary. Without a
    BOM a file counts only when it has NUL bytes and ``head`` decodes to printable text, at least half of it ASCII
    (Latin-script text in UTF-16 has a NUL in every other byte; binary bytes decode to control or unassigned
    characters)."""
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name
    if b"\0" not in head:
        return None
    for name in ("UTF-32LE", "UTF-32BE", "UTF-16LE", "UTF-16BE"):
        try:  # final=False: head may end inside a character
            text = codecs.getincrementaldecoder(name)("strict").decode(head, final=False)
        except UnicodeDecodeError:
            continue
        text = re.sub(r"[\t\n\r]", "", text)
        if text and text.isprintable() and sum(c.isascii() for c in text) * 2 >= len(text):
            return name
    return None


def _not_utf8_at(head: bytes) -> int | None:
    """The offset of the first byte of ``head`` (a file's first bytes) that is not UTF-8, or None; a character cut
    at the end of ``head`` counts as UTF-8."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(head, final=False)
    except UnicodeDecodeError as e:
        return e.start
    return None
