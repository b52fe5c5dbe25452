"""A fit of one's own under ``max_steps`` resumed with ``ckpt_path=`` from ``ModelCheckpoint``'s epoch-end file (its
default save point, ``on_train_epoch_end``). Lightning's loop ends that epoch again on restart and counted it twice:
every later epoch ran one ahead, so a sampler with ``set_epoch`` (the ``DistributedSampler`` Lightning adds under DDP)
drew the next epoch's order (epochs 2, 3 where the straight run drew 1, 2; weights 0.04 off), and with ``max_epochs``
beside ``max_steps`` the fit ended an epoch early (8 of 12 steps). lit_dtrain's ``ModelCheckpoint`` takes the count
back at train start: the resume draws the straight run's epochs and ends on its weights, bitwise."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lit_dtrain.callbacks import ModelCheckpoint
from tests.unit._user_project_helpers import UserModule, _equal, regression_data


class _SamplerEpochs(L.Callback):
    """The sampler epoch each training epoch draws its first batch with."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if batch_idx == 0:
            self.epochs.append(trainer.train_dataloader.sampler.epoch)


def _fit(tmp_path: Path, run: str, length: dict, ckpt_path: str | None = None):
    dataset = regression_data(n=32).dataset  # 4 batches an epoch
    # a shuffling sampler with set_epoch, as Lightning's DistributedSampler under DDP (one process here)
    data = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=0))
    epochs = _SamplerEpochs()
    trainer = L.Trainer(**length, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path / run,
                        callbacks=[epochs, ModelCheckpoint(dirpath=tmp_path / run / "ckpt", save_top_k=-1)])
    module = UserModule()
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    return trainer, module, epochs.epochs


@pytest.mark.parametrize("length", [{"max_steps": 12}, {"max_steps": 100, "max_epochs": 3}])
def test_a_resume_from_an_epoch_end_checkpoint_draws_the_straight_runs_epochs(tmp_path: Path, length: dict) -> None:
    straight, straight_module, straight_epochs = _fit(tmp_path, "straight", length)
    assert (straight.global_step, straight_epochs) == (12, [0, 1, 2])
    resumed, module, epochs = _fit(tmp_path, "resumed", length, ckpt_path=str(tmp_path / "straight" / "ckpt" /
                                                                               "epoch=0-step=4.ckpt"))
    assert (resumed.global_step, resumed.current_epoch, epochs) == (12, 3, [1, 2])  # were (12, 3, [2, 3]), (8, 2, [2])
    assert _equal(module.state_dict(), straight_module.state_dict())
    # the resumed fit's own epoch-end file resumes as well
    again, module, epochs = _fit(tmp_path, "again", length, ckpt_path=str(tmp_path / "resumed" / "ckpt" /
                                                                          "epoch=1-step=8.ckpt"))
    assert (again.global_step, epochs) == (12, [2])
    assert _equal(module.state_dict(), straight_module.state_dict())
    assert torch.equal(module.net[0].weight, straight_module.net[0].weight)
