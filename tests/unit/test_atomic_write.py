"""lit_dtrain.utils.atomic.write_atomically and its three users: a checkpoint (atomic_torch_save), metrics.csv
(write_csv_atomically) and a script's plot or table (plots.write_atomically). A failure midway leaves the previous
file whole and no temp file; the new file is fsynced, and so is its directory."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError, atomic_torch_save, safe_torch_load
from lit_dtrain.loggers import write_csv_atomically
from lit_dtrain.utils import plots
from lit_dtrain.utils.atomic import AtomicWriteError, temp_path, write_atomically


class Boom(Exception):
    pass


def _half_then(error: BaseException):
    """A ``write(tmp)`` that writes half a file into ``tmp`` (in the target's directory) and then fails."""
    seen = []

    def write(tmp: Path) -> None:
        seen.append(Path(tmp))
        Path(tmp).write_bytes(b"half of the new file")
        raise error

    return write, seen


@pytest.mark.parametrize(
    "error, raised, match",
    [
        (OSError(errno.ENOSPC, "No space left on device"), AtomicWriteError,
         r"could not write '.*out\.txt': No space left on device; the previous file at that path is intact$"),
        (Boom("a bug in write"), Boom, "a bug in write"),  # not an OS error: raised as it came
        (KeyboardInterrupt(), KeyboardInterrupt, None),
    ],
)
def test_a_write_failing_midway_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, error, raised, match):
    path = tmp_path / "out.txt"
    path.write_text("old")
    write, seen = _half_then(error)
    with pytest.raises(raised, match=match) as info:
        write_atomically(path, write)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    assert seen == [temp_path(path)] and seen[0].parent == tmp_path  # same dir: the rename stays atomic
    if raised is AtomicWriteError:
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
        assert info.value.filename == str(path)



def test_a_directory_in_the_way_is_named_not_called_an_intact_file(tmp_path):
    """A directory at the path (a `last.ckpt/` made by hand or by a copy gone wrong) fails the rename with 'Is a
    directory'; the message went on 'the previous file at that path is intact', of a file that was never there."""
    path = tmp_path / "last.ckpt"
    path.mkdir()
    with pytest.raises(AtomicWriteError, match=r"Is a directory; a directory is in the way at that path: remove or "
                                               r"rename it$"):
        write_atomically(path, lambda tmp: Path(tmp).write_bytes(b"new"))
    assert path.is_dir() and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]

def test_a_failed_write_of_a_new_file_says_no_file_was_created(tmp_path, monkeypatch):
    """A checkpoint's next step file (or any path with no file yet) that a full disk stops says that nothing was
    created there; it said "the previous file at that path (if any) is intact", of a file that never was."""
    path = tmp_path / "step=4.ckpt"
    write, _ = _half_then(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(AtomicWriteError, match=r"No space left on device; no file was created at that path$"):
        write_atomically(path, write)
    def full_disk(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"No space left on device; no file was created at that path$"):
        atomic_torch_save({"w": torch.zeros(2)}, path)
    assert list(tmp_path.iterdir()) == []


def _record_fsyncs(monkeypatch) -> list[str]:
    """Patch os.fsync to record what each descriptor it is given refers to: 'file' or 'dir'."""
    calls, real = [], os.fsync

    def fsync(fd):
        calls.append("dir" if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def _writers():
    """(name, write(path, payload), read(path)) for each user of write_atomically."""
    return [
        ("ckpt", lambda p, n: atomic_torch_save({"w": torch.zeros(n)}, p), lambda p: safe_torch_load(p)["w"].numel()),
        ("csv", lambda p, n: write_csv_atomically(p, ["step"], [{"step": i} for i in range(n)]),
         lambda p: len(p.read_text().splitlines()) - 1),
        ("plot", lambda p, n: plots.write_atomically(p, lambda tmp: Path(tmp).write_bytes(b"x" * n)),
         lambda p: p.stat().st_size),
    ]


@pytest.mark.parametrize("name, write, read", _writers(), ids=[w[0] for w in _writers()])
def test_each_user_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch, name, write, read):
    """metrics.csv and the scripts' outputs were renamed into place without an fsync: after a power loss the
    rename could be on the disk and the data not (an empty or partial file where the old one was)."""
    path = tmp_path / f"out.{name}"
    calls = _record_fsyncs(monkeypatch)
    write(path, 10)
    assert calls == ["file", "dir"]
    assert read(path) == 10 and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("name, write, read", _writers(), ids=[w[0] for w in _writers()])
def test_each_user_keeps_the_old_file_when_the_write_fails_midway(tmp_path, monkeypatch, name, write, read):
    """A write failing after part of the new file is on the disk (here: its fsync, an I/O error) leaves the old
    file whole, no temp file, and an error naming the path and the cause."""
    path = tmp_path / f"out.{name}"
    write(path, 10)

    def broken_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    expected = CheckpointError if name == "ckpt" else AtomicWriteError
    with pytest.raises(expected, match=rf"out\.{name}'.*Input/output error.*intact"):
        write(path, 20)
    monkeypatch.undo()
    assert read(path) == 10
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_plots_temp_file_keeps_the_suffix_and_a_checkpoint_temp_file_does_not(tmp_path):
    """matplotlib picks the format from the suffix, so a plot's temp file must keep it; a checkpoint's must not end
    in .ckpt, or resume=auto's '*.ckpt' scan (pathlib's glob matches hidden files) would see a half-written one."""
    seen = []
    plots.write_atomically(tmp_path / "fig.svg", lambda tmp: (seen.append(Path(tmp)), Path(tmp).write_text("<svg/>")))
    assert seen[0].suffix == ".svg" and seen[0].parent == tmp_path
    assert not temp_path(tmp_path / "last.ckpt").name.endswith(".ckpt")
    assert (tmp_path / "fig.svg").read_text() == "<svg/>"


def test_a_write_that_writes_nothing_gives_an_empty_file(tmp_path):
    """The scripts' writer created its temp file before calling ``write`` (mkstemp): a ``write`` that writes nothing
    (a stubbed ``savefig`` in tests) gave an empty file, not 'No such file or directory'."""
    path = tmp_path / "fig.png"
    path.write_text("old")
    plots.write_atomically(path, lambda tmp: None)
    assert path.read_bytes() == b"" and [p.name for p in tmp_path.iterdir()] == ["fig.png"]


def test_a_run_that_fails_writing_its_resolved_config_keeps_the_previous_one(tiny_cfg, monkeypatch):
    """config_resolved.yaml (read by a resume's sweep check and by compare_runs.py) was written with write_text: a
    full disk or a kill midway left it truncated. Now the previous file stays whole and the error names it."""
    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.max_steps=2", "sample.max_new_tokens=0")
    target = Path(cfg.paths.output_dir) / "config_resolved.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("previous: run\n")
    write_text = Path.write_text

    def full_disk(self, data, *args, **kwargs):
        if "config_resolved" in self.name:  # half of the text reaches the disk, then ENOSPC
            write_text(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="config_resolved.yaml"):
        train(cfg)
    assert target.read_text() == "previous: run\n"
    assert not list(target.parent.glob(".config_resolved.yaml.tmp-*"))


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_temp_files_of_killed_writes_are_removed_from_the_run_dir_and_its_subdirs(tmp_path):
    """A kill during a metrics.csv, summary.json or plot write left its temp file in the run dir for good (only the
    checkpoint dir was swept). Removed now when its writer is dead (or its pid is ours, a reused one); a live
    writer's file, other hidden files and deeper dirs stay."""
    from lit_dtrain.utils.atomic import remove_killed_writes_temp_files

    dead, live = _dead_pid(), os.getppid()
    (tmp_path / "csv").mkdir()
    (tmp_path / "tb" / "deep").mkdir(parents=True)
    stale = [
        tmp_path / f".summary.json.tmp-{dead}",
        tmp_path / "csv" / f".metrics.csv.tmp-{dead}",
        tmp_path / f".loss.png.tmp-{dead}.png",  # plots keep their suffix
        temp_path(tmp_path / "config_resolved.yaml"),  # this process's pid: no write of ours is in flight
        tmp_path / ".spikes.jsonl.tmp-99999999999999999999",  # no process can have it
    ]
    kept = [
        tmp_path / f".metrics.csv.tmp-{live}",  # its writer runs
        tmp_path / "summary.json",
        tmp_path / ".hidden",
        tmp_path / f".notes.tmp-{dead}x",
        tmp_path / "tb" / "deep" / f".x.csv.tmp-{dead}",  # two levels down: not the run's files
    ]
    for f in stale + kept:
        f.write_text("half")
    (tmp_path / f".dir.tmp-{dead}").mkdir()  # not a file: left alone
    assert sorted(remove_killed_writes_temp_files(tmp_path)) == sorted(stale)
    assert all(f.exists() for f in kept) and not any(f.exists() for f in stale)
    assert remove_killed_writes_temp_files(tmp_path / "missing") == []


def test_a_run_started_in_a_run_dir_removes_the_temp_files_a_killed_run_left(tiny_cfg, caplog):
    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.max_steps=1", "sample.max_new_tokens=0")
    out = Path(cfg.paths.output_dir)
    (out / "csv").mkdir(parents=True)
    left = [out / f".summary.json.tmp-{_dead_pid()}", out / "csv" / f".metrics.csv.tmp-{_dead_pid()}"]
    for f in left:
        f.write_text("half")
    train(cfg)
    assert not any(f.exists() for f in left)
    assert sum("left by a process killed while writing it" in r.getMessage() for r in caplog.records) == 2
