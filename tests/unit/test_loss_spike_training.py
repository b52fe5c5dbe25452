"""LossSpikeMonitor in training: gradient accumulation, no sampler, a split run through train(), 16-mixed, NaN at
every step, TensorBoard scalars."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import AdaptiveGradClip, LossSpikeMonitor
from tests.unit._loss_spike_helpers import (
    Inject,
    Probe,
    assert_identical,
    assert_schedule_follows_the_step,
    fit_with_tensorboard,
    make_data,
    make_module,
    make_trainer,
    one_thread,  # noqa: F401 - its autouse fixture, as before the split
)


def test_gradient_accumulation_skips_the_whole_step(tmp_path: Path) -> None:
    class MicroInject(L.Callback):  # spikes the second micro-batch of optimizer step 5 only
        def __init__(self):
            self.micro, self.handle = 0, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2 * 5 + 1:
                self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * 30.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    monitor, probe = LossSpikeMonitor(actions=["skip"], warmup_steps=3), Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, accumulate_grad_batches=2, logger=False,
                        callbacks=[MicroInject(), monitor, probe], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [5]
    assert_identical(probe.after[5], probe.after[6], schedule=False)  # the whole optimizer step was dropped
    assert_schedule_follows_the_step(probe)
    both_micro_batches = sorted(set(monitor.events[0]["index"]))
    assert len(monitor.events[0]["index"]) == 8 and sorted(monitor.excluded) == both_micro_batches


def test_without_a_sampler_steps_holding_excluded_samples_are_skipped(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(16):  # 4 fixed batches of 4, replayed every epoch
        ids = torch.randint(0, 257, (33,), generator=g)
        items.append({"input_ids": ids[:-1], "labels": ids[1:], "index": torch.tensor(i)})
    monitor, probe = LossSpikeMonitor(actions=["skip"], warmup_steps=2), Probe()
    trainer = make_trainer(tmp_path, [Inject({1: "nan"}), monitor, probe], max_steps=10)
    # (it said "the datamodule has no sampler" when there is no datamodule)
    with pytest.warns(UserWarning, match="there is no datamodule, so no sampler with exclude"):
        trainer.fit(make_module(), train_dataloaders=DataLoader(items, batch_size=4, shuffle=False))
    events = [(e["step"], e["reasons"]) for e in monitor.events]
    assert events == [(1, ["nonfinite_loss", "nonfinite_grad"]), (5, ["excluded_sample"]),
                      (9, ["excluded_sample"])]
    assert monitor.excluded == [4, 5, 6, 7] and monitor.num_spikes == 1
    for step in (1, 5, 9):
        assert_identical(probe.after[step], probe.after[step + 1], schedule=False)
    assert_schedule_follows_the_step(probe)


def test_train_cfg_split_run_with_skips_reproduces_the_straight_run(tiny_cfg) -> None:
    """Through Hydra and train(cfg): spikes.jsonl in the run dir, and a resume with skips is bit-exact, also with
    dropout (masks seeded by the step, lit_dtrain.step_rng) and the split right after a skipped step (5) with a
    skip at the resumed run's first step (6)."""
    from lit_dtrain.train import train

    n = 6
    common = ["callbacks=[default,loss_spike]", "sample.max_new_tokens=0", "trainer.val_check_interval=3",
              f"scheduler.total_steps={2 * n}", "callbacks.loss_spike.warmup_steps=2", "model.dropout=0.1",
              "+callbacks.inject._target_=tests.unit._loss_spike_helpers.InjectAt",
              "+callbacks.inject.finite=[3,5,6,8]", "+callbacks.inject.nan=[10]"]
    _, straight = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", run="straight"))
    train(tiny_cfg(*common, f"trainer.max_steps={n}", run="split"))
    _, resumed = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", "resume=auto", run="split"))

    def monitor(objects) -> LossSpikeMonitor:
        return next(c for c in objects["trainer"].callbacks if isinstance(c, LossSpikeMonitor))

    a, b = monitor(straight), monitor(resumed)
    assert [e["step"] for e in a.events] == [3, 5, 6, 8, 10]  # skips before, at and after the split
    assert b.excluded == a.excluded and b.num_spikes == a.num_spikes
    run_dir = Path(resumed["trainer"].default_root_dir)
    steps = [json.loads(x)["step"] for x in (run_dir / "spikes.jsonl").read_text().splitlines()]
    assert steps == [e["step"] for e in a.events]  # the first half's events, then the resumed half's
    excluded = resumed["datamodule"].sampler.excluded.nonzero().flatten().tolist()
    assert excluded == sorted(a.excluded)
    sa, sb = straight["module"].model.state_dict(), resumed["module"].model.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_16_mixed_grad_scaler_skip_and_rollback(tmp_path: Path, fused: bool, action: str) -> None:
    """A real GradScaler (fp16 autocast on CPU via an explicit plugin): params, optimizer and scaler exact.

    Fused AdamW unscales inside ``step`` (grads reach the hook still scaled); foreach AdamW is unscaled by
    Lightning first. Both must leave ``scaler.update()`` an inf check, or it raises.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lit_dtrain.optim import adamw

    class ScalerProbe(L.Callback):
        def __init__(self):
            self.states = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.states[trainer.global_step] = dict(trainer.precision_plugin.scaler.state_dict())

    monitor, probe, scaler_probe = LossSpikeMonitor(actions=[action], warmup_steps=3, snapshot_every=2), Probe(), \
        ScalerProbe()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1))
    clip = AdaptiveGradClip(warmup_steps=3)  # also under the scaler: norms measured unscaled
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, plugins=[plugin], logger=False,
                        callbacks=[Inject({6: "finite"}), monitor, clip, probe, scaler_probe],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    module = make_module()
    module.optimizer_factory = partial(adamw, lr=3e-3, fused=fused)
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [6]
    # skip: as after step 5; rollback: snapshot 6 is too new (min age 1), so snapshot 4 is restored
    expected = 6 if action == "skip" else 4
    assert_identical(probe.after[expected], probe.after[7], schedule=False)
    assert_schedule_follows_the_step(probe)
    assert scaler_probe.states[7] == scaler_probe.states[expected]  # scale and growth tracker too
    assert scaler_probe.states[8]["scale"] == 2 * scaler_probe.states[7]["scale"]  # and the scaler carries on
    assert clip.stat.ready and 0.05 < clip.stat.location() < 50  # unscaled norms (the scale reaches 2**16)


def test_a_run_that_is_nan_at_every_step_stops_instead_of_skipping_forever(tmp_path: Path) -> None:
    """Skip drops a NaN step; but if every step is NaN the run cannot recover and must not end as a success."""
    from lit_dtrain.module import NonFiniteError

    nan_from_3 = Inject({s: "nan" for s in range(3, 40)})
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=4)
    trainer = make_trainer(tmp_path, [nan_from_3, monitor], max_steps=30)
    with pytest.raises(NonFiniteError, match=r"4 non-finite \(NaN/inf\) steps in a row, steps 3-6"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert trainer.global_step == 7  # steps 3..6 were dropped, not applied, before it stopped
    assert len((tmp_path / "spikes.jsonl").read_text().splitlines()) == 4
    # an isolated NaN step is still just skipped: the count restarts at every finite step
    sparse = Inject({3: "nan", 5: "nan", 7: "nan"})
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=2)
    trainer = make_trainer(tmp_path / "sparse", [sparse, monitor], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path / "sparse"))
    assert trainer.global_step == 10 and monitor.num_spikes == 3 and monitor.nonfinite_run == []


def test_tensorboard_scalars_are_written_at_the_step_they_describe(tmp_path: Path) -> None:
    """Lightning writes step metrics only at its log cadence (after step ``k`` with ``(k + 1) % n == 0``); a value
    self.log-ged at another step was written at the next such step under that step's number. So a spike's z at
    step 7 showed as step 9's, and every later point was the z of 4 steps earlier."""

    class Decisions(L.Callback):
        def __init__(self):
            self.z, self.count = {}, {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - 1  # the step that just ended: Lightning's (and TensorBoard's) x
            self.z[step], self.count[step] = monitor.last_decision.loss_z, float(monitor.num_spikes)

    monitor, decisions = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3), Decisions()
    acc = fit_with_tensorboard(tmp_path, [Inject({7: "finite"}), monitor, decisions], 20, log_every_n_steps=5)
    assert [e["step"] for e in monitor.events] == [7]
    z = {e.step: e.value for e in acc.Scalars("spike/loss_z")}
    count = {e.step: e.value for e in acc.Scalars("spike/count")}
    # the cadence's steps (4, 9, 14, 19) with their own values, and the spike at its own step
    assert z == pytest.approx({s: decisions.z[s] for s in (4, 7, 9, 14, 19)}, rel=1e-6)
    assert z[7] > 6 and all(abs(z[s]) < 6 for s in (4, 9, 14, 19))
    assert count == {s: decisions.count[s] for s in (4, 7, 9, 14, 19)} == {4: 0.0, 7: 1.0, 9: 1.0, 14: 1.0, 19: 1.0}


def test_loss_z_is_logged_from_the_first_step_after_the_warmup(tmp_path: Path) -> None:
    """With warmup_steps=w, steps 0..w-1 fill the statistics and cannot be spikes; their z is not logged. The check
    ran after the decision had added its value, so the z of step w-1 (computed from w-1 values, before the warmup's
    despiking) was written, e.g. a large z of an undetectable warmup spike with no event."""
    monitor = LossSpikeMonitor(actions=["log"], warmup_steps=5)
    acc = fit_with_tensorboard(tmp_path, [Inject({4: "finite"}), monitor], 8, log_every_n_steps=1)
    assert monitor.events == []  # step 4 is still in the warmup: no spike possible
    assert [e.step for e in acc.Scalars("spike/loss_z")] == [5, 6, 7]
    assert [e.step for e in acc.Scalars("spike/count")] == list(range(8))


def test_a_nan_spike_inside_the_warmup_logs_its_loss_z_capped(tmp_path: Path) -> None:
    """docs/loss_spikes.md, the `log` action: `spike/loss_z` is written from the first step after the warmup, and
    also at a spike inside the warmup (only a NaN/inf step can be one there), capped at 1e6; `spike/lr_multiplier`
    only with `lr_cooldown`. (The doc said only "from the first step after the warmup".)"""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5)
    acc = fit_with_tensorboard(tmp_path, [Inject({2: "nan"}), monitor], 7, log_every_n_steps=1)
    assert [e["step"] for e in monitor.events] == [2]
    # the spike's value never enters the statistics, so the 5 warmup values are steps 0, 1, 3, 4, 5: z from step 6
    assert [e.step for e in acc.Scalars("spike/loss_z")] == [2, 6]
    assert acc.Scalars("spike/loss_z")[0].value == 1e6
    assert "spike/lr_multiplier" not in acc.Tags()["scalars"]
