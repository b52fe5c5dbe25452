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
