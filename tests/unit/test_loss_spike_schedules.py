"""LossSpikeMonitor with lr schedules, logging cadence, short accumulation windows and reused monitors or trainers."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import AdaptiveGradClip, LossSpikeMonitor
from tests.unit._loss_spike_helpers import (
    Inject,
    make_data,
    make_module,
    make_trainer,
    one_thread,  # noqa: F401 - its autouse fixture, as before the split
)


def test_rollback_under_the_wsd_callback_keeps_the_lr_of_the_step(tmp_path: Path) -> None:
    """A rollback reloads the optimizer state, whose param groups hold the snapshot's LR. With the WSDScheduler
    callback (no LR scheduler) listed before the monitor, that stale LR stayed in the optimizer until the next
    batch start, where LearningRateMonitor logged it (0.0021 instead of the 0.0027 used at step 8)."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_dtrain.callbacks import WSDScheduler

    class UsedLr(L.Callback):
        def __init__(self):
            self.lr = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lr[trainer.global_step] = optimizer.param_groups[0]["lr"]

    wsd = WSDScheduler(total_steps=12, warmup_steps=10, decay_steps=1)
    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=3, snapshot_every=2)
    used = UsedLr()
    module = make_module()
    module.scheduler_factory = None
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, log_every_n_steps=1,
                        callbacks=[LearningRateMonitor(logging_interval="step"), wsd, Inject({7: "finite"}), monitor,
                                   used],
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        limit_val_batches=0)
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events] == [(7, 6)]
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("lr-")]  # one per param group
    # by hand: warmup (s + 1) / 10 to step 9, stable at step 10, the 1-step decay to 0 at step 11
    expected = {s: 3e-3 * factor for s, factor in enumerate([(s + 1) / 10 for s in range(10)] + [1.0, 0.0])}
    assert used.lr == pytest.approx(expected, rel=1e-6)
    assert len(tags) == 2
    for tag in tags:  # step 8 too, right after the rollback
        assert {e.step: e.value for e in acc.Scalars(tag)} == pytest.approx(expected, rel=1e-6), tag


def test_log_every_n_steps_zero_writes_only_the_events(tmp_path: Path) -> None:
    """``Trainer(log_every_n_steps=0)`` is Lightning's "no step logging" (its own train/loss and the LR monitor write
    nothing). 3c9b2e8 read 0 as 1, so spike/* and grad_clip/* were written at every step; only the events (the
    spike at 7 and its clip) are."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor, clip = LossSpikeMonitor(actions=["log"], warmup_steps=3), AdaptiveGradClip(warmup_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, callbacks=[Inject({7: "finite"}), clip, monitor],
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0), log_every_n_steps=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), limit_val_batches=0)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [7] and clip.clip_events == 1
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("spike/count")] == [7]
    assert [e.step for e in acc.Scalars("grad_clip/clipped")] == [7]
    assert [e.value for e in acc.Scalars("grad_clip/clipped")] == [1.0]


def test_a_short_accumulation_window_at_the_end_of_an_epoch_is_judged_by_its_mean_loss(tmp_path: Path) -> None:
    """A LightningModule of one's own with ``max_epochs`` and ``accumulate_grad_batches=4`` over 5 batches per epoch:
    every epoch ends in an optimizer step of 1 micro-batch, whose loss Lightning still divides by 4 before backward.
    The monitor summed those divided losses, so it saw that step at a quarter of its loss: a 3x spike there read as
    0.75x and was never detected, and every such step pulled the statistics down. The decision must use the mean
    loss of the micro-batches the step had."""
    from torch.utils.data import DataLoader

    class Constant(L.LightningModule):  # every sample has the same loss, and lr=0 keeps it so
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.losses: list[tuple[int, float]] = []  # (optimizer step, unscaled micro-batch loss)
            self.spike_step: int | None = None

        def training_step(self, batch, batch_idx):
            loss = (self.lin(batch["x"]) ** 2).mean() + 1.0
            if self.trainer.global_step == self.spike_step:
                loss = loss * 3.0
            self.losses.append((self.trainer.global_step, float(loss.detach())))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Decisions(L.Callback):  # after the monitor: the loss it decided on, per optimizer step
        def __init__(self, monitor) -> None:
            self.monitor, self.loss = monitor, {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.loss[trainer.global_step] = self.monitor.last_decision.loss

    items = [{"x": torch.ones(4), "index": torch.tensor(i)} for i in range(20)]  # 5 batches of 4
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    decisions = Decisions(monitor)
    module = Constant()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, accumulate_grad_batches=4, logger=False,
                        callbacks=[monitor, decisions], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=4))
    assert trainer.global_step == 8  # 2 optimizer steps per epoch (4 + 1 micro-batches)
    for step in range(8):
        micro = [loss for s, loss in module.losses if s == step]
        assert len(micro) == (4 if step % 2 == 0 else 1)
        assert decisions.loss[step] == pytest.approx(sum(micro) / len(micro), rel=1e-6), step
    module.spike_step = 7  # epoch 3's last optimizer step: its single micro-batch (samples 16-19) at 3x the loss
    monitor2 = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes2.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, accumulate_grad_batches=4, logger=False,
                        callbacks=[monitor2], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    module.losses.clear()
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=4))
    assert [(e["step"], e["reasons"]) for e in monitor2.events] == [(7, ["loss"])]
    assert monitor2.events[0]["index"] == [16, 17, 18, 19]


@pytest.mark.parametrize("scheduler", ["lambda", "exponential"])
def test_lr_cooldown_survives_a_step_the_grad_scaler_skips(tmp_path: Path, scheduler: str) -> None:
    """Under ``16-mixed`` the GradScaler skips ``optimizer.step`` on an fp16 overflow, and with it the optimizer's
    post-hook that takes the cool-down multiplier out again; Lightning still steps the LR scheduler. The multiplier was
    put in at ``on_before_optimizer_step``, so the scheduler stepped from the cooled LR and the restore at batch end
    then wrote the *previous* step's LR back: the next step ran one scheduler step behind (LambdaLR), and a chainable
    scheduler (ExponentialLR) stayed one step behind for the rest of the run. Every step the optimizer takes must run
    at ``scheduled LR x multiplier``, and the group LR must end on the scheduler's."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    class Own(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 1)
            self.lin.weight.register_hook(lambda g: g * math.inf if self.trainer.global_step == 7 else g)

        def training_step(self, batch, batch_idx):
            loss = (self.lin(batch["x"]) - batch["y"]).square().mean()
            return loss * 30.0 if self.trainer.global_step == 5 else loss  # the spike; step 7 overflows in fp16

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s) if scheduler == "lambda"
                     else torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Applied(L.Callback):  # the LR inside optimizer.step, after every other pre-hook
        def __init__(self) -> None:
            self.lr: dict[int, float] = {}

        def on_train_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_pre_hook(
                lambda opt, args, kwargs: self.lr.__setitem__(trainer.global_step, opt.param_groups[0]["lr"]))

    g = torch.Generator().manual_seed(0)
    items = [{"x": x, "y": x.sum(0, keepdim=True)} for x in torch.randn(48, 4, generator=g)]
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], z_threshold=None, rel_threshold=5.0, warmup_steps=3,
                               cooldown_factor=0.1, cooldown_steps=4, cooldown_ramp_steps=0,
                               path=str(tmp_path / "spikes.jsonl"))
    applied = Applied()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=11, plugins=[plugin], logger=False,
                        callbacks=[monitor, applied], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Own(), train_dataloaders=DataLoader(items, batch_size=4))
    assert [e["step"] for e in monitor.events] == [5]
    assert sorted(applied.lr) == [s for s in range(11) if s != 7]  # the scaler skipped step 7
    mult = {s: 0.1 if 5 <= s < 9 else 1.0 for s in range(11)}
    for step, lr in applied.lr.items():
        assert lr == pytest.approx(0.01 * 0.9**step * mult[step], rel=1e-9), step
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.9**11, rel=1e-9)


def test_a_reused_monitor_starts_fresh_in_a_new_fit_and_restores_a_checkpoint(tmp_path: Path) -> None:
    """The same callback object in a second ``trainer.fit`` (a sweep loop, staged training): a fit without
    ``ckpt_path`` starts from a fresh state, exactly as a new monitor would; a fit with ``ckpt_path`` continues
    from the checkpoint's state, not from whatever the object held after its last fit."""
    def fit(monitor, max_steps, inject, ckpt_path=None):
        trainer = make_trainer(tmp_path, [Inject(inject), monitor], max_steps=max_steps)
        trainer.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=ckpt_path)
        return trainer

    reused = LossSpikeMonitor(actions=["log", "skip", "lr_cooldown"], warmup_steps=3, exclude_previous_steps=1)
    trainer = fit(reused, 7, {5: "finite"})
    assert reused.num_spikes == 1 and reused.excluded and reused.events
    trainer.save_checkpoint(tmp_path / "seven.ckpt")
    saved = reused.state_dict()

    fresh = LossSpikeMonitor(actions=["log", "skip", "lr_cooldown"], warmup_steps=3, exclude_previous_steps=1)
    fit(fresh, 6, {})
    fit(reused, 6, {})  # a new fit, no checkpoint: nothing of the first fit may carry over
    assert reused.num_spikes == 0 and reused.excluded == [] and reused.events == []
    assert reused.state_dict()["detector"] == fresh.state_dict()["detector"]
    assert reused.cooldown_start == fresh.cooldown_start and reused.window.steps == []
    assert reused.lr_multiplier(6) == 1.0

    fit(reused, 6, {4: "nan"})  # the object now holds another spike...
    assert reused.num_spikes == 1 and reused.events[0]["step"] == 4

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = reused.state_dict()

    at_start = AtStart()
    trainer = make_trainer(tmp_path, [reused, at_start], max_steps=9)
    trainer.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=str(tmp_path / "seven.ckpt"))
    # ... but a fit from the checkpoint starts from the checkpoint's state
    assert at_start.state["detector"] == saved["detector"]
    assert at_start.state["excluded"].tolist() == saved["excluded"].tolist()
    assert at_start.state["num_spikes"] == 1 and at_start.state["cooldown_start"] == saved["cooldown_start"]
    assert [e["step"] for e in reused.events] == []  # the events of this fit (none after step 7)


def test_the_same_trainer_continuing_keeps_the_monitor_state(tmp_path: Path) -> None:
    """``trainer.fit`` again on the same Trainer with a raised max_steps continues the run (global_step goes on from
    7, the weights are the trained ones): the monitor's statistics, spike count and exclusions go on too; only a
    fit that starts at step 0 without a checkpoint starts fresh."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=7)
    module, dm = make_module(), make_data(tmp_path)
    trainer.fit(module, datamodule=dm)
    count, excluded = monitor.detector.loss_stat.count, list(monitor.excluded)
    assert monitor.num_spikes == 1 and excluded
    trainer.fit_loop.epoch_loop.max_steps = 10
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 10
    assert monitor.num_spikes == 1 and monitor.excluded == excluded
    assert monitor.detector.loss_stat.count == count + 3
