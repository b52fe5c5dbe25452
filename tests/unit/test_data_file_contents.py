"""What is in the corpus files: large files read in chunks, UTF-16/32, binary and non-UTF-8 files, a byte order
mark, a pipe."""

import os

import numpy as np
import pytest

from lit_dtrain.data import ByteTokenizer, CorpusError, CorpusSource, build_token_cache
from tests.conftest import make_corpus
from tests.unit._data_helpers import _is_val, dm_for


def test_the_token_cache_is_built_one_document_at_a_time(tmp_path):
    """Building held every file's bytes, then every token array, then their concatenation in memory at once:
    a 191 MB corpus peaked at 1.3 GB over the baseline (~7x the corpus), so a corpus of tens of GB could not be
    built. Now one document is in memory at a time (the peak stays near the largest file), and the streams are
    the same: each split is its documents' tokens in path order, and the tail split of a corpus too small for a
    by-document split is the tail of the whole stream."""
    import tracemalloc

    tok = ByteTokenizer()
    corpus = make_corpus(tmp_path / "c", n_files=40, size=100_000)  # 4 MB; 100 KB per file
    source = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    tracemalloc.start()
    try:
        splits = build_token_cache(source, tmp_path / "cache", 33, val_fraction=0.2, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_500_000, peak  # the old build: ~28 MB
    files = sorted(corpus.iterdir())
    docs = [tok.encode(f.read_bytes(), add_eos=True) for f in files]
    held_out = [ids for f, ids in zip(files, docs) if _is_val(f.read_bytes(), 0.2)]
    assert splits.meta["split"] == "by_document" and 0 < len(held_out) < len(docs)
    assert np.array_equal(splits.val, np.concatenate(held_out))
    assert np.array_equal(splits.train, np.concatenate([ids for ids in docs if not any(ids is h for h in held_out)]))
    for n_files, min_tokens in ((1, 33), (3, 4000)):  # too few documents: the tail of the stream is val
        small = make_corpus(tmp_path / f"s{n_files}", n_files=n_files, size=3000, seed=n_files)
        source = CorpusSource(name="s", kind="files", paths=[str(small)])
        got = build_token_cache(source, tmp_path / "cache", min_tokens, val_fraction=0.2, progress=False)
        stream = np.concatenate([tok.encode(f.read_bytes(), add_eos=True) for f in sorted(small.iterdir())])
        n_val = max(min_tokens, int(len(stream) * 0.2))
        assert got.meta["split"] == "by_tokens_tail"
        assert np.array_equal(got.train, stream[:-n_val]) and np.array_equal(got.val, stream[-n_val:])


def test_unigram_entropy_counts_tokens_in_chunks(tmp_path, monkeypatch):
    """The end-of-run summary's unigram_entropy ran np.bincount over the whole train stream, which copies the
    uint16 memmap to int64 first: 8 bytes per token (80 MB per 10M tokens, 80 GB for 10B) after training had
    finished. It counts in chunks now, with the same value."""
    import tracemalloc

    import lit_dtrain.data.windows as windows_mod

    dm = dm_for(make_corpus(tmp_path / "c", n_files=20, size=20_000), tmp_path, val_fraction=0.1)
    stream = np.asarray(dm.splits[0].train)
    assert len(stream) > 300_000
    counts = np.bincount(stream, minlength=dm.tokenizer.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    monkeypatch.setattr(windows_mod, "COUNT_CHUNK_TOKENS", 4096, raising=False)
    tracemalloc.start()
    try:
        value = dm.unigram_entropy()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    assert peak < 300_000, peak  # the whole stream as int64: 2.4 MB


def test_a_huge_file_is_hashed_and_tokenized_in_chunks(tmp_path, monkeypatch):
    """One document was still read whole, then encoded, then copied to append EOS: a 10 GB file took ~50 GB.
    Files are now read in chunks (the byte tokenizer encodes byte by byte, so chunks encode as the whole does)."""
    import tracemalloc

    import lit_dtrain.data.reading as reading_mod

    big = tmp_path / "big.txt"
    big.write_bytes(("héllo wörld\r\n" * 300_000).encode())  # 4.2 MB, one document
    monkeypatch.setattr(reading_mod, "READ_CHUNK_BYTES", 1 << 16, raising=False)
    tracemalloc.start()
    try:
        splits = build_token_cache(CorpusSource(name="t", kind="files", paths=[str(big)]), tmp_path / "cache", 33,
                                   progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # whole: ~21 MB
    stream = ByteTokenizer().encode(big.read_bytes(), add_eos=True)
    assert np.array_equal(np.concatenate([splits.train, splits.val]), stream)


def cache_of_dir(corpus):
    """The token cache of one 'files' source over ``corpus`` (windows of 9 tokens), built beside it."""
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.token_cache import build_token_cache

    source = CorpusSource(name="x", kind="files", paths=[str(corpus)])
    return build_token_cache(source, corpus.parent / "cache", min_tokens=9, progress=False)


@pytest.mark.parametrize(
    "data, named",
    [
        ("hello wörld ✓\n" * 100, None),  # UTF-8: no warning
        (b"\xff\xfe", "UTF-16"),  # a UTF-16 byte-order mark alone (an empty document saved by a UTF-16 editor)
        ("hello wörld ✓\n".encode("utf-16") * 100, "UTF-16"),  # with its BOM (little-endian here)
        ("\ufeffhello wörld ✓\n".encode("utf-16-be") * 100, "UTF-16"),
        ("hello wörld ✓\n".encode("utf-16-le") * 100, "UTF-16LE"),  # no BOM: told by its NUL pattern
        ("hello wörld ✓\n".encode("utf-16-be") * 100, "UTF-16BE"),
        ("hello wörld ✓\n".encode("utf-32") * 100, "UTF-32"),
        ("hello wörld ✓\n".encode("utf-32-le") * 100, "UTF-32LE"),
    ],
)
def test_utf16_and_utf32_files_are_named_with_how_to_convert_them(data, named, tmp_path, caplog):
    """A UTF-16 text file was reported as 'binary (NUL bytes)', and a lone UTF-16 BOM not at all: the byte tokenizer
    trains on a file's bytes as they are (its contract), so a UTF-16 corpus trains on a NUL after each ASCII
    character. The warning names the encoding and the iconv command that converts the file."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "plain.txt").write_text("some utf-8 text\n" * 20)
    odd = tmp_path / "c" / "odd.txt"
    odd.write_bytes(data if isinstance(data, bytes) else data.encode())
    with caplog.at_level("WARNING"):
        splits = cache_of_dir(tmp_path / "c")
    assert splits.meta["train_tokens"] + splits.meta["val_tokens"] == 16 * 20 + odd.stat().st_size + 2  # bytes + EOS
    assert "binary" not in caplog.text
    if named is None:
        assert "UTF-" not in caplog.text
    else:
        assert f"1 file(s) are {named} text" in caplog.text and str(odd) in caplog.text
        assert f"iconv -f {named} -t UTF-8" in caplog.text


def test_binary_files_are_not_taken_for_utf16(tmp_path, caplog):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "plain.txt").write_text("some utf-8 text\n" * 20)
    (tmp_path / "c" / "blob.bin").write_bytes(b"\x00\x01" * 100)  # decodes as UTF-16LE 'ĀĀĀ...': not text
    (tmp_path / "c" / "zeros.bin").write_bytes(bytes(64))
    (tmp_path / "c" / "rand.bin").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with caplog.at_level("WARNING"):
        cache_of_dir(tmp_path / "c")
    assert "3 file(s) look binary" in caplog.text and "UTF-" not in caplog.text


def test_a_pipe_as_a_corpus_path_is_refused_naming_it(tmp_path):
    """A corpus is read twice (hashed for the cache key, then tokenized). `paths=[<(zcat corpus.gz)]` (bash process
    substitution: /dev/fd/63, a pipe) read the data once, got nothing the second time and failed with "corpus file
    '/dev/fd/63' changed while the token cache ... was built; run again once the corpus is not being written",
    which running again does not fix; a named FIFO without a writer blocked the run forever."""
    from lit_dtrain.data.corpus import CorpusSource, resolve_files

    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    match = r"data source 'x': path '.*corpus.fifo' is a pipe \(FIFO\), not a regular file: .*read twice.*to a file"
    with pytest.raises(CorpusError, match=match):
        resolve_files(CorpusSource(name="x", kind="files", paths=[str(fifo)]))


def test_files_that_are_not_utf8_are_named(tmp_path, caplog):
    """A corpus with Latin-1 (or cp1252) files beside UTF-8 ones trained on two encodings of every accented letter
    without a word: the byte tokenizer takes a file's bytes as they are. A file whose first 8 KiB are not valid
    UTF-8 is named in a warning, with the offending byte and the iconv command."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a_utf8.txt").write_text("café crème ✓\n" * 50)
    (tmp_path / "c" / "b_latin1.txt").write_bytes("déjà vu\n".encode("latin-1") * 50)
    (tmp_path / "c" / "c_cut.txt").write_bytes(b"a" + "é".encode() * 4096)  # the first 8 KiB end inside a character
    with caplog.at_level("WARNING"):
        cache_of_dir(tmp_path / "c")
    assert "1 file(s) are not UTF-8 text" in caplog.text and "b_latin1.txt" in caplog.text
    assert "byte 0xe9 at offset 1" in caplog.text and "iconv -f LATIN1 -t UTF-8" in caplog.text
    assert "a_utf8.txt" not in caplog.text and "c_cut.txt" not in caplog.text


def test_a_utf8_byte_order_mark_at_a_files_start_is_not_trained_on(tmp_path, monkeypatch, caplog):
    """A UTF-8 BOM (EF BB BF, written by Windows editors) was tokenized as 3 bytes at each such document's start,
    so the model learned to emit an invisible U+FEFF after EOS. It is left out as open(encoding='utf-8-sig') does;
    a U+FEFF elsewhere, and a BOM at a later chunk's start, stay byte for byte."""
    import codecs

    import lit_dtrain.data.reading as reading_mod

    monkeypatch.setattr(reading_mod, "READ_CHUNK_BYTES", 64)  # several chunks per file
    bom = codecs.BOM_UTF8
    text = b"a" * 61 + bom + "caf\u00e9 \ufeff end\n".encode() * 10  # the second chunk starts with a BOM's bytes
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a_windows.txt").write_bytes(bom + text)
    (tmp_path / "c" / "b_unix.txt").write_bytes(text)
    (tmp_path / "c" / "c_only_bom.txt").write_bytes(bom)  # no text: an empty file
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        splits = cache_of_dir(tmp_path / "c")
    doc = ByteTokenizer().encode(text, add_eos=True)
    assert np.array_equal(np.concatenate([splits.train, splits.val]), np.concatenate([doc, doc]))
    assert splits.meta["documents"] == 2  # the BOM-only file counts as empty
    assert "skipped 1 empty file(s)" in caplog.text
    assert "have the same bytes as another file" in caplog.text  # the same document, held out together


@pytest.mark.parametrize("val_fraction", [0.02, 0.3])
def test_about_val_fraction_of_the_documents_are_held_out(val_fraction):
    """A document goes to val when its hash falls under ``val_fraction``: of 5000 distinct documents about that share
    (within 4 binomial standard deviations), not its complement."""
    import hashlib
    import math

    from lit_dtrain.data.token_cache import _is_val_doc

    n = 5000
    share = sum(_is_val_doc(hashlib.sha256(f"document {i}".encode()).digest(), val_fraction) for i in range(n)) / n
    assert abs(share - val_fraction) < 4 * math.sqrt(val_fraction * (1 - val_fraction) / n)


@pytest.mark.parametrize("kind", ["directory", "glob"])
def test_a_loop_of_symlinks_in_a_corpus_is_named_a_loop(tmp_path, caplog, kind):
    """Links that point at each other (a -> b -> a) or at themselves were left out as links 'whose target does not
    exist', with the loop as the example (self.txt -> self.txt); the files beside them are read."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("text " * 50)
    (corpus / "self.txt").symlink_to("self.txt")
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        files = resolve_files(CorpusSource(name="t", kind="files", paths=[str(corpus if kind == "directory" else
                                                                              corpus / "*.txt")]))
    assert [p.name for p in files] == ["doc.txt"]
    (warned,) = [r.getMessage() for r in caplog.records]
    assert "left out 1 symlink(s) under" in warned and "whose target does not exist or is a loop" in warned
    assert "self.txt -> self.txt" in warned
