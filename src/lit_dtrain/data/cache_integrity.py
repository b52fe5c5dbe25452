"""Whether a built token cache is intact: the sizes of its ``train.bin``/``val.bin`` against the token counts in
its ``meta.json``, and their CRC-32s against the ones recorded there at the build (damage that keeps the sizes: a
zeroed block, a changed byte). A cache built before the CRC-32s were recorded gets them at its first load."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import numpy as np

from lit_dtrain.utils.atomic import write_atomically

log = logging.getLogger("lit_dtrain.data.corpus")  # the token cache's logger

TOKEN_FILES = ("train.bin", "val.bin")


def crc32_of(path: Path) -> str:
    """The CRC-32 of ``path``'s bytes, as 8 hex digits (zlib's, ~1 GB/s: it catches damage, not tampering)."""
    crc, buffer = 0, bytearray(1 << 18)  # 256 KiB at a time: a build holds one document at a time, no more
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def crc32s(out_dir: Path) -> dict[str, str]:
    """``{file name: CRC-32}`` of the token files in ``out_dir``, for its ``meta.json``."""
    return {name: crc32_of(out_dir / name) for name in TOKEN_FILES}


def cache_problem(out_dir: Path) -> str | None:
    """What is wrong with a built cache dir (unreadable meta.json, a .bin file whose size does not match the
    token count recorded in meta.json, or whose CRC-32 does not match the one recorded there), or None when it is
    intact. A meta.json without CRC-32s (a cache built before they were recorded) is checked by its sizes."""
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        expected = {"train.bin": int(meta["train_tokens"]), "val.bin": int(meta["val_tokens"])}
        crcs = {name: str(meta["crc32"][name]) for name in TOKEN_FILES} if "crc32" in meta else {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json unreadable: {type(e).__name__}: {e}"
    itemsize = np.dtype(np.uint16).itemsize
    for name, tokens in expected.items():
        try:
            size = (out_dir / name).stat().st_size
        except OSError as e:
            return f"{name}: {e.strerror or e}"
        if size != tokens * itemsize:
            return f"{name} holds {size} bytes, meta.json records {tokens} tokens ({tokens * itemsize} bytes)"
    for name, crc in crcs.items():
        try:
            actual = crc32_of(out_dir / name)
        except OSError as e:  # an I/O error reading it
            return f"{name}: {e.strerror or e}"
        if actual != crc:
            return f"{name} has CRC-32 {actual}, meta.json records {crc}: its bytes changed after the build"
    return None


def with_crc32s(out_dir: Path, meta: dict) -> dict:
    """``meta`` of the cache in ``out_dir``, with its files' CRC-32s recorded in its ``meta.json`` (atomically)
    when it was built before they were: a new cache format (a new key) would have rebuilt every cache once and
    made the sampler state of every checkpoint (its windows' dataset key) refuse to resume. Damage from before this
    load cannot be told; from here on it is. Where meta.json cannot be written the cache stays checked by sizes."""
    if "crc32" in meta:
        return meta
    meta = {**meta, "crc32": crc32s(out_dir)}
    text = json.dumps(meta, indent=2)
    try:
        write_atomically(out_dir / "meta.json", lambda tmp: tmp.write_text(text))
    except OSError as e:  # a read-only shared cache
        log.info("token cache %s predates CRC-32s and its meta.json cannot be updated (%s): checked by sizes only",
                 out_dir, e.strerror or e)
    else:
        log.info("token cache %s: recorded its files' CRC-32s in meta.json (it was built before they were)", out_dir)
    return meta
