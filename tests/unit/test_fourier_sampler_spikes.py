"""FourierSampler beside LossSpikeMonitor: dropped steps, non-finite token losses, the restored lr, skipped batches."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from omegaconf import open_dict

from lit_dtrain.callbacks import FourierSamplerCallback, LossSpikeMonitor
from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.data.samplers import spectral as S
from lit_dtrain.train import train
from tests.unit._fourier_helpers import _LrRecorder, feed, make


class _ScaleLogitsAt(L.Callback):
    """Multiplies the logits by 50 for one step: a finite loss spike that LossSpikeMonitor skips."""

    def __init__(self, step: int) -> None:
        self.step, self.handle = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * 50.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_a_skipped_spike_batch_is_left_out_of_the_magnitude_mean_through_the_callbacks(tiny_cfg):
    """The callbacks' path: the FourierSamplerCallback scored every batch, also the one LossSpikeMonitor skips; the
    monitor then excludes its samples. The mean of ``magnitude`` must be over the seen samples still drawable
    (before the fix it was 4.18 here, over all seen samples, against 3.38 without the 4 spiked ones). The callback
    now leaves the skipped batch out of the table altogether (test_the_table_does_not_learn_from_a_step_the_monitor_
    dropped); the mean is still over the drawable samples."""
    cfg = tiny_cfg("data/sampler=fourier", "data.sampler.variant=magnitude", "data.sampler.stages=false",
                   "callbacks=[default,loss_spike,fourier_sampler]", "callbacks.loss_spike.warmup_steps=3",
                   "trainer.max_steps=14", "sample.max_new_tokens=0")
    with open_dict(cfg):
        cfg.callbacks["spike"] = {"_target_": f"{__name__}._ScaleLogitsAt", "step": 8}
    _, objects = train(cfg)
    sampler = objects["datamodule"].sampler
    monitor = next(c for c in objects["trainer"].callbacks if isinstance(c, LossSpikeMonitor))
    assert [(e["step"], e["actions"]) for e in monitor.events] == [(8, ["log", "skip"])]
    seen = sampler.visits > 0
    assert sampler.num_excluded == 4
    elem = S.importance_elementwise(sampler.m1, sampler.m2, sampler.visits, "magnitude")
    assert sampler._distribution()["mean"] == pytest.approx(float(elem[seen & ~sampler.excluded].mean()), rel=1e-12)


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_nonfinite_token_loss_is_left_out_of_the_table(variant):
    """A NaN/inf row (an fp16 overflow that the GradScaler skips) must not poison its sample's moments, nor,
    through the shared band weights, the scores of the other samples of its batch."""
    clean, dirty = make(variant=variant, stages=False), make(variant=variant, stages=False)
    feed(clean, 5)
    feed(dirty, 5)
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(4, 64, generator=g) + 1.0
    bad = loss.clone()
    bad[1, 10] = float("nan")
    bad[3] = float("inf")
    idx = torch.tensor([40, 41, 42, 43])
    before = dirty.visits.clone()
    clean.observe(loss[[0, 2]], idx[[0, 2]], 6)
    stats = dirty.observe(bad, idx, 6)
    assert stats["nonfinite"] == 2 and dirty.nonfinite_skipped == 2
    for key in ("m1", "m2", "visits"):  # exactly as if only the two finite rows had been observed
        assert torch.equal(getattr(clean, key), getattr(dirty, key)), key
    assert torch.equal(dirty.visits - before, torch.isin(torch.arange(50), idx[[0, 2]]).int())
    p = dirty.probabilities(6)
    assert bool(torch.isfinite(p).all()) and p.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert torch.equal(dirty.global_batch(6, 32), clean.global_batch(6, 32))
    restored = make(variant=variant, stages=False)
    restored.load_state_dict(dirty.state_dict())
    assert restored.nonfinite_skipped == 2


class _StageLrData(L.LightningDataModule):
    """64 single-index batches and a FourierSampler whose one stage scales the LR by 0.5 (steps 0-3, then held)."""

    def __init__(self):
        super().__init__()
        self.sampler = FourierSampler(stage_table=[["a", 0, 4, 0.3, 0.5]], step_unit=1)
        self.sampler.setup(64, seed=0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([{"index": torch.tensor([i])} for i in range(64)], batch_size=None)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
@pytest.mark.parametrize("order", ["fourier_first", "loss_spike_first"])
def test_stage_lr_and_spike_cooldown_both_restore_the_lr_in_either_order(tmp_path, order, precision):
    """The FourierSampler's stage LR multiplier (0.5) and LossSpikeMonitor's lr_cooldown (0.1 for 2 steps after the
    spike at step 5) both scale the LR for one optimizer step and put it back. Without an LR scheduler (nothing
    recomputes the LR each step) every put-back must be exact in either callback order: with the monitor listed
    first its restore ran before the sampler's, which then wrote back the cooled LR (0.1), and the LR decayed for
    good (each later cool-down compounded). Which order failed depended on the precision: under 32-true Lightning
    runs the closure (so the monitor's on_before_optimizer_step) inside optimizer.step after the step pre-hooks, under
    16-mixed before optimizer.step."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            scale = 10.0 if self.trainer.global_step == 5 else 1.0
            token_loss = (1.0 + 0.001 * self.w) * torch.linspace(1, 2, 16)[None] * scale
            return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

        def configure_optimizers(self):
            return UsedLrSGD(self.parameters(), lr=1.0)

    class UsedLrSGD(torch.optim.SGD):
        """Records the LR of each update, taken after the closure (under 32-true Lightning runs the closure, so
        on_before_optimizer_step, inside step, after the step pre-hooks)."""

        def step(self, closure=None):
            loss = None if closure is None else closure()
            used.append(self.param_groups[0]["lr"])
            super().step()
            return loss

    used: list[float] = []

    fourier = FourierSamplerCallback()
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], warmup_steps=3, cooldown_factor=0.1, cooldown_steps=2,
                               cooldown_ramp_steps=0, path=str(tmp_path / "spikes.jsonl"))
    recorder = _LrRecorder()
    callbacks = [fourier, monitor] if order == "fourier_first" else [monitor, fourier]
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))] \
        if precision == "16-mixed" else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[*callbacks, recorder],
                        plugins=plugins)
    trainer.fit(Module(), datamodule=_StageLrData())
    assert [e["step"] for e in monitor.events] == [5]
    assert recorder.after == [1.0] * 10  # the configured LR after every step
    assert used == pytest.approx([0.5] * 5 + [0.05, 0.05] + [0.5] * 3)


def test_an_exception_inside_the_step_leaves_neither_hooks_nor_a_scaled_lr(tmp_path):
    """A raise inside optimizer.step (here from the closure, which Lightning runs there under 32-true, after the
    sampler's pre-hook scaled the LR by 0.5) left the optimizer with the sampler's hooks and the scaled LR (0.5); the
    optimizer outlives the failed fit (the module keeps it, a user retries or inspects it)."""
    from lit_dtrain.callbacks import OptimizerDiagnostics

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                raise RuntimeError("boom at step 3")
            token_loss = (1.0 + 0.001 * self.w) * torch.linspace(1, 2, 16)[None]
            return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

        def configure_optimizers(self):
            self.opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return self.opt

    module = Module()
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FourierSamplerCallback(), monitor, OptimizerDiagnostics(every_n_steps=1)])
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit(module, datamodule=_StageLrData())
    assert module.opt.param_groups[0]["lr"] == 1.0
    assert len(module.opt._optimizer_step_pre_hooks) == 0  # (torch's own registry of step pre-hooks)


class _TableAtBatchStart(L.Callback):
    """The sampler's table (m1, m2, visits, profile, updates) when each micro-batch starts, by global step: at the
    start of step s + 1 every callback has finished step s."""

    def __init__(self) -> None:
        self.tables: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sampler = trainer.datamodule.sampler
        sampler.flush()
        self.tables.setdefault(trainer.global_step, {
            "m1": sampler.m1.clone(), "m2": sampler.m2.clone(), "visits": sampler.visits.clone(),
            "profile": sampler.profile.clone(), "updates": sampler.updates})


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("order", ["monitor_first", "sampler_first"])
def test_the_table_does_not_learn_from_a_step_the_monitor_dropped(tiny_cfg, order, accumulate):
    """FourierSamplerCallback scored every batch, also the one LossSpikeMonitor then skipped: m1/m2, visits, the band
    profile and the update count took in the spike. A step whose grads the monitor dropped is now left out of the
    table (told, in either callback order, by the grads the optimizer step saw), and only that step: the table is the
    same before and after it, and changes at every other step."""
    callbacks = "[default,loss_spike,fourier_sampler]" if order == "monitor_first" else \
        "[default,fourier_sampler,loss_spike]"
    cfg = tiny_cfg("data/sampler=fourier", "data.sampler.variant=magnitude", "data.sampler.stages=false",
                   f"callbacks={callbacks}", "callbacks.loss_spike.warmup_steps=3", "trainer.max_steps=11",
                   f"trainer.accumulate_grad_batches={accumulate}", "sample.max_new_tokens=0",
                   run=f"{order}_{accumulate}")
    with open_dict(cfg):
        cfg.callbacks["spike"] = {"_target_": f"{__name__}._ScaleLogitsAt", "step": 8}
        cfg.callbacks["tables"] = {"_target_": f"{__name__}._TableAtBatchStart"}
    _, objects = train(cfg)
    trainer = objects["trainer"]
    monitor = next(c for c in trainer.callbacks if isinstance(c, LossSpikeMonitor))
    tables = next(c for c in trainer.callbacks if isinstance(c, _TableAtBatchStart)).tables
    assert [(e["step"], e["actions"]) for e in monitor.events] == [(8, ["log", "skip"])]
    sampler = objects["datamodule"].sampler
    assert sampler.num_excluded == 4 * accumulate  # the monitor still excludes the dropped step's samples
    for step in range(10):
        before, after = tables[step], tables[step + 1]
        same = all(torch.equal(before[k], after[k]) for k in ("m1", "m2", "visits", "profile"))
        assert same == (step == 8), step
        assert after["updates"] - before["updates"] == (0 if step == 8 else accumulate), step
    assert sampler.updates == 10 * accumulate


@pytest.mark.parametrize(("action", "order"), [("skip", "sampler_first"), ("rollback", "monitor_first")])
@pytest.mark.parametrize("fused", [False, True])
def test_the_table_does_not_learn_from_a_step_the_monitor_dropped_under_16_mixed(tmp_path, fused, action, order):
    """Under 16-mixed a dropped step never reaches foreach AdamW's ``step`` (the GradScaler skips it), and fused AdamW
    is called without grads: both are told apart from an applied step, in either callback order."""
    from functools import partial

    from lightning.pytorch.plugins.precision import MixedPrecision

    from lit_dtrain.optim import adamw
    from tests.unit._loss_spike_helpers import Inject, make_data, make_module

    dm = make_data(tmp_path)
    dm.sampler = FourierSampler(stages=False)
    tables = _TableAtBatchStart()
    monitor = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2)
    pair = [FourierSamplerCallback(), monitor] if order == "sampler_first" else [monitor, FourierSamplerCallback()]
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=9, plugins=[plugin], logger=False,
                        callbacks=[Inject({6: "finite"}), *pair, tables],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=str(tmp_path))
    module = make_module()
    module.optimizer_factory = partial(adamw, lr=3e-3, fused=fused)
    trainer.fit(module, datamodule=dm)
    assert [e["step"] for e in monitor.events] == [6]
    for step in range(8):
        same = all(torch.equal(tables.tables[step][k], tables.tables[step + 1][k]) for k in ("m1", "visits"))
        assert same == (step == 6), step


class _LagAtBatchStart(L.Callback):
    """The sampler's applied update count and pending steps when each optimizer step starts."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, list[int]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sampler = trainer.datamodule.sampler
        self.at.setdefault(trainer.global_step, (sampler.updates, [u.step for u in sampler._pending]))


@pytest.mark.parametrize(("action", "accumulate"), [("skip", 1), ("rollback", 2)])
def test_lag_one_applies_the_previous_update_at_a_step_the_monitor_dropped(tmp_path, action, accumulate):
    """With lag=1 the update of step s is applied at the next observe(). A step that LossSpikeMonitor drops (NaN
    loss) is not observed, so the update before it waited a step more: the step after the dropped one drew from the
    table through s - 3, not s - 2. The callback now applies it at the dropped step's end."""
    from tests.unit._loss_spike_helpers import Inject, make_data, make_module

    dm = make_data(tmp_path)
    dm.sampler = FourierSampler(stages=False, lag=1)
    record = _LagAtBatchStart()
    monitor = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, accumulate_grad_batches=accumulate, logger=False,
                        callbacks=[Inject({6: "nan"}), monitor, FourierSamplerCallback(), record],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(make_module(), datamodule=dm)
    assert [e["step"] for e in monitor.events] == [6]
    for step in range(2, 10):  # the draw of step s sees every trained step up to s - 2; only s - 1 is pending
        trained = [k for k in range(step - 1) if k != 6]
        assert record.at[step] == (accumulate * len(trained), [step - 1] * accumulate * (step != 7)), step


def test_a_rollback_keeps_the_table_of_the_steps_between_its_snapshot_and_the_spike(tiny_cfg):
    """The table is data state, not training state: a rollback restores the weights of the snapshot at step 4, but the
    table keeps what steps 4 to 7 taught it (losses measured with the weights it discards), and only the spiking step
    8 is left out of it (docs/loss_spikes.md, ``rollback``; docs/fourier_sampler.md, *Dropped steps*)."""
    cfg = tiny_cfg("data/sampler=fourier", "data.sampler.stages=false", "callbacks=[default,loss_spike]",
                   "callbacks.loss_spike.actions=[log,rollback]", "callbacks.loss_spike.warmup_steps=3",
                   "callbacks.loss_spike.snapshot_every=4", "trainer.max_steps=10", "sample.max_new_tokens=0")
    with open_dict(cfg):
        cfg.callbacks["spike"] = {"_target_": f"{__name__}._ScaleLogitsAt", "step": 8}
        cfg.callbacks["tables"] = {"_target_": f"{__name__}._TableAtBatchStart"}
    _, objects = train(cfg)
    monitor = next(c for c in objects["trainer"].callbacks if isinstance(c, LossSpikeMonitor))
    tables = next(c for c in objects["trainer"].callbacks if isinstance(c, _TableAtBatchStart)).tables
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events] == [(8, 4)]
    assert all(torch.equal(tables[9][k], tables[8][k]) for k in ("m1", "m2", "visits", "profile"))
    assert tables[9]["updates"] == tables[8]["updates"] == 8 != tables[4]["updates"]
    assert not torch.equal(tables[9]["visits"], tables[4]["visits"])
