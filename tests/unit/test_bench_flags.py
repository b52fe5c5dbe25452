"""Bad counts given to the benchmarks are refused by argparse, naming the flag, before any work: ``--steps 0``,
``--repeats 0`` and ``--rounds 0`` ended minutes later in ``statistics.StatisticsError: no median for empty data``,
``--batch 0`` in an FFT error, and ``bench_step.py --warmup`` >= ``--steps`` timed nothing (0 ms/step, or the same
error)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("script, args, message", [
    ("bench_sampler_scaling.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("bench_sampler_scaling.py", ["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    ("bench_optim_diag.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("bench_step.py", ["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    ("bench_step.py", ["--steps", "abc"], "argument --steps: expected a whole number, got 'abc'"),
    ("bench_step.py", ["--steps", "5", "--warmup", "5"], "--warmup (5) must be below --steps (5)"),
])
def test_bad_counts_are_refused_before_any_work(script, args, message, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # nothing written
