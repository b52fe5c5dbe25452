"""A source given no name: ``stdlib`` for the standard library (its caches keep their dir names), and for files a name
from its first path, so that a mixture of the stdlib and an unnamed ``kind='files'`` source is not refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_dtrain.data._datamodule_checks import source_from_config
from lit_dtrain.data.corpus import CorpusSource, default_source_name
from lit_dtrain.data.datamodule import LMDataModule
from lit_dtrain.data.token_cache import build_token_cache


def test_a_mixture_of_the_stdlib_and_an_unnamed_files_source_is_built(tmp_path: Path) -> None:
    corpus = tmp_path / "prose"
    corpus.mkdir()
    # it failed: "data.sources names must be unique, got ['stdlib', 'stdlib']"
    dm = LMDataModule(sources=[CorpusSource(), CorpusSource(kind="files", paths=[str(corpus)])],
                      cache_dir=str(tmp_path / "cache"))
    assert [s.name for s in dm.sources] == ["stdlib", "prose"]
    assert [source_from_config(i, e).name for i, e in enumerate([{}, {"kind": "files", "paths": [str(corpus)]}])] == [
        "stdlib", "prose"]


@pytest.mark.parametrize(("paths", "name"), [
    (["~/corpus/*.txt"], "corpus"),
    ("/data/prose/", "prose"),
    (["/data/books/moby.txt", "/data/web"], "moby.txt"),
    (["/d/my corpus/**/*.md"], "my_corpus"),  # a valid name: letters, digits, '_', '.', '+', '-'
    (["/"], "files"),
])
def test_a_files_source_is_named_by_its_first_path(paths, name) -> None:
    assert default_source_name("files", paths) == name
    assert CorpusSource(kind="files", paths=paths).name == name
    assert CorpusSource(name="mine", kind="files", paths=paths).name == "mine"  # a given name is kept


def test_an_unnamed_files_sources_cache_dir_carries_its_name(tmp_path: Path) -> None:
    corpus = tmp_path / "notes"
    corpus.mkdir()
    (corpus / "a.txt").write_text("".join(f"line {i} of some notes\n" for i in range(400)))
    splits = build_token_cache(CorpusSource(kind="files", paths=[str(corpus)]), tmp_path / "cache", 17, progress=False)
    assert splits.name == "notes"
    assert [d.split("-")[0] for d in os.listdir(tmp_path / "cache") if not d.startswith(".")] == ["notes"]


def test_two_unnamed_sources_named_alike_are_refused_with_the_fix(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "corpus", tmp_path / "b" / "corpus"
    with pytest.raises(Exception, match=r"got \['corpus', 'corpus'\].*data\.sources\.<i>\.name=<name>"):
        LMDataModule(sources=[{"kind": "files", "paths": [str(a)]}, {"kind": "files", "paths": [str(b)]}],
                     cache_dir=str(tmp_path / "cache"))
