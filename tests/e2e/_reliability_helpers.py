"""Helpers shared by the reliability matrix's tests (test_reliability*.py): the tiny run's overrides and a
``train.py`` process of it on a corpus."""

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
