"""What resolving a corpus' paths costs per file: it runs at every start on every rank, so each file's real path
is taken once (a file reached twice is one document), not once more per check."""

from __future__ import annotations

import os

import pytest

from lit_dtrain.data.corpus import CorpusSource, resolve_files
from tests.conftest import make_corpus


@pytest.mark.parametrize("glob_tail", [None, "**/*"])
def test_a_files_real_path_is_taken_once(tmp_path, monkeypatch, glob_tail):
    """The check that a glob's matched directory was read through a link took every file's real path, twice more
    (once for the glob's files, once for the source's), even where no directory was matched: 50k files in a directory
    source took 9.4 s to resolve where 4.0 s before it. The same files come back."""
    corpus = make_corpus(tmp_path / "corpus" / "v2", n_files=6, size=200)
    (tmp_path / "corpus" / "latest").symlink_to("v2")
    make_corpus(tmp_path / "corpus" / "v3", n_files=4, size=200)
    real_realpath, calls = os.path.realpath, []

    def realpath(path, *args, **kwargs):
        if os.path.isfile(path):
            calls.append(os.fspath(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", realpath)
    root = tmp_path / "corpus"
    files = resolve_files(CorpusSource(name="t", kind="files", paths=[str(root / glob_tail if glob_tail else root)]))
    assert len(files) == 10 and len({real_realpath(f) for f in files}) == 10 and corpus.is_dir()
    assert len(calls) == 10  # the identity of each file found (v2 is walked once, as latest/)
