"""End to end: ``python train.py trainer=ddp_cpu strategy=ddp_compressed/powersgd`` with 2 gloo processes."""

import json
import subprocess

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import PYTHON, ROOT, TINY, event_files, subprocess_env


@pytest.mark.slow
@pytest.mark.dist
def test_train_py_ddp_cpu_powersgd(tmp_path, corpus):
    steps = 20
    args = [
        *TINY, "trainer=ddp_cpu", *[o for o in TINY if o.startswith("trainer.")],
        "data=textfiles", f"data.sources.0.paths=[{corpus}]", "strategy=ddp_compressed/powersgd",
        f"trainer.max_steps={steps}", "trainer.val_check_interval=10", "trainer.log_every_n_steps=5", "run_name=psgd",
    ]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "comm hook registered on cpu (gloo): PowerSGD(matrix_approximation_rank=4" in proc.stdout + proc.stderr
    run_dir = tmp_path / "outputs" / "runs" / "psgd"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and 0 < summary["val_loss"] < 6.0

    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["lit_dtrain_comm"]
    assert state["world_size"] == 2
    ranks = state["per_rank"]
    for r in ranks:
        assert r["counters"]["step"] == steps
        assert r["compressor"]["name"] == "powersgd" and r["compressor"]["num_calls"] >= steps
        assert r["compressor"]["q_memory"] and r["compressor"]["residuals"]
    name = sorted(ranks[0]["compressor"]["residuals"])[0]
    assert not torch.equal(ranks[0]["compressor"]["residuals"][name], ranks[1]["compressor"]["residuals"][name])

    counters = ranks[0]["counters"]
    scalars = {}
    for events in event_files(run_dir / "tb"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = [e.value for e in acc.Scalars(tag)]
    assert len(scalars["comm/bytes_per_step"]) == steps // 5
    ratio = counters["total_dense_bytes"] / counters["total_bytes"]
    assert ratio > 3  # the tiny 32-wide model still compresses several-fold at rank 4
    assert scalars["comm/compression_ratio"][-1] == pytest.approx(ratio, rel=1e-6)
    assert scalars["comm/bytes_per_step"][-1] == pytest.approx(counters["total_bytes"] / steps, rel=1e-6)
    assert all(t > 0 for t in scalars["comm/time_ms"])
