"""Exact results of the corpus walk (lit_dtrain.data.walking) where single-point mutants passed test_data_sources.py
and test_source_names.py: ``walk_glob`` is ``glob.glob(pattern, recursive=True)`` on a tree without links (its
forms ``dir/**``, ``dir/**/``, a magic head, a directory name with glob characters, dot files), and
``_files_below`` takes the first spelling of a directory in sorted order, strips every leading ``**/`` and names
only the links whose target is missing."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from lit_dtrain.data import walking
from lit_dtrain.data.walking import _files_below, walk_glob


def _tree(root: Path) -> Path:
    for rel in ("a.txt", ".env", "b.md", "sub/c.txt", "sub/.hid.txt", "sub/deep/d.txt", "[x]/e.txt",
                "c1/f.txt", "c2/g.txt", ".git/h.txt"):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("text\n")
    return root


def _paths(found: list[str]) -> list[Path]:
    """As resolve_files reads them: './a.txt' is 'a.txt' and 'sub/' is 'sub' (glob spells a dir of 'x/**/' so)."""
    return sorted(Path(p) for p in found)


@pytest.mark.parametrize("pattern", [
    "{r}/**", "{r}/**/", "{r}/**/*.txt", "{r}/*/**/*.txt", "{r}/**/**/*.txt", "{r}/c*/**/*.txt", "{r}/**/deep",
    "{r}/[[]x]/**/*.txt",
])
def test_walk_glob_lists_what_glob_lists_on_a_tree_without_links(tmp_path, pattern):
    """Without links walk_glob must find exactly glob's paths: every file and dir below for 'dir/**' (no dot
    file; 'dir/' itself among them, as glob lists it), only the dirs for 'dir/**/', the dirs a
    magic head matches ('c*'), and the files below a dir whose name holds glob characters ('[x]')."""
    root = _tree(tmp_path / "t")
    pattern = pattern.format(r=root)
    assert _paths(walk_glob(pattern)) == _paths(glob.glob(pattern, recursive=True)), pattern


def test_a_relative_recursive_glob_lists_what_glob_lists(tmp_path, monkeypatch):
    """'**' and '**/*.txt' start in the working dir: '.' itself is not listed, as glob does not list it."""
    _tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    for pattern in ("**", "**/*.txt", "**/"):
        assert _paths(walk_glob(pattern)) == _paths(glob.glob(pattern, recursive=True)), pattern
    assert Path(".") not in _paths(walk_glob("**")) and Path("a.txt") in _paths(walk_glob("**"))


def test_a_root_recursive_glob_walks_from_the_root_dir(monkeypatch):
    """'/**/x' walks from '/', not from the working dir (the walk is stubbed: this test does not list the disk)."""
    walked = []
    monkeypatch.setattr(walking, "_dirs_below", lambda root, dot_dirs=None: walked.append(root) or iter(()))
    assert walk_glob("/**/x.txt") == [] and walked == [Path("/")]


def test_files_below_take_the_first_spelling_of_a_linked_dir_in_sorted_order(tmp_path):
    """'a' -> 'b' (a link to a sibling dir): the walk goes in sorted order and enters each real dir once, by the
    first spelling that reaches it: the file is listed as a/f.txt, once."""
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "f.txt").write_text("x")
    (tmp_path / "a").symlink_to("b", target_is_directory=True)
    assert _files_below(tmp_path, "*.txt") == [tmp_path / "a" / "f.txt"]
    assert _files_below(tmp_path, "**/**/*.txt") == [tmp_path / "a" / "f.txt"]  # every leading **/ stripped


def test_files_below_name_only_the_links_whose_target_is_missing(tmp_path):
    """A matching link to an existing dir is entered, not called dangling; a link to nothing is."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f.txt").write_text("x")
    (tmp_path / "dir.txt").symlink_to("real", target_is_directory=True)
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing")
    dangling: list[Path] = []
    files = _files_below(tmp_path, "*.txt", dangling)
    assert files == [tmp_path / "dir.txt" / "f.txt"] and dangling == [tmp_path / "gone.txt"]
    assert os.path.islink(tmp_path / "dir.txt")
