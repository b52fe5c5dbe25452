"""The token cache's build shows its progress in bytes, so one huge corpus file still moves the bar."""

from __future__ import annotations

import pytest

from lit_dtrain.data import ByteTokenizer, CorpusSource, build_token_cache, reading, token_cache


class _Bar:
    """Records what a tqdm bar was told."""

    made: list[_Bar] = []

    def __init__(self, iterable=None, **kwargs) -> None:
        self.iterable, self.kwargs, self.updates = iterable, kwargs, []
        _Bar.made.append(self)

    def __iter__(self):
        return iter(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.updates.append(n)

    def close(self) -> None:
        pass


def test_one_large_file_moves_the_tokenizing_bar_chunk_by_chunk(tmp_path, monkeypatch):
    """The bar counted files: for one 3 GB corpus file it stood at 0/1 until the build was done."""
    (tmp_path / "big.txt").write_bytes(b"some corpus text\n" * 600)  # 10200 bytes: 10 chunks of 1 KiB
    monkeypatch.setattr(reading, "READ_CHUNK_BYTES", 1024)
    monkeypatch.setattr(token_cache, "tqdm", _Bar)
    _Bar.made.clear()
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "big.txt")])
    build_token_cache(source, tmp_path / "cache", min_tokens=65, val_fraction=0.1, progress=True)
    bar = next(b for b in _Bar.made if str(b.kwargs.get("desc", "")).startswith("tokenizing"))
    assert bar.kwargs["total"] == 10200 and bar.kwargs["unit"] == "B"
    assert bar.updates == [1024] * 9 + [984]


def test_one_large_file_gets_a_hashing_bar_in_bytes(tmp_path, monkeypatch):
    """The hashing bar counted files, and was off below 50 of them: one 3 GB file was hashed without a word."""
    (tmp_path / "big.txt").write_bytes(b"some corpus text\n" * 600)
    monkeypatch.setattr(reading, "READ_CHUNK_BYTES", 1024)
    monkeypatch.setattr(token_cache, "tqdm", _Bar)
    monkeypatch.setattr(token_cache, "HASH_BAR_FROM_BYTES", 10_000)  # 256 MB: too large a file for a unit test
    _Bar.made.clear()
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "big.txt")])
    build_token_cache(source, tmp_path / "cache", min_tokens=65, val_fraction=0.1, progress=True)
    bar = next(b for b in _Bar.made if str(b.kwargs.get("desc", "")).startswith("hashing"))
    assert bar.kwargs["total"] == 10200 and bar.kwargs["unit"] == "B" and bar.kwargs["disable"] is False
    assert bar.updates == [1024] * 9 + [984]


class _Whole(ByteTokenizer):
    """A tokenizer of one's own that is not bytewise: the cache reads each file whole for it."""

    name, bytewise = "whole-test", False


@pytest.mark.parametrize("tokenizer", [None, _Whole()], ids=["bytewise", "whole-files"])
def test_both_bars_reach_their_total_for_files_with_a_utf8_bom(tmp_path, monkeypatch, tokenizer):
    """The BOM's 3 bytes are in the total (the files' sizes) but were never counted: each bar ended 6 bytes short."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + b"some corpus text\n" * 300)
    for name in ("c.txt", "d.txt"):
        (tmp_path / name).write_bytes(b"other corpus text\n" * 300)
    monkeypatch.setattr(reading, "READ_CHUNK_BYTES", 1024)
    monkeypatch.setattr(token_cache, "tqdm", _Bar)
    monkeypatch.setattr(token_cache, "HASH_BAR_FROM_BYTES", 10_000)
    _Bar.made.clear()
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path)])
    build_token_cache(source, tmp_path / "cache", min_tokens=65, val_fraction=0.3, progress=True, tokenizer=tokenizer)
    bars = {str(b.kwargs["desc"]).split()[0]: b for b in _Bar.made if "desc" in b.kwargs}
    for desc in ("hashing", "tokenizing"):
        assert bars[desc].kwargs["total"] == 2 * 5103 + 2 * 5400
        assert sum(bars[desc].updates) == bars[desc].kwargs["total"], desc
