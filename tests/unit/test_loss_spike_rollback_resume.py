"""A LossSpikeMonitor rollback to step N while the run dir holds a checkpoint of step N+1 (written before the spike,
on the trajectory the rollback abandons): resume=auto takes the checkpoint written after the rollback, which holds
the rolled-back weights and optimizer state, and ends bitwise on the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lit_dtrain.train import resolve_ckpt_path, train


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _same_state(a: dict, b: dict) -> bool:
    weights = a["state_dict"].keys() == b["state_dict"].keys() and all(
        torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    return weights and sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_resume_auto_after_a_rollback_past_a_newer_checkpoint_continues_the_rolled_back_run(tiny_cfg, tmp_path):
    """Real run: snapshots every 2 steps, a checkpoint at every step, NaN at step 5: rolled back to the snapshot of
    step 4 while step000005 (the abandoned trajectory) is on disk; the step-6 checkpoint holds step 4's weights and
    optimizer state; killed in step 6, resume=auto takes it (not step000005) and ends equal to the straight run."""
    common = ("sample.max_new_tokens=0", "trainer.val_check_interval=1", "trainer.max_steps=7",
              "callbacks.model_checkpoint.save_top_k=-1", "callbacks=[default,loss_spike]",
              "callbacks.loss_spike.actions=[log,rollback]", "callbacks.loss_spike.snapshot_every=2",
              "callbacks.loss_spike.warmup_steps=2",
              "+callbacks.inject._target_=tests.unit._loss_spike_helpers.InjectAt", "+callbacks.inject.nan=[5]")
    fault = ("+callbacks.fault._target_=tests.faults.RaiseOnceAt", "+callbacks.fault.hook=on_after_backward",
             "+callbacks.fault.step=6")
    try:
        train(tiny_cfg(*common, *fault, run="r"))
    except RuntimeError as e:
        assert str(e) == "interrupted at step 6"
    else:
        raise AssertionError("the fault did not fire")
    run = tmp_path / "r"
    (event,) = [json.loads(line) for line in (run / "spikes.jsonl").read_text().splitlines()]
    assert (event["step"], event["rolled_back_to"]) == (5, 4)
    d = run / "checkpoints"
    files = {_load(p)["global_step"]: p for p in d.glob("step*.ckpt")}
    assert sorted(files) == [1, 2, 3, 4, 5, 6]
    assert not _same_state(_load(files[5]), _load(files[4]))  # step 5 trained on past 4
    assert _same_state(_load(files[6]), _load(files[4]))  # step 5's update dropped: step 4's state
    cfg = tiny_cfg(*common, "resume=auto", run="r")
    chosen = Path(resolve_ckpt_path(cfg))
    assert chosen == d / "last.ckpt" and _same_state(_load(chosen), _load(files[4]))
    metrics, _ = train(cfg)
    assert metrics["steps"] == 7
    train(tiny_cfg(*common, run="straight"))
    assert _same_state(_load(d / "last.ckpt"), _load(tmp_path / "straight" / "checkpoints" / "last.ckpt"))
