"""LossSpikeMonitor under Lightning: skip and rollback exactness, the lr cool-down, raise, a resume with retuned
thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import LossSpikeMonitor
from lit_dtrain.callbacks.loss_spike import LossSpikeError
from tests.unit._loss_spike_helpers import (
    Inject,
    LrProbe,
    Probe,
    assert_identical,
    assert_schedule_follows_the_step,
    make_data,
    make_module,
    make_trainer,
    one_thread,  # noqa: F401 - its autouse fixture, as before the split
)


@pytest.mark.parametrize("kind", ["finite", "nan"])
def test_skip_leaves_params_optimizer_and_schedule_bit_identical(tmp_path: Path, kind: str) -> None:
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    probe = Probe()
    trainer = make_trainer(tmp_path, [Inject({6: kind}), monitor, probe], max_steps=9)
    dm = make_data(tmp_path)
    trainer.fit(make_module(), datamodule=dm)
    assert [e["step"] for e in monitor.events] == [6]
    assert monitor.events[0]["actions"] == ["log", "skip"]
    # the weights and optimizer state after step 6 are exactly those after step 5: the batch never came
    assert_identical(probe.after[6], probe.after[7], schedule=False)
    # ... and normal steps do change them (the comparison can fail)
    with pytest.raises(AssertionError):
        assert_identical(probe.after[5], probe.after[6], schedule=False)
    assert_schedule_follows_the_step(probe)
    # its samples are excluded from the sampler and recorded in spikes.jsonl
    assert sorted(monitor.excluded) == sorted(set(probe.indices[6]))
    assert bool(dm.sampler.excluded[probe.indices[6]].all())
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [(e["step"], e["index"]) for e in lines] == [(6, probe.indices[6])]
    assert lines[0]["reasons"] == (["nonfinite_loss", "nonfinite_grad"] if kind == "nan" else ["loss"])
    assert all(bool(torch.isfinite(v).all()) for v in probe.after[9]["params"].values())


def test_rollback_restores_exactly_the_snapshot(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=3, snapshot_every=3, rollback_min_age=2)
    probe = Probe()
    trainer = make_trainer(tmp_path, [Inject({10: "finite"}), monitor, probe], max_steps=12)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    (event,) = monitor.events
    # snapshots at 6 and 9 steps; 9 is 1 step old at step 10 (< rollback_min_age=2), so 6 is restored
    assert (event["step"], event["rolled_back_to"]) == (10, 6)
    assert_identical(probe.after[6], probe.after[11], schedule=False)
    with pytest.raises(AssertionError):
        assert_identical(probe.after[9], probe.after[11], schedule=False)
    assert_schedule_follows_the_step(probe)
    assert sorted(monitor.excluded) == sorted(set(probe.indices[10]))


def test_lr_cooldown_scales_the_applied_lr_and_leaves_the_schedule(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], warmup_steps=3, cooldown_factor=0.1, cooldown_steps=2,
                               cooldown_ramp_steps=1)
    lr_probe = LrProbe()
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor, lr_probe], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [5]
    factors = {s: lr_probe.applied[s] / lr_probe.scheduled[s] for s in range(4, 10)}  # scheduled[s]: LR of step s
    assert factors == pytest.approx({4: 1.0, 5: 0.1, 6: 0.1, 7: 0.55, 8: 1.0, 9: 1.0})


def test_a_batch_skipped_by_the_module_is_ignored(tmp_path: Path) -> None:
    """``training_step`` returning None is Lightning's way to skip a batch: no decision, no crash."""
    module = make_module()
    step = module.training_step
    module.training_step = lambda batch, batch_idx: None if module.trainer.global_step == 5 else step(batch, batch_idx)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [monitor], max_steps=8)
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert trainer.global_step == 8 and monitor.events == []
    assert monitor.detector.loss_stat.count == 7  # the seven steps with a loss, not the skipped batch


def test_state_survives_a_resume_with_retuned_thresholds(tmp_path: Path) -> None:
    """The state key is the class name: retuning a threshold on resume keeps the excluded samples and counts,
    and a checkpoint that stored them under the older argument-built key still loads."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=7)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert monitor.num_spikes == 1 and monitor.excluded
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    raw = torch.load(ckpt, weights_only=False)
    old_key = "LossSpikeMonitor{'actions': ('log', 'skip'), 'z': 6.0, 'rel': 0.2, 'method': 'ema'}"
    raw["callbacks"] = {old_key: raw["callbacks"]["LossSpikeMonitor"]}
    torch.save(raw, tmp_path / "old_key.ckpt")
    for path in (ckpt, tmp_path / "old_key.ckpt"):
        retuned = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, z_threshold=8.0, rel_threshold=0.3)
        again = make_trainer(tmp_path, [retuned], max_steps=8)
        again.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=str(path))
        assert retuned.num_spikes == 1 and retuned.excluded == monitor.excluded, path.name
        assert retuned.detector.loss_stat.count >= monitor.detector.loss_stat.count


def test_raise_after_m_spikes(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["log", "skip", "raise"], warmup_steps=3, raise_after=2, raise_window=10)
    trainer = make_trainer(tmp_path, [Inject({5: "finite", 7: "nan"}), monitor], max_steps=12)
    with pytest.raises(LossSpikeError, match="2 loss spikes within 10 steps"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert trainer.global_step == 8
    assert len((tmp_path / "spikes.jsonl").read_text().splitlines()) == 2


def test_missing_index_key_is_named(tmp_path: Path) -> None:
    class NoIndex(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch.pop("index")

    trainer = make_trainer(tmp_path, [NoIndex(), LossSpikeMonitor(actions=["skip"])], max_steps=2)
    with pytest.raises(KeyError, match="'index'"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))


def test_a_step_skipped_for_an_excluded_sample_alone_still_takes_its_snapshot(tmp_path):
    """A project without an excluding sampler skips a later step whose batch holds an excluded sample. That step moved
    nothing, yet when it fell on the snapshot cadence no snapshot was taken, so a later rollback went a whole
    ``snapshot_every`` further back (NaN at steps 7 and 25, snapshots every 4, the batch of step 7 again at 23: rolled
    back to 20, dropping steps 20-22 and 24, where 24 holds the same weights). After a spike none is taken still."""
    from tests.toys import TinyRegression

    class NaNAt(TinyRegression):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            return loss * float("nan") if self.trainer.global_step in (7, 25) else loss

    monitor = LossSpikeMonitor(actions=["log", "rollback"], snapshot_every=4, snapshot_keep=2, rollback_min_age=1,
                               warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", max_steps=28, callbacks=[monitor], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        trainer.fit(NaNAt())
    events = [json.loads(line) for line in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [(e["step"], e["actions"], e["rolled_back_to"]) for e in events] == [
        (7, ["log", "rollback"], 4), (23, ["skip"], None), (25, ["log", "rollback"], 24)]
