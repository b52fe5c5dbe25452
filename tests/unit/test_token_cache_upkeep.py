"""The token cache's upkeep: the offsets its encoding warnings name, and the bound on how many caches a cache dir
keeps (old caches of an edited corpus are pruned; a cache in use by a live process never is)."""

from __future__ import annotations

import codecs

from lit_dtrain.data import CorpusSource, build_token_cache


def files_source(path, name="x") -> CorpusSource:
    return CorpusSource(name=name, kind="files", paths=[str(path)])


def test_the_offset_of_a_non_utf8_byte_counts_a_byte_order_mark(tmp_path, caplog):
    """A Latin-1 file that starts with a UTF-8 BOM: the warning named the byte 3 before it is (the BOM is left
    out of the text, and the offset was counted in the text); it names the byte's offset in the file now."""
    data = codecs.BOM_UTF8 + "café\n".encode("latin-1") * 400
    (tmp_path / "a.txt").write_bytes(data)
    with caplog.at_level("WARNING"):
        build_token_cache(files_source(tmp_path / "a.txt"), tmp_path / "cache", min_tokens=9, progress=False)
    assert data.index(b"\xe9") == 6
    assert "byte 0xe9 at offset 6" in caplog.text
