"""End to end: the selective_ckpt callback config through train.py and train(cfg)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
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
    assert summary["activation_checkpointing"] == {"policy": "selective", "plan": ["selective"] * 2,
                                                   "blocks_none": 0, "blocks_selective": 2, "blocks_full": 0}


def test_budget_policy_trains_exactly_like_no_checkpointing(tiny_cfg):
    common = ["sample.max_new_tokens=0", "trainer.max_steps=4", "scheduler.total_steps=4"]
    _, plain = train(tiny_cfg(*common, run="plain"))
    cfg = tiny_cfg(*common, "callbacks=[default,selective_ckpt]", "callbacks.selective_ckpt.policy=budget",
                   "callbacks.selective_ckpt.memory_budget=0.7", "trainer.log_every_n_steps=2", run="budget")
    _, ckpt = train(cfg)
    cb = next(c for c in ckpt["trainer"].callbacks if isinstance(c, SelectiveCheckpointing))
    assert cb.budget_report["fits"] and set(cb.plan) != {"none"}
    _the_plan_is_in_the_summary_and_tensorboard(Path(cfg.paths.output_dir), cb)
    assert any(w.calls > 0 for w in cb.wrappers)
    a, b = plain["module"].model.state_dict(), ckpt["module"].model.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # the probe pass restored the RNG, and recomputation is exact
        assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
    saved = torch.load(ckpt["trainer"].checkpoint_callback.last_model_path, weights_only=True)
    assert saved["callbacks"]["SelectiveCheckpointing"]["plan"] == cb.plan


def _the_plan_is_in_the_summary_and_tensorboard(output_dir: Path, cb: SelectiveCheckpointing) -> None:
    """The plan and the probe's figures (those of the log line 'budget probe: measured R ... plan P') were in the log
    and the checkpoint only: they are in summary.json and in TensorBoard's ``ckpt/*`` scalars, at every logged step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = cb.budget_report
    entry = json.loads(next(output_dir.rglob("summary.json")).read_text())["activation_checkpointing"]
    assert entry["policy"] == "budget" and entry["plan"] == cb.plan == report["plan"]
    assert [entry[f"blocks_{m}"] for m in ("none", "selective", "full")] == [cb.plan.count(m) for m in
                                                                            ("none", "selective", "full")]
    assert entry["measured_ratio"] == report["measured_ratio"] and entry["memory_budget"] == 0.7
    assert entry["measured_bytes"] / entry["none_act_bytes"] == pytest.approx(report["measured_ratio"], rel=1e-12)
    assert entry["measured_bytes"] <= entry["budget_bytes"] and entry["fits"] is True
    acc = EventAccumulator(str(next(output_dir.rglob("tb"))), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    steps = [step for step, _ in scalars["train/loss"]]  # at every logged step, beside train/loss and memory/*
    assert steps == [1, 3]
    for mode in ("none", "selective", "full"):
        assert scalars[f"ckpt/blocks_{mode}"] == [(step, cb.plan.count(mode)) for step in steps]
    assert scalars["ckpt/measured_ratio"] == [(s, pytest.approx(report["measured_ratio"], rel=1e-6)) for s in steps]
    assert scalars["ckpt/memory_budget"] == [(step, pytest.approx(0.7, rel=1e-6)) for step in steps]
    assert scalars["ckpt/probe_act_mib"] == [(s, pytest.approx(entry["measured_bytes"] / 2**20, rel=1e-6))
                                             for s in steps]


POLICIES = ("none", "full", "every_k", "selective", "budget")
SHORT = ["sample.max_new_tokens=0", "model.n_layer=3", "scheduler.total_steps=4", "trainer.val_check_interval=2"]


def _ckpt(policy: str) -> list[str]:
    return ["callbacks=[default,selective_ckpt]", f"callbacks.selective_ckpt.policy={policy}",
            "callbacks.selective_ckpt.memory_budget=0.7"]


def _params(objs) -> dict:
    return {k: v.detach().clone() for k, v in objs["module"].model.state_dict().items()}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_every_policy_with_accumulation_trains_bitwise_like_no_checkpointing(tiny_cfg, precision):
    common = [*SHORT, "trainer.max_steps=4", "trainer.accumulate_grad_batches=2", f"trainer.precision={precision}"]
    _, plain = train(tiny_cfg(*common, run="plain"))
    reference = _params(plain)
    for policy in POLICIES:
        _, objs = train(tiny_cfg(*common, *_ckpt(policy), run=policy))
        cb = next(c for c in objs["trainer"].callbacks if isinstance(c, SelectiveCheckpointing))
        if policy != "none":  # checkpointing ran on every micro-batch (budget's probe adds its own calls)
            assert max(w.calls for w in cb.wrappers) >= 2 * 4, (policy, [w.calls for w in cb.wrappers])
        params = _params(objs)
        for k, v in reference.items():  # recomputation replays the same bf16 ops: equal bit for bit
            assert torch.equal(params[k], v), (policy, k)


def test_resume_auto_with_every_policy_ends_where_the_straight_run_does(tiny_cfg):
    # with dropout: a resumed run drew other masks than the straight one (0.0047 off) before they were seeded by step
    drop = [*SHORT, "model.dropout=0.1"]
    _, straight = train(tiny_cfg(*drop, "trainer.max_steps=4", "run_name=r", run="straight"))
    reference = _params(straight)  # without checkpointing: every policy trains bit for bit like it
    for policy in POLICIES:
        train(tiny_cfg(*drop, *_ckpt(policy), "trainer.max_steps=2", "run_name=r", run=policy))
        _, objs = train(tiny_cfg(*drop, *_ckpt(policy), "trainer.max_steps=4", "run_name=r", "resume=auto",
                                 run=policy))
        cb = next(c for c in objs["trainer"].callbacks if isinstance(c, SelectiveCheckpointing))
        if policy in ("full", "selective"):  # resumed at step 2: two more steps, checkpointed
            assert [w.calls for w in cb.wrappers] == [2, 2, 2], policy
        params = _params(objs)
        for k, v in reference.items():
            assert torch.equal(params[k], v), (policy, k)
