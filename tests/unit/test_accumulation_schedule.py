"""Lightning's ``GradientAccumulationScheduler`` beside ``LMDataModule`` and lit_dtrain's callbacks: accumulation that
changes between epochs. Each test runs a real fit of a user's byte-level LM (``UserLM``) and checks the result."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_dtrain.callbacks import PreemptionCheckpoint
from lit_dtrain.data.samplers.base import RandomSampler
from tests.unit._user_project_helpers import UserLM, lm_data


class Batches(L.Callback):
    def __init__(self) -> None:
        self.indices: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.indices.append(batch["index"].tolist())


class SigtermAtBatch(L.Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(tmp_path: Path, ckpt_path=None, *callbacks: L.Callback) -> tuple[L.Trainer, UserLM, Batches]:
    batches = Batches()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=3, limit_train_batches=4, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[GradientAccumulationScheduler({1: 2}), batches, *callbacks,
                   ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, save_on_train_epoch_end=True)],
    )
    module, data = UserLM(), lm_data(tmp_path)
    data.sampler = RandomSampler()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, batches


def _same_weights(a: UserLM, b: UserLM) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_resume_inside_a_scheduled_accumulation_is_not_told_its_global_batch_changed(tmp_path: Path, caplog):
    """A checkpoint of epoch 1, which a GradientAccumulationScheduler({1: 2}) trained at 2 micro-batches of 4 a step,
    resumed with the same scheduler: the trainer still holds its constructor's accumulate_grad_batches=1 when the
    datamodule's state is loaded, and the resume was told 'the checkpoint trained on global batches of 8 windows, and
    this run's are 4 ... (data.batch_size=8 keeps its batch)', though it draws the same batches and ends bitwise on the
    straight run's weights (following that advice would have changed the run)."""
    straight, straight_module, straight_batches = _fit(tmp_path)
    assert straight.global_step == 4 + 2 + 2
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.corpus"):
        resumed, module, batches = _fit(tmp_path, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=6.ckpt"))
    assert [r.getMessage() for r in caplog.records if "global batches" in r.getMessage()] == []
    assert resumed.global_step == 8 and batches.indices == straight_batches.indices[-4:]
    assert _same_weights(module, straight_module)


def test_an_epoch_resumed_mid_way_keeps_its_scheduled_accumulation(tmp_path: Path) -> None:
    """A SIGTERM at epoch 1's second micro-batch (of 2 a step under {1: 2}) saves after step 5, at micro-batch 2 of 4.
    Lightning calls no on_train_epoch_start in an epoch resumed mid-way, where the scheduler sets the accumulation, so
    the resume ran epoch 1's last 2 micro-batches as 2 steps of 1 (9 steps where the straight run takes 8, other
    weights). Now it takes the straight run's steps and ends on its weights."""
    (tmp_path / "straight").mkdir()
    straight, straight_module, _ = _fit(tmp_path / "straight")
    with pytest.raises(SIGTERMException):
        _fit(tmp_path, None, SigtermAtBatch(5), PreemptionCheckpoint(dirpath=str(tmp_path / "pre")))
    resumed, module, _ = _fit(tmp_path, str(tmp_path / "pre" / "last.ckpt"))
    assert (straight.global_step, resumed.global_step) == (8, 8) and _same_weights(module, straight_module)
