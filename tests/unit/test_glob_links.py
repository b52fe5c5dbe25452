"""Which directories a glob matched are told as left out, where links point back into the tree the glob reads."""

from __future__ import annotations

from lit_dtrain.data.corpus import CorpusSource, resolve_files


def test_a_link_to_its_own_directory_is_not_told_as_left_out(tmp_path, caplog):
    """c/* over c/a.txt, c/b.txt and c/current -> . read both files, and a link up the tree being refused as covered
    made it warn 'also matched 1 directories (e.g. .../c/current), left out with the files below them', with the fix
    'add c/*/**/*' that adds nothing; a real subdir beside it is still named, counted once (2 were counted)."""
    (tmp_path / "c").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "c" / name).write_text(f"text of {name}")
    (tmp_path / "c" / "current").symlink_to(".")
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        files = resolve_files(CorpusSource(name="t", kind="files", paths=[f"{tmp_path}/c/*"]))
    assert [f.name for f in files] == ["a.txt", "b.txt"] and "left out" not in caplog.text
    (tmp_path / "c" / "sub").mkdir()
    (tmp_path / "c" / "sub" / "s.txt").write_text("below")
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        assert len(resolve_files(CorpusSource(name="t", kind="files", paths=[f"{tmp_path}/c/*"]))) == 2
    assert f"also matched 1 directories (e.g. {tmp_path}/c/sub), left out" in caplog.text


def test_the_glob_check_before_the_seed_stops_at_the_first_file(tmp_path, monkeypatch):
    """The config checks ask whether a glob matches a file, and ``prepare_data`` lists it: the check walked the whole
    tree first (3.9 s of every start for a ``**`` glob of 9k files); it stops at the first file it matches."""
    from types import SimpleNamespace

    from lit_dtrain.data import walking
    from lit_dtrain.data._datamodule_checks import check_source_paths
    from lit_dtrain.data.corpus import CorpusSource

    for sub in ("a", "b", "c"):
        (tmp_path / "corpus" / sub).mkdir(parents=True)
        (tmp_path / "corpus" / sub / "x.txt").write_text("text\n")
    entered, dirs_below = [], walking._dirs_below
    monkeypatch.setattr(walking, "_dirs_below", lambda root, dot_dirs=None: (
        entered.append(d.name) or d for d in dirs_below(root, dot_dirs)))
    source = CorpusSource(name="text", kind="files", paths=[f"{tmp_path}/corpus/**/*.txt"])
    check_source_paths(SimpleNamespace(sources=[source], cache_dir=tmp_path / "cache"))
    assert entered == ["corpus", "a"]
