"""A run dir locked by a process on this host is refused at once: the wait for a crashed node's lock (up to
``OTHER_HOST_WAIT_S``) is for a holder on another host only."""

from __future__ import annotations

import logging
import time

import pytest

from lit_dtrain.errors import ConfigError
from lit_dtrain.run_lock import hold_run_dir, release_run_dir


def test_a_lock_held_on_this_host_is_refused_without_waiting(tmp_path, caplog):
    held = hold_run_dir(tmp_path)  # (flock is per open file: a second open of it in this process is refused too)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"), \
                pytest.raises(ConfigError, match=r"is in use: process \d+ on "):
            hold_run_dir(tmp_path, wait_s=30.0)
        assert time.monotonic() - start < 5.0
        assert not [r for r in caplog.records if "waiting up to" in r.getMessage()]
    finally:
        release_run_dir(held)
    release_run_dir(hold_run_dir(tmp_path, wait_s=1.0))


def test_the_lock_file_names_only_its_holder_after_a_longer_stale_line(tmp_path):
    """A lock file left by an earlier holder with a longer line (another host's name) is rewritten, not overwritten
    in place: a refusal quotes the file, and a stale tail made it name two processes on two hosts."""
    from lit_dtrain.run_lock import LOCK_NAME

    (tmp_path / LOCK_NAME).write_text("process 1234567 on a-much-longer-host-name.cluster.example (since 2026-01-01 "
                                      "00:00:00)\n")
    held = hold_run_dir(tmp_path)
    try:
        (line,) = (tmp_path / LOCK_NAME).read_text().splitlines()
        assert line.startswith("process ") and "a-much-longer-host-name" not in line
    finally:
        release_run_dir(held)
