"""A token cache dir that cannot be one: the error names what is in the way; one inside the corpus is not read as
corpus."""

from __future__ import annotations

import re

import pytest

from lit_dtrain.data import CorpusError, CorpusSource, build_token_cache
from tests.unit._data_helpers import files_source


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_cache_dir_that_is_a_file_is_named_as_one(tmp_path, below):
    """LIT_DTRAIN_CACHE naming a file (or a path below one) said 'File exists; free space there'."""
    (tmp_path / "c.txt").write_text("some text to train on\n" * 20)
    (tmp_path / "afile").write_text("not a dir")
    cache = tmp_path / "afile" / below if below else tmp_path / "afile"
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "c.txt")])
    expected = (f"cannot write the token cache of data source 't' under '{cache}': '{tmp_path / 'afile'}' is a file, "
                "not a directory; move it away or point LIT_DTRAIN_CACHE")
    with pytest.raises(CorpusError, match=re.escape(expected)):
        build_token_cache(source, cache, min_tokens=9, val_fraction=0.1, progress=False)


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_cache_dir_behind_a_link_that_leads_nowhere_names_the_link(tmp_path, below):
    """LIT_DTRAIN_CACHE at (or below) a symbolic link to an unmounted scratch disk said 'File exists; free space
    there', and one below a loop of links 'Too many levels of symbolic links; free space there'."""
    (tmp_path / "c.txt").write_text("some text to train on\n" * 20)
    (tmp_path / "scratch").symlink_to(tmp_path / "unmounted" / "cache")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "c.txt")])
    for link, why, fix in (
        ("scratch", f"is a broken symbolic link \\(to '{tmp_path}/unmounted/cache', which does not exist\\)",
         "mount or create its target"),
        ("a", "cannot be reached: its symbolic links form a loop", "fix the link"),
    ):
        cache = tmp_path / link / below if below else tmp_path / link
        expected = (rf"^cannot write the token cache of data source 't' under '{cache}': '{tmp_path / link}' {why}.*; "
                    rf"{fix} or point LIT_DTRAIN_CACHE \(paths.cache_dir\) elsewhere$")
        with pytest.raises(CorpusError, match=expected):
            build_token_cache(source, cache, min_tokens=9, val_fraction=0.1, progress=False)


def test_a_chain_of_links_that_leads_nowhere_names_each_hop(tmp_path):
    """scratch -> mnt -> /unmounted (a link to a link to a missing disk) was "'scratch' is a broken symbolic link (to
    'mnt', which does not exist)", while ls lists mnt; the chain is named to the target that does not exist, for a
    corpus path and for the token cache dir."""
    from lit_dtrain.data.corpus import resolve_files

    (tmp_path / "c.txt").write_text("some text to train on\n" * 20)
    (tmp_path / "scratch").symlink_to("mnt")
    (tmp_path / "mnt").symlink_to(tmp_path / "unmounted")
    why = f"'{tmp_path}/scratch' is a broken symbolic link (to 'mnt' -> '{tmp_path}/unmounted', which does not exist)"
    with pytest.raises(CorpusError, match=re.escape(f"path '{tmp_path}/scratch/corpus' cannot be reached: {why}")):
        resolve_files(CorpusSource(name="t", kind="files", paths=[f"{tmp_path}/scratch/corpus"]))
    source = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "c.txt")])
    with pytest.raises(CorpusError, match=re.escape(f"under '{tmp_path}/scratch/cache': {why}; mount or create")):
        build_token_cache(source, tmp_path / "scratch" / "cache", min_tokens=9, val_fraction=0.1, progress=False)


def test_a_link_whose_target_lies_behind_a_link_that_leads_nowhere_names_that_link(tmp_path):
    """scratch -> mnt/data with mnt -> /unmounted (a link into a mount point that is itself a link) was "'scratch' is
    a broken symbolic link (to 'mnt/data', which does not exist)": ls lists mnt, and mnt is what is missing."""
    from lit_dtrain.data.corpus import resolve_files

    (tmp_path / "scratch").symlink_to("mnt/data")
    (tmp_path / "mnt").symlink_to(tmp_path / "unmounted")
    why = (f"'{tmp_path}/scratch' is a broken symbolic link (to 'mnt/data', which cannot be reached: '{tmp_path}/mnt' "
           f"is a broken symbolic link (to '{tmp_path}/unmounted', which does not exist))")
    with pytest.raises(CorpusError, match=re.escape(f"path '{tmp_path}/scratch/corpus' cannot be reached: {why}")):
        resolve_files(CorpusSource(name="t", kind="files", paths=[f"{tmp_path}/scratch/corpus"]))

def test_a_cache_dir_inside_the_corpus_is_not_read_as_corpus(tmp_path, caplog):
    """paths=[corpus] with the cache dir corpus/cache: each build read the token files of the one before as corpus
    text (warned as 'UTF-16LE text'), so every run made a new cache of a corpus three times larger (59k, 179k, 538k
    tokens). The cache dir's files are left out, with a warning; the key stays the same, so the cache is reused."""
    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    sizes = []
    for _ in range(3):
        with caplog.at_level("WARNING"):
            splits = build_token_cache(files_source(corpus), corpus / "cache", min_tokens=9, progress=False)
        sizes.append((splits.meta["documents"], len(splits.train) + len(splits.val), splits.train.filename))
    assert sizes[0] == sizes[1] == sizes[2] and sizes[0][0] == 3
    assert "left out 3 file(s) under " in caplog.text and "(token caches, not corpus text)" in caplog.text
    assert "UTF-16" not in caplog.text


def test_a_corpus_that_is_only_the_cache_dir_is_refused(tmp_path):
    from lit_dtrain.data import CorpusError
    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    build_token_cache(files_source(corpus), tmp_path / "cache", min_tokens=9, progress=False)
    match = r"data source 'x': its 3 file\(s\) are all under '.*cache' .*which holds token caches"
    with pytest.raises(CorpusError, match=match):
        build_token_cache(files_source(tmp_path / "cache"), tmp_path / "cache", min_tokens=9, progress=False)
