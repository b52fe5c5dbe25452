"""lit_dtrain's LR callbacks in a Lightning project of a user's own (see test_callbacks_in_foreign_projects.py):
``WSDScheduler`` under manual optimization (one or two optimizers, accumulation by hand, a per-step LR scaling, an
update the GradScaler skipped), on a user's param groups, past its ``total_steps``; ``OncePerStepLRMonitor`` in an
epoch-based run."""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision

from lit_dtrain.callbacks import WSDScheduler
from tests.unit._user_project_helpers import MIXED, UpdateLRs, UserModule, fit, regression_data


@pytest.mark.parametrize(("two", "step_every"), [(True, 1), (False, 2), (False, 1)])
def test_wsd_under_manual_optimization_follows_each_optimizers_updates(tmp_path: Path, two: bool, step_every: int):
    """Under manual optimization Lightning's global_step counts every optimizer.step: with two optimizers stepping each
    batch it advances by 2 a batch, and the schedule, which followed it, gave each optimizer every other LR of the
    schedule (0.5, 1.0, 0.0, 0.0 for 4 updates of a 4-step schedule; its warmup and stable phase in half the updates).
    The k-th update of each optimizer now uses the schedule's LR for step k; one that accumulates by hand (an update
    every 2 batches) keeps following its updates, and so does a plain manual loop."""
    wsd, record = WSDScheduler(total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear"), UpdateLRs()
    optimizers = 2 if two else 1
    fit(tmp_path, [wsd, record], UserModule(manual=True, two=two, step_every=step_every), max_steps=4 * optimizers)
    expected = [1e-2 * wsd.lr_factor(k) for k in range(4)]
    assert [0.5, 1.0, 0.5, 0.0] == [wsd.lr_factor(k) for k in range(4)]
    for i in range(optimizers):
        assert record.used[i] == expected, i


class HalveLRInsideStep(L.Callback):
    """Scales the LR of every update by 0.5 the way ``FourierSamplerCallback``'s stage multiplier does (a step pre-hook
    through ``_lr_scaling``, undone right after the update)."""

    def on_train_start(self, trainer, pl_module) -> None:
        from lit_dtrain.callbacks._lr_scaling import scale_lrs_for_step

        for opt in trainer.optimizers:
            opt.register_step_pre_hook(lambda o, args, kwargs: scale_lrs_for_step(o, 0.5))


def test_wsd_under_manual_optimization_composes_with_a_per_step_lr_scaling(tmp_path: Path) -> None:
    """The schedule sets the next update's LR inside optimizer.step (a post-hook); the scaling's own restore, a later
    post-hook, would put back the LR from before the update over it unless it is taken back first."""
    wsd, record = WSDScheduler(total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, HalveLRInsideStep(), record], UserModule(manual=True), max_steps=4)
    assert record.used[0] == [0.5 * 1e-2 * wsd.lr_factor(k) for k in range(4)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-2 * wsd.lr_factor(4)  # the schedule's, unscaled


@pytest.mark.parametrize("trainer_kwargs", [{}, MIXED], ids=["fp32", "bf16_accumulate2"])
def test_wsd_sets_each_param_groups_lr_of_a_users_optimizer_exactly(tmp_path: Path, trainer_kwargs) -> None:
    """Two param groups with peaks 1e-2 and 1e-3: every update uses each group's peak times the schedule's factor for
    its step, float for float; under accumulation once per optimizer step."""
    wsd = WSDScheduler(total_steps=6, warmup_steps=2, decay_steps=3, decay_type="linear")
    first, second = UpdateLRs(group=0), UpdateLRs(group=1)
    trainer = fit(tmp_path, [wsd, first, second], UserModule(groups=True), max_steps=6, **trainer_kwargs)
    assert trainer.global_step == 6
    assert first.used[0] == [1e-2 * wsd.lr_factor(k) for k in range(6)]
    assert second.used[0] == [1e-3 * wsd.lr_factor(k) for k in range(6)]
    assert len(set(first.used[0])) == 5  # warmup, peak, three decay steps (the last at 0): the schedule moved


class OverflowAtBatch(UserModule):
    """``UserModule`` under manual optimization whose loss is inf at batch ``bad`` (an fp16 overflow the GradScaler
    skips under ``16-mixed``); ``fused``: a fused AdamW, which unscales inside ``step`` (its hooks still run)."""

    def __init__(self, bad: int, fused: bool) -> None:
        super().__init__(manual=True)
        self.bad, self.fused = bad, fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y) * (math.inf if batch_idx == self.bad else 1.0)
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2, fused=self.fused)


class LRAtEachStepCall(L.Callback):
    """The LR of param group 0 at every ``optimizer.step`` call, taken or skipped by the GradScaler, and the scale."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.lrs, self.scales = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_wsd_under_manual_optimization_counts_a_step_the_gradscaler_skipped(tmp_path: Path, fused: bool) -> None:
    """Under ``16-mixed`` the GradScaler skips an update whose grads overflowed: a foreach optimizer's ``step`` (and its
    post-hook) is then never called, a fused one's is (it skips inside). Both count it as one of the schedule's steps,
    as automatic optimization does (``global_step``, and so the schedule, advance on a skipped step): else the
    schedule fell one step behind per skip and never reached its end by ``max_steps``, and only for foreach."""
    wsd, record = WSDScheduler(total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear"), LRAtEachStepCall()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = fit(tmp_path, [wsd, record], OverflowAtBatch(bad=1, fused=fused), max_steps=4, plugins=[plugin])
    assert record.scales[2] == record.scales[1] / 2  # the overflowed step was skipped
    assert record.lrs == [1e-2 * wsd.lr_factor(k) for k in range(4)]
    assert wsd.updates == [4]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-2 * wsd.lr_factor(4)


@pytest.mark.parametrize(
    ("total_steps", "trainer_kwargs", "warned"),
    [
        (8, {"max_steps": -1, "max_epochs": 2}, True),  # 2 epochs of 8 batches: 16 steps, the last 8 at LR 0
        (16, {"max_steps": -1, "max_epochs": 2}, False),
        (8, {"max_steps": -1, "max_epochs": 2, "accumulate_grad_batches": 2}, False),  # 2 x 4 steps
        (8, {"max_steps": 12}, True),
        (11, {"max_steps": 12}, True),  # "the last 1 steps run at" before
        (12, {"max_steps": 12}, False),
    ],
    ids=["epochs_past", "epochs_match", "epochs_accumulate_match", "steps_past", "one_step_past", "steps_match"],
)
def test_wsd_warns_when_the_trainer_runs_past_its_total_steps(tmp_path: Path, total_steps, trainer_kwargs, warned):
    """A user's ``Trainer(max_epochs=...)`` (or a ``max_steps`` beyond the horizon) whose steps outnumber
    ``total_steps``: every step after the decay runs at ``min_lr_factor`` (LR 0), which was silent. Now a warning at
    train start names both counts; a matching horizon says nothing."""
    wsd = WSDScheduler(total_steps=total_steps, warmup_steps=2, decay_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, [wsd], **trainer_kwargs)
    horizon = [str(w.message) for w in caught if "WSDScheduler: the trainer will take" in str(w.message)]
    if warned:
        steps = trainer.global_step
        assert steps > total_steps and trainer.optimizers[0].param_groups[0]["lr"] == 0.0  # what it warned about
        assert horizon == [
            f"WSDScheduler: the trainer will take {steps} optimizer steps (trainer.estimated_stepping_batches, from "
            f"max_steps/max_epochs), but total_steps={total_steps}: the decay ends at step {total_steps - 1} and the "
            f"last {'1 step runs' if steps == total_steps + 1 else f'{steps - total_steps} steps run'} at "
            f"min_lr_factor=0.0 of the peak LR. Set total_steps={steps} (or "
            f"stop the trainer at max_steps={total_steps})"
        ]
    else:
        assert trainer.global_step == total_steps and horizon == []


@pytest.mark.parametrize(
    ("scheduler", "accumulate"),
    [(False, 1), (False, 2), (True, 1)],
    ids=["no_scheduler", "accumulate2", "epoch_steplr"],
)
def test_once_per_step_lr_monitor_writes_one_row_per_step_in_an_epoch_based_run(tmp_path: Path, scheduler, accumulate):
    """With Lightning's default ``logging_interval=None``, an optimizer without an LR scheduler (the one a
    ``WSDScheduler`` drives) was logged at every epoch start and again by the epoch's first batch: two rows at the first
    step of each epoch of a ``max_epochs`` run. Now one row per step; an epoch-interval scheduler (``StepLR``) still
    gets its row at each epoch start."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_dtrain.callbacks import OncePerStepLRMonitor

    trainer = L.Trainer(
        accelerator="cpu", max_epochs=3, limit_train_batches=4, accumulate_grad_batches=accumulate, log_every_n_steps=1,
        logger=CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[OncePerStepLRMonitor()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(UserModule(scheduler=scheduler), regression_data())
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["lr-AdamW"])) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    if scheduler:  # StepLR(step_size=3, gamma=0.5) stepped per epoch: one row at each epoch's first step
        assert rows == [(0, 1e-2), (4, 1e-2), (8, 1e-2)]
    else:
        assert rows == [(step, 1e-2) for step in range(trainer.global_step)] and trainer.global_step == 12 // accumulate


def test_a_checkpoint_saved_after_a_resume_that_trained_nothing_keeps_the_wsd_horizon(tmp_path: Path) -> None:
    """A fit resumed at its ``max_steps`` trains nothing and never reaches train start; a checkpoint saved after it
    held ``total_steps=None`` (the horizon is taken there), so the same fit extended from it jumped back to the peak LR
    without the warning that the first checkpoint gives."""
    first = fit(tmp_path, [WSDScheduler(decay_fraction=0.25)], max_steps=8)
    first.save_checkpoint(tmp_path / "a.ckpt")
    again = fit(tmp_path, [WSDScheduler(decay_fraction=0.25)], max_steps=8, ckpt_path=tmp_path / "a.ckpt")
    assert again.global_step == 8
    again.save_checkpoint(tmp_path / "b.ckpt")
    state = torch.load(tmp_path / "b.ckpt", weights_only=False)["callbacks"]
    assert [(s["total_steps"], s["decay_steps"]) for k, s in state.items() if "WSD" in k] == [(8, 2)]  # (None, None)
    with pytest.warns(UserWarning, match="this fit plans 16 optimizer steps, the checkpoint's run planned 8"):
        fit(tmp_path, [WSDScheduler(decay_fraction=0.25)], max_steps=16, ckpt_path=tmp_path / "b.ckpt")


def test_a_second_fit_beside_an_accumulation_schedule_follows_the_schedule_on_a_new_optimizer(tmp_path: Path):
    """What docs/callbacks_in_your_project.md says of a second ``trainer.fit`` of the same Trainer: Lightning's
    ``GradientAccumulationScheduler`` refuses it until ``trainer.accumulate_grad_batches`` is set back to 1 (its first
    fit left the scheduled value there), ``WSDScheduler(total_steps=None)`` then counts the new epochs at their
    scheduled accumulation (16 steps where 12 were planned: the warning of a horizon moved), and the fit runs on a new
    optimizer (Lightning calls ``configure_optimizers`` again), so
    only ``save_checkpoint`` + ``ckpt_path`` continues the straight run's weights exactly."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def run(twice: bool, through_checkpoint: bool = False, total_steps: int | None = None):
        wsd, record = WSDScheduler(total_steps, warmup_steps=2, decay_steps=4, decay_type="linear"), UpdateLRs()
        trainer = L.Trainer(accelerator="cpu", max_epochs=2 if twice else 3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            callbacks=[wsd, GradientAccumulationScheduler({1: 2}), record])
        module = UserModule()
        trainer.fit(module, regression_data())  # epochs of 8 batches: 8 steps, then 4 an epoch
        if twice:
            first, path = record.used[0], tmp_path / "first.ckpt"
            if through_checkpoint:  # (right after the fit: the refused one below built a new optimizer too)
                trainer.save_checkpoint(path)
            trainer.fit_loop.max_epochs = 3
            with pytest.raises(ValueError, match="accumulate_grad_batches"):  # Lightning's refusal
                trainer.fit(module, regression_data())
            trainer.accumulate_grad_batches = 1
            trainer.fit(module, regression_data(), ckpt_path=path if through_checkpoint else None)
            record.used[0] = first + record.used[0]
        return module, wsd, record.used[0]

    straight, wsd, lrs = run(twice=False)
    assert wsd.total_steps == 16 and lrs == [1e-2 * wsd.lr_factor(k) for k in range(16)]
    again, wsd_again, lrs_again = run(twice=True)
    first = WSDScheduler(total_steps=12, warmup_steps=2, decay_steps=4, decay_type="linear")  # the first fit's plan
    assert lrs_again[:12] == [1e-2 * first.lr_factor(k) for k in range(12)]
    assert wsd_again.total_steps == 16 and lrs_again[12:] == lrs[12:]  # epoch 2 at its scheduled accumulation
    # the same LRs (a given horizon): the weights differ by the optimizer alone
    straight, _, _ = run(twice=False, total_steps=16)
    again, _, _ = run(twice=True, total_steps=16)
    new_optimizer = torch.cat([(a - b).flatten() for a, b in zip(straight.parameters(), again.parameters())])
    assert new_optimizer.abs().max() > 1e-3  # (0.021 off in the doc's run: AdamW's moments started over)
    resumed, _, _ = run(twice=True, through_checkpoint=True, total_steps=16)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
