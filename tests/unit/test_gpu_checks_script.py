"""scripts/gpu_checks.sh keeps the scripts' contract (DESIGN.md, Evidence): ``--help``, and a last output line that
is one JSON object. Checked without a GPU: ``ONLY`` picks no step, or only the ``env`` step with a Python that fails
its check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"


def run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_help_prints_the_usage_and_runs_nothing(tmp_path):
    """``--help`` was taken for OUT_DIR: it made a directory named --help and started every GPU check."""
    done = run("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "bash scripts/gpu_checks.sh [OUT_DIR]" in done.stdout and "===" not in done.stdout
    assert list(tmp_path.iterdir()) == []
    bad = run("--out", "x", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown option --out" in bad.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_last_line_is_a_json_summary_of_the_steps(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "ONLY": "none", "PYTHON": sys.executable}
    done = run(str(tmp_path / "none"), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == {"out": str(tmp_path / "none"), "results": str(tmp_path / "none" / "results.jsonl"), "rc": {},
                       "failed": []}
    # a step that fails is named, and the exit status says so (it was 0 whatever failed)
    failing = tmp_path / "python_failing_c"
    failing.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] && exit 3\nexec {sys.executable} "$@"\n')
    failing.chmod(0o755)
    done = run(str(tmp_path / "env"), cwd=tmp_path, env={**env, "ONLY": "env", "PYTHON": str(failing)})
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rc"] == {"env": 3} and summary["failed"] == ["env"]


def test_without_cuda_no_gpu_step_runs_and_the_summary_says_why(tmp_path):
    """On a machine whose torch sees no CUDA device every step ran to its own failure (about 20 s each for the
    benchmarks, minutes in all), and ``pytest_gpu``, whose tests all skip there, passed. The script now checks once,
    before the first step that needs the GPU, and stops with one line."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("checks a machine without CUDA")
    env = {"PATH": "/usr/bin:/bin", "ONLY": "bench_step_nano pytest_gpu", "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT / "src")}
    done = run(str(tmp_path / "out"), cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["rc"] == {} and summary["failed"] == [], summary
    assert summary["error"].endswith("torch sees no CUDA device (or cannot be imported); run this on a GPU machine")
    assert "gpu_checks.sh: error: " in done.stderr and "===" not in done.stdout, done.stdout + done.stderr
