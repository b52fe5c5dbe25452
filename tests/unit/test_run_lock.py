"""One training process per run dir: a second start in a run dir that another process trains in is refused (two
starts of one command trained side by side, writing last.ckpt, metrics.csv and summary.json in turn)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_dtrain.errors import ConfigError
from lit_dtrain.run_lock import LOCK_NAME, hold_run_dir, release_run_dir

_HOLD = """
import sys, time
from lit_dtrain.run_lock import hold_run_dir
lock = hold_run_dir(sys.argv[1])
if len(sys.argv) > 2:  # write another host's name, as a process there would
    lock.seek(0); lock.truncate()
    lock.write(f"process 1 on {sys.argv[2]} (since 2026-01-01 00:00:00)\\n"); lock.flush()
print("held", flush=True)
time.sleep(600)
"""


def _holder(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir), *args], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_start_in_a_run_dir_another_process_trains_in_is_refused_until_it_ends(tiny_cfg):
    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.max_steps=2", "sample.max_new_tokens=0")
    run_dir = Path(cfg.paths.output_dir)
    holder = _holder(run_dir)
    try:
        with pytest.raises(ConfigError, match=rf"^run dir '{run_dir}' is in use: process {holder.pid} on "
                                              rf"{socket.gethostname()} \(since .*\) is training in it \(it holds "
                                              rf"'{run_dir / LOCK_NAME}'\); wait for it to end, or choose another"):
            train(cfg)
        assert not (run_dir / "checkpoints").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # however it ends, the kernel drops its lock
        holder.wait()
    metrics, _ = train(cfg)
    assert metrics["steps"] == 2
    lock = hold_run_dir(run_dir)  # train() released it
    assert lock is not None
    with pytest.raises(ConfigError, match="is in use"):
        hold_run_dir(run_dir)
    release_run_dir(lock)
    release_run_dir(hold_run_dir(run_dir))


def test_a_lock_held_on_another_host_is_waited_for_before_the_refusal(tmp_path):
    """A node that crashed keeps its lock on a shared filesystem until the server's lease ends (NFSv4: ~90 s): a
    requeued job on another node waits for it before it refuses."""
    holder = _holder(tmp_path, "other-node")
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=r"is in use: process 1 on other-node"):
            hold_run_dir(tmp_path, wait_s=1.0)
        assert time.monotonic() - start >= 1.0
    finally:
        holder.kill()
        holder.wait()
    release_run_dir(hold_run_dir(tmp_path, wait_s=1.0))


def test_a_checkpoint_dir_outside_the_run_dir_is_locked_too(tiny_cfg, tmp_path):
    """Two runs of different run_names given one paths.checkpoint_dir (a scratch disk) trained into it side by side:
    both exited 0 naming its last.ckpt, which held one of them (the other's was last-v1.ckpt). A checkpoint dir
    outside the run dir, also through a symbolic link, is locked beside it (nothing is written inside it)."""
    from lit_dtrain.run_lock import hold_checkpoint_dir
    from lit_dtrain.train import train

    shared = tmp_path / "scratch" / "ckpt"
    held = hold_checkpoint_dir(shared, tmp_path / "a")
    assert held is not None
    cfg = tiny_cfg("trainer.max_steps=2", "sample.max_new_tokens=0", f"paths.checkpoint_dir={shared}", run="b")
    with pytest.raises(ConfigError, match=rf"^checkpoint dir '{shared}' is in use: process {os.getpid()} on .* "
                                          "wait for it to end, or give this run its own paths.checkpoint_dir$"):
        train(cfg)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "checkpoints").symlink_to(shared, target_is_directory=True)
    with pytest.raises(ConfigError, match="is in use"):
        hold_checkpoint_dir(tmp_path / "c" / "checkpoints", tmp_path / "c")
    assert hold_checkpoint_dir(tmp_path / "d" / "checkpoints", tmp_path / "d") is None  # the run dir's lock covers it
    release_run_dir(held)
    metrics, _ = train(cfg)
    assert metrics["steps"] == 2 and sorted(p.name for p in shared.iterdir()) == ["last.ckpt"]
    release_run_dir(hold_checkpoint_dir(shared, tmp_path / "a"))  # train() released it
