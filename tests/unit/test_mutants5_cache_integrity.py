"""The token cache's integrity check on files past one read chunk (256 KiB), from the fifth hand mutation audit: the
suite's caches are a few KiB, read in one chunk, so a CRC-32 that did not carry across chunks (only the last one's
bytes counted) passed it, and would have missed damage anywhere but in a real cache's last 256 KiB."""

from __future__ import annotations

import json
import zlib

import numpy as np

from lit_dtrain.data.cache_integrity import cache_problem, crc32_of, crc32s, with_crc32s


def build(tmp_path, train_tokens: int = 300_000, val_tokens: int = 10):  # 600 KB of train.bin: three chunks
    rng = np.random.default_rng(0)
    rng.integers(0, 50_000, train_tokens, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 50_000, val_tokens, dtype=np.uint16).tofile(tmp_path / "val.bin")
    meta = {"train_tokens": train_tokens, "val_tokens": val_tokens, "crc32": crc32s(tmp_path)}
    (tmp_path / "meta.json").write_text(json.dumps(meta))


def test_the_crc32_of_a_file_of_several_chunks_is_that_of_all_its_bytes(tmp_path):
    build(tmp_path)
    data = (tmp_path / "train.bin").read_bytes()
    assert len(data) > 2 * (1 << 18)
    assert crc32_of(tmp_path / "train.bin") == f"{zlib.crc32(data):08x}"


def test_a_byte_changed_in_the_first_chunk_of_a_large_cache_is_caught(tmp_path):
    build(tmp_path)
    assert cache_problem(tmp_path) is None
    with open(tmp_path / "train.bin", "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    problem = cache_problem(tmp_path)
    assert problem is not None and problem.startswith("train.bin has CRC-32 ") and "its bytes changed" in problem


def test_a_meta_json_whose_crc32_entry_is_not_a_mapping_is_named_unreadable(tmp_path):
    build(tmp_path, train_tokens=4)
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "crc32": ["0", "1"]}))
    assert cache_problem(tmp_path).startswith("meta.json unreadable: TypeError")


def test_a_meta_json_with_crc32s_is_taken_as_it_is_without_reading_the_files_again(tmp_path):
    build(tmp_path, train_tokens=4)
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "train.bin").unlink()  # a recomputation at every load would read it (a full pass over the cache)
    assert with_crc32s(tmp_path, meta) is meta
