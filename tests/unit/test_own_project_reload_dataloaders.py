"""WSDScheduler(total_steps=None) in a project of one's own whose train DataLoader is reloaded every epoch
(``reload_dataloaders_every_n_epochs=1``) with another length: the horizon is the plan at train start, which counts
every epoch at the first one's length, and a fit that ends off it is told so."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks import WSDScheduler
from tests.unit.test_own_project_lifecycle import Regression


class Epochs(L.LightningDataModule):
    """Epoch ``e`` trains on ``sizes[e]`` samples, in batches of 4."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = sizes

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(self.sizes[self.trainer.current_epoch], 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit_epochs(tmp_path: Path, sizes: list[int]) -> tuple[L.Trainer, WSDScheduler, list[str]]:
    wsd = WSDScheduler(warmup_steps=1, decay_fraction=0.5, decay_type="linear")
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[wsd],
                        max_epochs=len(sizes), reload_dataloaders_every_n_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regression(), datamodule=Epochs(sizes))
    return trainer, wsd, [str(w.message) for w in caught if str(w.message).startswith("WSDScheduler")]


def test_a_fit_whose_reloaded_epochs_are_shorter_is_told_that_it_ended_inside_the_decay(tmp_path: Path) -> None:
    """Epochs of 8 then 4 batches: the plan at train start was 16 steps (2 epochs of 8), the fit took 12, and its last
    step ran at half the peak LR. The check at train end read the plan again from the reloaded DataLoader (2 x 4 = 8
    steps), took the fit as complete and said nothing; now it warns with the train-start plan and names the reload."""
    trainer, wsd, said = fit_epochs(tmp_path, [32, 16])
    assert (trainer.global_step, wsd.total_steps, wsd.lr_factor(trainer.global_step - 1)) == (12, 16, 0.5)
    (line,) = said
    assert line.startswith("WSDScheduler: the fit stopped after 12 optimizer steps of the 16 it planned "
                           "(reload_dataloaders_every_n_epochs=1 reloaded the train DataLoader with fewer batches")
    assert "give WSDScheduler the fit's steps, total_steps=12)" in line and "its last step ran at 0.5x" in line


def test_a_fit_whose_reloaded_epochs_keep_their_length_says_nothing(tmp_path: Path) -> None:
    trainer, wsd, said = fit_epochs(tmp_path, [16, 16])
    assert (trainer.global_step, wsd.total_steps, said) == (8, 8, [])


def test_a_fit_whose_reloaded_epochs_are_longer_is_told_the_plan_it_started_with(tmp_path: Path) -> None:
    """Epochs of 4 then 8 batches: the plan at train start was 8 steps, the fit runs 12, the last 4 at LR 0. The
    warning at step 8 said 'at train start trainer.estimated_stepping_batches was 16' (the estimate at step 8, from
    the reloaded DataLoader); now it gives the train-start 8 and names the reload."""
    trainer, wsd, said = fit_epochs(tmp_path, [16, 32])
    assert (trainer.global_step, wsd.total_steps) == (12, 8)
    (line,) = said
    assert line.startswith("WSDScheduler: the fit goes on past total_steps=8 (step 8; at train start "
                           "trainer.estimated_stepping_batches was 8, which counts every epoch at the first one's "
                           "length, and reload_dataloaders_every_n_epochs=1 reloaded the train DataLoader with more "
                           "batches): its remaining steps run at min_lr_factor=0.0"), line
