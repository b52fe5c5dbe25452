"""Atomic checkpoint writes (reliability rows 4 and 5): a kill, a failed serialization or a full disk during a
write keeps the previous file and leaves no temp file. (The safe loads are in test_checkpoint_loads.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError, atomic_torch_save, safe_torch_load

WRITER = """
import sys, torch
from lit_dtrain.checkpoint import atomic_torch_save
path = sys.argv[1]
i = 0
while True:  # rewrite a ~64 MB checkpoint until killed
    i += 1
    atomic_torch_save({"step": i, "w": torch.full((16 * 1024 * 1024,), float(i))}, path)
    print(i, flush=True)
"""


def test_kill_during_write_never_leaves_a_corrupt_file(tmp_path):
    path = tmp_path / "last.ckpt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    for delay in (0.3, 0.9, 1.7):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, env=env)
        while not path.exists():  # wait for a first complete file
            time.sleep(0.05)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = safe_torch_load(path)
        assert ckpt["w"].numel() == 16 * 1024 * 1024
        assert bool((ckpt["w"] == float(ckpt["step"])).all())  # a whole, consistent file


def test_failed_write_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)

    def broken_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(CheckpointError, match="last.ckpt.*Input/output error.*intact"):
        atomic_torch_save({"step": 2}, path)
    monkeypatch.undo()
    assert safe_torch_load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temp file left behind


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, options: str):
    """A tmpfs mounted at ``mnt`` (created) with mount ``options`` (``size=4m``, ``ro``), unmounted afterwards."""
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)]).returncode != 0:
        pytest.fail(f"cannot mount a tmpfs with {options} (the test needs root, which CI has)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.fixture
def tiny_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "tmpfs", "size=4m") as mnt:
        yield mnt


def test_disk_full_reports_clearly_and_keeps_previous(tiny_tmpfs):
    path = tiny_tmpfs / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.zeros(256 * 1024)}, path)  # 1 MB
    with pytest.raises(CheckpointError, match=r"last\.ckpt.*No space left on device"):
        atomic_torch_save({"step": 2, "w": torch.zeros(1024 * 1024)}, path)  # 4 MB: cannot fit
    assert safe_torch_load(path)["step"] == 1
    assert [p.name for p in tiny_tmpfs.iterdir()] == ["last.ckpt"]


def test_disk_full_keeps_the_previous_metrics_csv_and_plot_too(tiny_tmpfs):
    """The CSV logger's rewrite and the scripts' plots/tables use the same writer as checkpoints: on a full disk the
    error names the file and the cause, the previous file stays whole and no temp file is left filling the disk."""
    from lit_dtrain.loggers import write_csv_atomically
    from lit_dtrain.utils.atomic import AtomicWriteError
    from lit_dtrain.utils.plots import write_atomically

    csv_path = tiny_tmpfs / "metrics.csv"
    write_csv_atomically(csv_path, ["step", "loss"], [{"step": 0, "loss": 1.0}])
    before = csv_path.read_text()
    with pytest.raises(AtomicWriteError, match=r"metrics\.csv': No space left on device; the previous file"):
        write_csv_atomically(csv_path, ["step", "loss"], [{"step": i, "loss": "x" * 1000} for i in range(5000)])
    assert csv_path.read_text() == before
    table = tiny_tmpfs / "table.md"
    table.write_text("old table")
    with pytest.raises(AtomicWriteError, match=r"table\.md': No space left on device"):
        write_atomically(table, lambda tmp: tmp.write_bytes(b"|" * (5 << 20)))
    assert table.read_text() == "old table"
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["metrics.csv", "table.md"]


def test_summary_json_on_a_full_disk_keeps_the_previous_and_leaves_no_temp_file(tiny_tmpfs):
    """train()'s summary.json went through its own temp file (.summary.json.tmp), left behind, half written, when the
    write failed; it now uses the same writer as checkpoints."""
    from lit_dtrain.train import _report
    from lit_dtrain.utils.atomic import AtomicWriteError

    (tiny_tmpfs / "summary.json").write_text('{"val_loss": 1.0}')
    fd = os.open(tiny_tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:  # the disk is full
        pass
    finally:
        os.close(fd)
    with pytest.raises(AtomicWriteError, match=r"summary\.json': No space left on device"):
        _report({"val_loss": 2.0, "notes": "x" * 10000}, "", tiny_tmpfs, None)
    assert (tiny_tmpfs / "summary.json").read_text() == '{"val_loss": 1.0}'
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["filler", "summary.json"]


def test_a_start_removes_only_the_checkpoint_temp_files_of_dead_writers(tiny_cfg, tmp_path):
    """A start removed every '.<name>.ckpt.tmp-<pid>' of the checkpoint dir, also that of a live process writing a
    checkpoint there, logging it as 'left by a process killed while writing a checkpoint' (the sweep of the run dir's
    other temp files checked the pid). One sweep now, for a checkpoint dir that is a symbolic link too."""
    import subprocess

    from lit_dtrain.train import train

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is dead
    cfg = tiny_cfg("trainer.max_steps=1", "sample.max_new_tokens=0")
    elsewhere = tmp_path / "big_disk" / "checkpoints"
    elsewhere.mkdir(parents=True)
    Path(cfg.paths.output_dir).mkdir(parents=True)
    Path(cfg.paths.checkpoint_dir).symlink_to(elsewhere)
    live, dead = elsewhere / f".last.ckpt.tmp-{os.getppid()}", elsewhere / f".epoch=1.ckpt.tmp-{child.pid}"
    for f in (live, dead, elsewhere / "notes.ckpt.tmp-1"):
        f.write_bytes(b"half a checkpoint")
    train(cfg)
    assert live.exists() and not dead.exists() and (elsewhere / "notes.ckpt.tmp-1").exists()
    assert (elsewhere / "last.ckpt").is_file()


def test_save_does_not_hold_a_second_copy_of_the_checkpoint_in_memory(tmp_path):
    """The write serialized the whole checkpoint into an in-memory buffer first, so saving held a second copy
    of every tensor: +64 MB of Python heap for a 64 MB checkpoint, +16 GB on rank 0 for a 1B model with AdamW.
    It now streams into the temp file (still renamed into place only once complete)."""
    import tracemalloc

    path = tmp_path / "last.ckpt"
    state = {"step": 3, "w": torch.full((16 * 1024 * 1024,), 3.0)}  # 64 MB
    tracemalloc.start()
    try:
        atomic_torch_save(state, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"saving a 64 MB checkpoint allocated {peak / 2**20:.1f} MB on the heap"
    loaded = safe_torch_load(path)
    assert loaded["step"] == 3 and bool((loaded["w"] == 3.0).all())
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_failed_serialization_leaves_no_temp_file_and_keeps_previous(tmp_path):
    """An object torch.save cannot pickle fails the save after the temp file was opened: the previous file
    stays, the temp file is removed, and the error names the checkpoint."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    with pytest.raises(CheckpointError, match=r"last\.ckpt"):
        atomic_torch_save({"step": 2, "bad": lambda: None}, path)
    assert safe_torch_load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


