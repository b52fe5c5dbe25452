"""Exact results of ``data.cache_keep``'s pruning (``data/cache_pruning.py``) and of the token cache's key
(``data/token_cache.py``) where single-point mutants passed test_token_cache_pruning.py, test_token_cache_upkeep.py,
test_token_cache_key.py and test_data_token_cache.py (eighth hand mutation audit)."""

from __future__ import annotations

import os

from lit_dtrain.data import CorpusSource
from tests.conftest import make_corpus
from tests.unit.test_token_cache_pruning import _build  # one build, its mtimes apart


def test_a_symlinked_cache_dir_is_never_pruned(tmp_path):
    """A link in the cache dir named like a cache (a shared cache linked in by hand) is not this cache dir's to
    remove: pruning it moved the link aside under a hidden name (its target stays), so the linked cache was gone
    from where the user put it."""
    corpus, shared, cache = make_corpus(tmp_path / "corpus", n_files=3), tmp_path / "shared", tmp_path / "cache"
    linked = _build(corpus, shared)
    cache.mkdir()
    os.symlink(shared / linked, cache / linked)
    (corpus / "edited.txt").write_text("an edit\n" * 40)
    newest = _build(corpus, cache, keep=1)
    assert newest != linked
    assert sorted(p.name for p in cache.iterdir()) == sorted([linked, newest])
    assert (cache / linked).is_symlink() and (shared / linked / "meta.json").exists()


def test_a_corpus_is_the_same_one_whatever_the_order_of_its_paths():
    """``data.sources.N.paths`` listed in another order is the same corpus: its caches count against each other (the
    key hashes the files, not the order they were given in), where an order-dependent ``corpus_id`` kept both
    orders' caches for good."""
    from lit_dtrain.data.token_cache import corpus_id

    a, b = os.path.abspath("a"), os.path.abspath("b")
    ab = corpus_id(CorpusSource(name="x", kind="files", paths=[a, b]))
    assert ab == corpus_id(CorpusSource(name="x", kind="files", paths=[b, a]))
    assert ab != corpus_id(CorpusSource(name="x", kind="files", paths=[a]))


def test_the_same_paths_under_another_pattern_are_another_corpus():
    """``data.sources.N.pattern`` picks the files: ``*.py`` and ``*.txt`` of one directory are two corpora, whose
    caches do not push each other out (without the pattern in ``corpus_id`` keep=1 removed the other's)."""
    from lit_dtrain.data.token_cache import corpus_id

    path = os.path.abspath("corpus")
    assert corpus_id(CorpusSource(name="x", kind="files", paths=[path], pattern="*.py")) != \
        corpus_id(CorpusSource(name="x", kind="files", paths=[path], pattern="*.txt"))
