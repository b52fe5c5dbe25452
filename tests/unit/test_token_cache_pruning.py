"""``data.cache_keep``'s pruning, by source name and corpus: which caches of a cache dir count against a source."""

from __future__ import annotations

import gc
import json
import os
import time

from lit_dtrain.data import CorpusSource, build_token_cache
from tests.conftest import make_corpus


def _build(corpus, cache, name="x", keep=1):
    splits = build_token_cache(CorpusSource(name=name, kind="files", paths=[str(corpus)]), cache, min_tokens=9,
                               progress=False, keep=keep)
    key = os.path.basename(os.path.dirname(splits.train.filename))
    del splits
    gc.collect()  # released: no process holds it
    time.sleep(0.02)  # distinct mtimes
    return key


def _edit(corpus, i):
    (corpus / "edited.txt").write_text(f"edit number {i}\n" * 40)


def test_another_source_names_caches_of_the_same_corpus_are_not_pruned(tmp_path):
    """Two sources of one corpus under other names (a mixture's, another config's) each keep their own caches: the
    edits of 'x' with keep=1 leave 'other''s, released, in place."""
    corpus, cache = make_corpus(tmp_path / "corpus", n_files=3), tmp_path / "cache"
    other = _build(corpus, cache, name="other")
    for i in range(2):
        _edit(corpus, i)
        newest = _build(corpus, cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([other, newest])


def test_a_cache_that_records_no_corpus_counts_as_the_same_corpus(tmp_path):
    """A cache built before ``meta.json`` recorded its corpus is one of this source's: pruned by keep=1 at the next
    edit, not kept for good."""
    corpus, cache = make_corpus(tmp_path / "corpus", n_files=3), tmp_path / "cache"
    old = _build(corpus, cache)
    meta = cache / old / "meta.json"
    fields = json.loads(meta.read_text())
    assert fields.pop("corpus")
    meta.write_text(json.dumps(fields))
    _edit(corpus, 0)
    newest = _build(corpus, cache)
    assert sorted(p.name for p in cache.iterdir()) == [newest]


def test_a_cache_the_discard_could_not_remove_is_not_reported_removed(tmp_path, caplog):
    """The log names only caches that are gone: one the discard left (moved back, a failed delete) is not counted
    as freed."""
    from lit_dtrain.data.cache_pruning import prune_caches

    corpus, cache = make_corpus(tmp_path / "corpus", n_files=3), tmp_path / "cache"
    old = _build(corpus, cache, keep=2)
    _edit(corpus, 0)
    newest = _build(corpus, cache, keep=2)
    with caplog.at_level("INFO"):
        recorded = json.loads((cache / old / "meta.json").read_text())["corpus"]
        prune_caches(cache / newest, "x", 1, discard=lambda path: None, corpus=recorded)
    assert sorted(p.name for p in cache.iterdir()) == sorted([old, newest])
    assert "removed" not in caplog.text


def test_a_dir_named_like_a_cache_without_meta_json_is_not_pruned(tmp_path):
    """Every built cache holds a meta.json (the build renames its temp dir with it inside): a dir of the form
    <source name>-<24 hex digits> without one is someone's own, and keep=1 deleted it with its files as a cache of
    source 'x'."""
    corpus, cache = make_corpus(tmp_path / "corpus", n_files=3), tmp_path / "cache"
    mine = cache / "x-abcdefabcdefabcdefabcdef"
    mine.mkdir(parents=True)
    (mine / "important.txt").write_text("mine")
    newest = _build(corpus, cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([mine.name, newest])
    assert (mine / "important.txt").read_text() == "mine"
