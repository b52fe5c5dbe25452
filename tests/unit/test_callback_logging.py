"""callbacks._logging.log_step_metrics: the step, the rank, callback_metrics, and rows that reach the file; and
OncePerStepLRMonitor: one LR row per logged optimizer step."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks._logging import log_step_metrics
from tests.conftest import event_files


class Module:
    def __init__(self):
        self.logged = {}

    def log(self, name, value, **kwargs):
        assert kwargs["logger"] is False  # Lightning must not write it a second time, at its own cadence
        self.logged[name] = value


def test_rows_are_written_at_the_given_step_and_reach_the_csv_file(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    module = Module()
    log_step_metrics(SimpleNamespace(is_global_zero=True, loggers=[logger]), module, {"a/x": 1.5, "a/y": 2}, 7)
    # no logger.save() from Lightning here: a kill right after the write must not lose the row
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"a/x": "1.5", "a/y": "2.0", "step": "7"}]
    assert module.logged == {"a/x": 1.5, "a/y": 2.0}


class Reads:
    """A 0-dim value that counts its host reads (``float``): on a GPU each is a device sync and a copy."""

    def __init__(self, value: float) -> None:
        self.value, self.reads = value, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_each_value_is_read_from_the_device_once(tmp_path):
    """It was read twice (for callback_metrics, then for the loggers), two syncs per metric on a GPU."""
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    value, module = Reads(0.25), Module()
    log_step_metrics(SimpleNamespace(is_global_zero=True, loggers=[logger, logger]), module, {"a/x": value}, 4)
    assert value.reads == 1 and module.logged == {"a/x": 0.25}


def test_other_ranks_write_nothing(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    log_step_metrics(SimpleNamespace(is_global_zero=False, loggers=[logger]), Module(), {"a/x": 1.0}, 3)
    assert not (tmp_path / "csv" / "version_0" / "metrics.csv").exists()


class LinearLR(L.LightningModule):
    """An SGD whose LR is 0.1 * (step + 1) at optimizer step ``step``: every logged LR names its step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(48, 2, generator=torch.Generator().manual_seed(0))), batch_size=2)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)
        return [optimizer], [{"scheduler": LambdaLR(optimizer, lambda step: step + 1), "interval": "step"}]


def _tensorboard_scalars(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = {}
    for f in event_files(run_dir):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags.setdefault(tag, []).extend((e.step, round(e.value, 6)) for e in acc.Scalars(tag))
    return tags


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_lr_is_logged_once_per_logged_optimizer_step_under_accumulation(tmp_path, accumulate):
    """Lightning's LearningRateMonitor logs in on_train_batch_start, once per micro-batch: with
    accumulate_grad_batches=2 every logged step had two identical lr rows (CSV steps 1, 1, 3, 3, 5, 5)."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_dtrain.callbacks import OncePerStepLRMonitor

    monitor = OncePerStepLRMonitor(logging_interval="step", log_momentum=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=accumulate,
                        log_every_n_steps=2, callbacks=[monitor], enable_checkpointing=False,
                        logger=[CSVLogger(str(tmp_path), name="csv", version=0),
                                TensorBoardLogger(str(tmp_path), name="tb", version=0)],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LinearLR())
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("lr-SGD")]
    # the steps k with (k + 1) % 2 == 0, each once, with the LR used at that step, and the momentum beside it
    expected = [(1, 0.2), (3, 0.4), (5, 0.6)]
    assert [(int(r["step"]), round(float(r["lr-SGD"]), 6)) for r in rows] == expected
    assert [float(r["lr-SGD-momentum"]) for r in rows] == [0.5] * 3
    tags = _tensorboard_scalars(tmp_path / "tb")
    assert tags["lr-SGD"] == expected
    assert monitor.state_dict() == LearningRateMonitor().state_dict()  # no checkpoint state of its own


@pytest.mark.parametrize(("kept", "expected"), [(3, [0.6, 0.7, 0.8]), (0, [])])
def test_lr_history_stays_bounded_however_long_the_run(tmp_path, monkeypatch, kept, expected):
    """Lightning's LearningRateMonitor appends every logged LR to ``lrs`` and never drops one: logging every step,
    2,000 steps kept 2,000 values per tag (one more per logged step for the whole run). ``lrs_kept = 0`` keeps none
    (``del values[:-0]`` deleted nothing: it kept all 8)."""
    from lit_dtrain.callbacks import OncePerStepLRMonitor

    monkeypatch.setattr(OncePerStepLRMonitor, "lrs_kept", kept, raising=False)
    monitor = OncePerStepLRMonitor(logging_interval="step")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, log_every_n_steps=1, callbacks=[monitor],
                        enable_checkpointing=False, logger=CSVLogger(str(tmp_path), name="csv", version=0),
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LinearLR())
    assert {tag: [round(v, 6) for v in values] for tag, values in monitor.lrs.items()} == {"lr-SGD": expected}
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", newline="") as f:  # the logger still has every row
        assert len([r for r in csv.DictReader(f) if r.get("lr-SGD")]) == 8


def test_the_default_config_uses_the_once_per_step_lr_monitor():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lit_dtrain.callbacks import OncePerStepLRMonitor

    config = OmegaConf.load(Path(__file__).parents[2] / "conf" / "callbacks" / "default.yaml").lr_monitor
    monitor = instantiate(config)
    assert isinstance(monitor, OncePerStepLRMonitor) and monitor.logging_interval == "step"


class HalveOddSteps(L.Callback):
    """Scales the LR of odd steps' updates by 0.5, as LossSpikeMonitor's lr_cooldown does (put back after the
    update), and records the LR each update used."""

    scales_lr = True

    def __init__(self) -> None:
        self.used: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lit_dtrain.callbacks._lr_scaling import scale_lrs_for_step

        scale_lrs_for_step(optimizer, 0.5 if trainer.global_step % 2 else 1.0)
        self.used[trainer.global_step] = round(optimizer.param_groups[0]["lr"], 6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_lr_an_update_used_is_logged_beside_the_schedules_when_a_callback_scales_it(tmp_path, accumulate):
    """A cool-down (or a Fourier stage) scales the LR of an update inside optimizer.step and puts it back: lr-SGD
    showed only the schedule's LR (0.2 at step 1) where the update used 0.1, and nothing in TensorBoard showed the
    LR actually applied. lr-SGD-effective now logs it at the same steps; a run without such a callback has no
    such tag."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_dtrain.callbacks import OncePerStepLRMonitor

    for scaler in (HalveOddSteps(), None):
        root = tmp_path / str(scaler is None)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=accumulate,
                            log_every_n_steps=2, callbacks=[OncePerStepLRMonitor(), *([scaler] if scaler else [])],
                            enable_checkpointing=False, logger=TensorBoardLogger(str(root), name="tb", version=0),
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LinearLR())
        tags = _tensorboard_scalars(root / "tb")
        assert tags["lr-SGD"] == [(1, 0.2), (3, 0.4), (5, 0.6)]  # the schedule's, as before
        if scaler is None:
            assert "lr-SGD-effective" not in tags
            continue
        assert tags["lr-SGD-effective"] == [(1, 0.1), (3, 0.2), (5, 0.3)]
        assert [(step, scaler.used[step]) for step, _ in tags["lr-SGD-effective"]] == tags["lr-SGD-effective"]


class DropGradsAt(L.Callback):
    """Drops every gradient of the given steps before their update, as LossSpikeMonitor's ``skip`` does: the
    ``optimizer.step`` runs and moves nothing."""

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.steps:
            from lit_dtrain.callbacks._spike_step import drop_grads

            drop_grads(trainer, optimizer)


def test_a_step_whose_gradients_were_dropped_has_no_effective_lr(tmp_path):
    """A step that LossSpikeMonitor's ``skip`` dropped ran ``optimizer.step`` without gradients, so no LR was applied;
    it still got an ``lr-SGD-effective`` point (0.1 at step 1). Now a dropped step has no point, as it has no
    ``train/grad_norm``; and the update of the next step, not a logged one (log_every_n_steps=2), is not written under
    the dropped step's number (step 2's 0.3 at step 1, as after a step the GradScaler skipped)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_dtrain.callbacks import OncePerStepLRMonitor

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, log_every_n_steps=2,
                        callbacks=[OncePerStepLRMonitor(), HalveOddSteps(), DropGradsAt(1)],
                        enable_checkpointing=False, logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LinearLR())
    tags = _tensorboard_scalars(tmp_path / "tb")
    assert tags["lr-SGD"] == [(1, 0.2), (3, 0.4), (5, 0.6)]  # the schedule's LR of each logged step
    assert tags["lr-SGD-effective"] == [(3, 0.2), (5, 0.3)]


def test_an_update_the_gradscaler_skipped_inside_a_fused_optimizer_applied_no_lr():
    """A fused optimizer under the GradScaler is called with ``found_inf`` and skips the update itself; its post-hook
    runs all the same. Such a step applied no LR; one with ``found_inf`` 0 applied its LR."""
    from lit_dtrain.callbacks._lr_scaling import pop_applied_lrs, track_applied_lrs

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], lr=0.5, fused=True)
    track_applied_lrs(optimizer)
    for found, expected in ((1.0, None), (0.0, [0.5])):
        param.grad = torch.ones(2)
        # as torch.amp.GradScaler.step sets them for the call
        optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(found)
        optimizer.step()
        del optimizer.grad_scale, optimizer.found_inf
        assert pop_applied_lrs(optimizer) == expected
