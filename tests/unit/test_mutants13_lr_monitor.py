"""``OncePerStepLRMonitor`` (callbacks/lr_monitor.py) where single-point mutants passed test_callback_logging.py,
test_user_project_lr.py, test_mutants9_lr_monitor.py, test_mutants8_lr_scaling.py and test_documented_behaviour.py
(thirteenth hand mutation audit), and the cadence of the effective LRs that audit found off."""

from __future__ import annotations

import csv
import gc
import weakref

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_dtrain.callbacks import OncePerStepLRMonitor
from tests.unit._user_project_helpers import UserModule, regression_data
from tests.unit.test_callback_logging import HalveOddSteps, LinearLR
from tests.unit.test_mutants9_lr_monitor import _fit


def test_a_second_fit_lets_the_first_fits_optimizer_go(tmp_path):
    """The monitor remembers each optimizer it logged, with its groups' tags, for the effective LRs; a new fit starts
    that afresh, so one monitor over two fits (a Tuner's fit, then the run's) holds only the second's optimizer: the
    first's, and its state (AdamW's moments are twice the model), is freed once its trainer is."""
    monitor = OncePerStepLRMonitor(logging_interval="step")
    first = _fit(tmp_path, "first", 2, [monitor])
    optimizer = weakref.ref(first.optimizers[0])
    del first
    _fit(tmp_path, "second", 2, [monitor])
    gc.collect()
    assert optimizer() is None


def _csv_rows(root, name, tag) -> list[tuple[int, float]]:
    with open(root / name / "version_0" / "metrics.csv", newline="") as f:
        return [(int(r["step"]), round(float(r[tag]), 6)) for r in csv.DictReader(f) if r.get(tag)]


def test_a_logged_step_before_the_first_scaled_one_has_its_effective_lr(tmp_path):
    """The monitor starts recording the LRs of every update at the fit's start, not at the first update a callback
    scales: step 0 (not halved, LR 0.1) has its ``lr-SGD-effective`` row beside steps 1-3 (0.2 halved, 0.3, 0.4
    halved); left to the scaling callback, recording began at step 1 and step 0 had none."""
    _fit(tmp_path, "run", 4, [OncePerStepLRMonitor(logging_interval="step"), HalveOddSteps()])
    assert _csv_rows(tmp_path, "run", "lr-SGD-effective") == [(0, 0.1), (1, 0.1), (2, 0.3), (3, 0.2)]
    assert _csv_rows(tmp_path, "run", "lr-SGD") == [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)]


def test_the_lr_history_keeps_the_latest_thousand_values_per_tag():
    """The module's promise, at its default: after 1,500 logged LRs each tag's ``lrs`` list (one per param group)
    holds the latest 1,000 (a run that logs 1,000 steps is too slow for a unit test: the lists are filled by hand,
    then one step logs; trimming the first tag only let the second group's grow)."""
    monitor = OncePerStepLRMonitor()
    tags = ["lr-SGD/pg1", "lr-SGD/pg2"]
    monitor.lrs = {tag: [float(i) for i in range(1500)] for tag in tags}
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in tags]
    optimizer = torch.optim.SGD([{"params": [p]} for p in params], lr=1500.0)
    assert monitor._get_optimizer_stats(optimizer, tags)["lr-SGD/pg2"] == 1500.0
    assert monitor.lrs == {tag: [float(i) for i in range(501, 1501)] for tag in tags}


def test_an_epoch_interval_monitor_logs_no_effective_lr_at_steps(tmp_path):
    """``logging_interval='epoch'`` logs the LRs at epoch starts only; the LRs the updates used are step values and
    stay out too (they were logged at every step, 0 to 3, beside no schedule row of those steps)."""
    _fit(tmp_path, "run", 4, [OncePerStepLRMonitor(logging_interval="epoch"), HalveOddSteps()])
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        columns = next(csv.reader(f))
    assert "lr-SGD-effective" not in columns


class ScalesNothing(L.Callback):
    """A callback that says it scales the LR (so the monitor logs the effective LRs) and leaves it as it is."""

    scales_lr = True


class SecondStepsEveryOtherBatch(UserModule):
    """Two optimizers under manual optimization: AdamW steps every batch, SGD on even batches only."""

    def __init__(self) -> None:
        super().__init__(manual=True, two=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
        first, second = self.optimizers()
        for opt in (first, second) if batch_idx % 2 == 0 else (first,):
            opt.step()
        first.zero_grad()
        second.zero_grad()


def test_a_step_where_one_of_two_optimizers_updated_logs_that_ones_effective_lr(tmp_path):
    """Each optimizer's effective LR is logged at the steps it updated: AdamW's at steps 0-3, SGD's at 0 and 2 (a step
    where SGD took no update had no row for AdamW either when both had to have updated)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, log_every_n_steps=1, enable_checkpointing=False,
                        callbacks=[OncePerStepLRMonitor(logging_interval="step"), ScalesNothing()],
                        logger=CSVLogger(str(tmp_path), name="run", version=0), enable_progress_bar=False,
                        enable_model_summary=False, limit_train_batches=4, max_epochs=1)
    trainer.fit(SecondStepsEveryOtherBatch(), regression_data())
    assert _csv_rows(tmp_path, "run", "lr-AdamW-effective") == [(s, 0.01) for s in range(4)]
    assert _csv_rows(tmp_path, "run", "lr-SGD-effective") == [(0, 0.01), (2, 0.01)]



def test_an_epoch_start_with_nothing_to_log_writes_no_row(tmp_path):
    """``logging_interval=None``, two epochs of 2 steps, a scheduler stepped per step: the epoch starts have no LR of
    their own to log (the first batch logs it), and write no row (an empty one, the step alone, was written at 0
    and 2, two of the 6 rows of metrics.csv)."""
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="run", version=0), callbacks=[OncePerStepLRMonitor()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LinearLR())
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        rows = [(int(r["step"]), round(float(r["lr-SGD"]), 6) if r["lr-SGD"] else None) for r in csv.DictReader(f)]
    assert rows == [(s, round(0.1 * (s + 1), 6)) for s in range(4)]


class TwoEpochSchedulers(UserModule):
    """Two optimizers under manual optimization (each steps every batch, so ``global_step`` moves by 2 a batch),
    each with an LR scheduler stepped per epoch (by the user, here never: the LRs stay 0.01)."""

    def __init__(self) -> None:
        super().__init__(manual=True, two=True)

    def configure_optimizers(self):
        first, second = super().configure_optimizers()
        return [first, second], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0),
                                  "interval": "epoch"} for opt in (first, second)]


def test_epoch_start_rows_are_at_the_logging_step_and_reach_callback_metrics(tmp_path):
    """``logging_interval=None``, two epochs of 2 batches: the epoch-interval schedulers' LRs are logged at each epoch
    start, at the step the loggers count (batches that stepped: 0 and 2, not the 4 optimizer steps of
    ``global_step``), and put in ``callback_metrics`` as Lightning's own rows are (for a checkpoint or early stopping
    that monitors them)."""
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="run", version=0), callbacks=[OncePerStepLRMonitor()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TwoEpochSchedulers(), regression_data())
    assert _csv_rows(tmp_path, "run", "lr-AdamW") == [(0, 0.01), (2, 0.01)]
    assert _csv_rows(tmp_path, "run", "lr-SGD") == [(0, 0.01), (2, 0.01)]
    assert float(trainer.callback_metrics["lr-AdamW"]) == pytest.approx(0.01)


def test_a_manual_loop_that_accumulates_by_hand_logs_every_batch(tmp_path):
    """Under manual optimization the loggers' step moves once per batch, whether an optimizer stepped or not: a
    user's loop that updates every 2nd batch has an LR row at each of its 4 batches (read off ``global_step``, which
    moves per ``optimizer.step``, the batches between updates were taken for micro-batches: rows 0 and 2 only)."""
    trainer = L.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, enable_checkpointing=False,
                        logger=CSVLogger(str(tmp_path), name="run", version=0),
                        callbacks=[OncePerStepLRMonitor(logging_interval="step")], enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(UserModule(manual=True, step_every=2), regression_data())
    assert _csv_rows(tmp_path, "run", "lr-AdamW") == [(s, 0.01) for s in range(4)]


def test_each_param_groups_effective_lr_is_under_its_own_tag(tmp_path):
    """Two param groups at 0.01 and 0.001: each ``-effective`` tag has its own group's LR (not another's)."""
    trainer = L.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, enable_checkpointing=False,
                        logger=CSVLogger(str(tmp_path), name="run", version=0), enable_progress_bar=False,
                        callbacks=[OncePerStepLRMonitor(logging_interval="step"), ScalesNothing()],
                        enable_model_summary=False)
    trainer.fit(UserModule(groups=True), regression_data())
    assert _csv_rows(tmp_path, "run", "lr-AdamW/pg1-effective") == [(0, 0.01), (1, 0.01)]
    assert _csv_rows(tmp_path, "run", "lr-AdamW/pg2-effective") == [(0, 0.001), (1, 0.001)]


class EpochLinearLR(LinearLR):
    """``LinearLR`` whose scheduler steps once per epoch."""

    def configure_optimizers(self):
        [optimizer], [config] = super().configure_optimizers()
        return [optimizer], [{**config, "interval": "epoch"}]


class AddGroupAtSecondEpoch(L.Callback):
    """Adds a param group (LR 0.5) at the second epoch's start, as ``BackboneFinetuning`` does when it unfreezes."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            trainer.optimizers[0].add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5})
            scheduler = trainer.lr_scheduler_configs[0].scheduler  # (LambdaLR needs a factor of each group)
            scheduler.base_lrs.append(0.5)
            scheduler.lr_lambdas.append(lambda epoch: 1.0)


def test_a_param_group_added_at_an_epoch_start_gets_its_own_tag(tmp_path):
    """``logging_interval=None``, an epoch-interval scheduler: the tags are renamed per group (``lr-SGD/pg1``,
    ``lr-SGD/pg2``) when a group is added, as Lightning's monitor does, so its epoch-start row logs both (without
    the renaming, ``lrs`` had no list for the new tag: ``KeyError: 'lr-SGD/pg2'``)."""
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="run", version=0), enable_progress_bar=False,
                        callbacks=[AddGroupAtSecondEpoch(), OncePerStepLRMonitor()], enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(EpochLinearLR())
    assert _csv_rows(tmp_path, "run", "lr-SGD/pg2") == [(2, 0.5)]


@pytest.mark.parametrize("interval", [None, "step"])
def test_an_epoch_interval_schedulers_effective_lr_is_logged_at_its_lrs_steps(tmp_path, interval):
    """Two epochs of 3 steps, a scheduler stepped per epoch (LR 0.1, then 0.2), odd steps' updates halved. Under
    ``logging_interval=None`` its LR is logged at epoch starts only, steps 0 and 3, as Lightning's monitor does, and
    the LR the updates used is a step value, kept out as under ``'epoch'`` (it was logged at every step, 0 to 5,
    beside no ``lr-SGD`` row of steps 1, 2, 4, 5); under ``'step'`` both are logged at every step."""
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=3, log_every_n_steps=1,
                        logger=CSVLogger(str(tmp_path), name="run", version=0), enable_progress_bar=False,
                        callbacks=[OncePerStepLRMonitor(logging_interval=interval), HalveOddSteps()],
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(EpochLinearLR())
    if interval is None:
        assert _csv_rows(tmp_path, "run", "lr-SGD") == [(0, 0.1), (3, 0.2)]
        assert _csv_rows(tmp_path, "run", "lr-SGD-effective") == []
    else:
        assert _csv_rows(tmp_path, "run", "lr-SGD") == [(s, 0.1) for s in range(3)] + [(s, 0.2) for s in range(3, 6)]
        assert _csv_rows(tmp_path, "run", "lr-SGD-effective") == [(0, 0.1), (1, 0.05), (2, 0.1), (3, 0.1),
                                                                    (4, 0.2), (5, 0.1)]
