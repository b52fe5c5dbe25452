"""Gaps found by the seventeenth hand mutation audit of utils/atomic.py: results no other test pinned."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lit_dtrain.utils import atomic
from lit_dtrain.utils.atomic import (
    AtomicWriteError,
    remove_killed_writes_temp_files,
    unwritable_dir_reason,
    what_is_left,
    write_atomically,
)


def _fails(error: BaseException):
    def write(tmp: Path) -> None:
        Path(tmp).write_bytes(b"half")
        raise error

    return write


def test_an_os_error_without_strerror_is_named_by_its_message(tmp_path):
    """``OSError('quota exceeded on /scratch')`` has no strerror: the message said 'could not write ...: None'."""
    path = tmp_path / "out.txt"
    with pytest.raises(AtomicWriteError) as info:
        write_atomically(path, _fails(OSError("quota exceeded on /scratch")))
    assert str(info.value) == f"could not write {str(path)!r}: quota exceeded on /scratch; no file was created at " \
                              "that path"


def test_an_os_error_behind_another_error_is_found_as_its_cause_or_its_context(tmp_path):
    """torch's zip writer on a full disk raises a RuntimeError while the write's OSError is handled (its
    ``__context__``); ``raise ... from`` sets ``__cause__``. Either is the reason named, the chain's first OSError."""
    path = tmp_path / "out.txt"
    path.write_text("old")

    def context(tmp):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 128 vs 64")  # noqa: B904 - as torch raises it

    def cause(tmp):
        raise RuntimeError("serializing failed") from OSError(errno.EIO, "Input/output error")

    for write, strerror in ((context, "No space left on device"), (cause, "Input/output error")):
        with pytest.raises(AtomicWriteError, match=rf": {strerror}; the previous file at that path is intact$"):
            write_atomically(path, write)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]


def test_a_keyboard_interrupt_while_an_os_error_is_handled_is_raised_as_it_came(tmp_path):
    """A Ctrl-C during the handling of a write's OSError is a KeyboardInterrupt still, not an AtomicWriteError
    (which ``except Exception`` handlers would catch): only an Exception's chain is searched."""
    def write(tmp):
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError:
            raise KeyboardInterrupt  # noqa: B904

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "out.txt", write)
    assert os.listdir(tmp_path) == []


def test_an_atomic_write_error_from_a_nested_write_is_raised_as_it_came(tmp_path):
    """A ``write`` that itself writes atomically (and fails) raises that write's error, naming its path; wrapped
    again it named the outer path with the inner message inside its own."""
    inner = tmp_path / "inner.txt"

    def write(tmp):
        write_atomically(inner, _fails(OSError(errno.ENOSPC, "No space left on device")))

    with pytest.raises(AtomicWriteError) as info:
        write_atomically(tmp_path / "outer.txt", write)
    assert info.value.filename == str(inner)
    assert str(info.value) == f"could not write {str(inner)!r}: No space left on device; no file was created at that " \
                              "path"


def test_what_is_left_of_links(tmp_path):
    """A link to a directory is a link, replaced by a rename like a file (not 'a directory in the way'); a link
    that leads nowhere is still something left at the path."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "to_dir").symlink_to(tmp_path / "dir")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    assert what_is_left(tmp_path / "to_dir") == "the previous file at that path is intact"
    assert what_is_left(tmp_path / "dangling") == "the previous file at that path is intact"
    assert what_is_left(tmp_path / "dir") == "a directory is in the way at that path: remove or rename it"
    assert what_is_left(tmp_path / "none") == "no file was created at that path"


def test_temp_files_behind_links_and_of_other_users_writers_stay(tmp_path, monkeypatch):
    """remove_killed_writes_temp_files removes regular files in the run dir and its real subdirs: not a link named
    like a temp file (its target is not ours), nor what is in a linked subdir (a checkpoint dir linked elsewhere,
    shared with other runs), nor the file of a writer that runs as another user (os.kill: EPERM, alive)."""
    dead = 2**22 + 12345  # above pid_max's default: no such process
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / f".shared.csv.tmp-{dead}"
    target.write_text("someone's")
    run = tmp_path / "run"
    run.mkdir()
    (run / f".metrics.csv.tmp-{dead}").symlink_to(target)
    (run / "linked").symlink_to(elsewhere)
    assert remove_killed_writes_temp_files(run) == []
    assert target.exists() and (run / f".metrics.csv.tmp-{dead}").is_symlink()

    other_user = run / ".summary.json.tmp-4242"
    other_user.write_text("half")

    def kill(pid, sig):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    assert atomic.pid_alive(4242) is True
    assert remove_killed_writes_temp_files(run) == [] and other_user.exists()


def test_a_dir_below_a_link_that_leads_somewhere_is_writable(tmp_path):
    """LIT_DTRAIN_OUTPUT through a link to a mounted scratch (scratch -> real dir): the runs dir below it, not yet
    made, can be; only a link that leads nowhere is refused."""
    (tmp_path / "real").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "real")
    assert unwritable_dir_reason(tmp_path / "scratch" / "outputs" / "runs") is None
    assert os.listdir(tmp_path / "real") == []


def test_the_parent_dirs_are_created(tmp_path):
    """A path in dirs not made yet (a first plot under <run>/plots/loss/) is written, its dirs made; without the
    mkdir the temp file's open failed: 'could not write ...: No such file or directory'."""
    path = tmp_path / "plots" / "loss" / "a.txt"
    write_atomically(path, lambda tmp: Path(tmp).write_text("new"))
    assert path.read_text() == "new" and os.listdir(path.parent) == ["a.txt"]
