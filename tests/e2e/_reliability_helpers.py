"""Helpers shared by the reliability matrix's tests (test_reliability*.py): the tiny run's overrides and a
``train.py`` process of it on a corpus; the check that a DDP sweep's job refused on every rank is reported once."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

MAX_STEPS = 12
RUN = [*TINY, f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
       "sample.max_new_tokens=0"]


def train_proc(tmp_path: Path, corpus: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [PYTHON, str(ROOT / "train.py"), *RUN, "data=textfiles", f"data.sources.0.paths=[{corpus}]", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


def assert_refused_once(proc: subprocess.CompletedProcess, job: int, refusal: str) -> None:
    """The sweep exited 1 and job ``job``'s refusal was reported once: one ``error:`` line, Hydra's report once, one
    ``job N failed`` line."""
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count(f"error: {refusal}") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Error executing job with overrides") == 1, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count(f"job {job} failed: ConfigError: {refusal}") == 1, proc.stdout[-3000:]
