"""``summary.json``'s ``peak_rss_mib`` under DDP: the highest of the ranks' processes. ``MemoryMonitor`` logs rank 0's
own figure (no collective in training); the summary's is gathered once, after the final validation: here rank 1 holds
300 MiB through it, which no logged row and no figure of rank 0 shows."""

import csv
import json
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

HELD_MIB = 300


@pytest.mark.slow
@pytest.mark.dist
def test_the_summarys_peak_is_the_highest_of_the_ranks(tmp_path, corpus):
    record = tmp_path / "peak"
    args = [
        *TINY, "trainer=ddp_cpu", *[o for o in TINY if o.startswith("trainer.")], "strategy=ddp", "logger=csv",
        "data=textfiles", f"data.sources.0.paths=[{corpus}]", "sample.max_new_tokens=0", "run_name=mem",
        "trainer.max_steps=4", "trainer.log_every_n_steps=2",
        "+callbacks.hold._target_=tests.unit.test_memory_monitor.HoldInTheFinalValidation",
        "+callbacks.hold.rank=1", f"+callbacks.hold.mib={HELD_MIB}", f"+callbacks.hold.record={record}",
    ]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "runs" / "mem"
    rank1 = json.loads((tmp_path / "peak.rank1.json").read_text())
    assert rank1["held"] - rank1["before"] >= HELD_MIB - 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_rss_mib"] >= rank1["held"] - 1
    logged = [float(row["memory/peak_rss_mib"]) for path in run_dir.glob("csv/**/metrics.csv")
              for row in csv.DictReader(open(path, newline="")) if row.get("memory/peak_rss_mib")]
    assert logged and summary["peak_rss_mib"] > max(logged)  # rank 1's peak, which rank 0 never logs
