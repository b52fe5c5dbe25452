"""End to end: the selective_ckpt callback config through train.py and train(cfg)."""

from __future__ import annotations

import json
import subprocess

import torch

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.train import train
from tests.conftest import PYTHON, ROOT, TINY, subprocess_env


def test_train_py_with_selective_ckpt(tmp_path, corpus):
    args = [*TINY, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "run_name=sac",
            "callbacks=[default,selective_ckpt]", "callbacks.selective_ckpt.policy=selective"]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "SelectiveCheckpointing(policy=selective): 2 blocks (model.blocks.0 .. model.blocks.1)" in out
    summary = json.loads((tmp_path / "outputs" / "runs" / "sac" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["val_loss"] < 6.0


def test_budget_policy_trains_exactly_like_no_checkpointing(tiny_cfg):
    common = ["sample.max_new_tokens=0", "trainer.max_steps=4", "scheduler.total_steps=4"]
    _, plain = train(tiny_cfg(*common, run="plain"))
    _, ckpt = train(tiny_cfg(*common, "callbacks=[default,selective_ckpt]", "callbacks.selective_ckpt.policy=budget",
                             "callbacks.selective_ckpt.memory_budget=0.7", run="budget"))
    cb = next(c for c in ckpt["trainer"].callbacks if isinstance(c, SelectiveCheckpointing))
    assert cb.budget_report["fits"] and set(cb.plan) != {"none"}
    assert any(w.calls > 0 for w in cb.wrappers)
    a, b = plain["module"].model.state_dict(), ckpt["module"].model.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # the probe pass restored the RNG, and recomputation is exact
        assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
    saved = torch.load(ckpt["trainer"].checkpoint_callback.last_model_path, weights_only=True)
    assert saved["callbacks"]["SelectiveCheckpointing"]["plan"] == cb.plan
