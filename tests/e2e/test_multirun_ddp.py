"""``python train.py -m ... trainer=ddp_cpu``: a Hydra sweep whose jobs each run on 2 gloo processes."""

import json
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env


@pytest.mark.slow
@pytest.mark.dist
def test_multirun_with_ddp_writes_each_job_once_with_both_ranks(tmp_path, corpus):
    args = [
        "-m", *TINY, "trainer=ddp_cpu", *[o for o in TINY if o.startswith("trainer.")], "strategy=ddp",
        "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer.max_steps=6",
        "trainer.val_check_interval=3", "sample.max_new_tokens=0", "optimizer.lr=1e-3,1e-2",
    ]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "multiruns").iterdir())
    # rank 1, re-launched by Lightning with the same -m, joins rank 0's sweep instead of starting its own
    assert len(sweeps) == 1, sweeps
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    losses = []
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["steps"] == 6
        losses.append(summary["val_loss"])
        assert (job / "train_ddp_process_1.log").is_file()  # rank 1 ran this job, and logged here
        assert "optimizer.lr=" in (job / ".hydra" / "overrides.yaml").read_text()
    assert losses[0] != losses[1]  # two configurations, not one run twice
