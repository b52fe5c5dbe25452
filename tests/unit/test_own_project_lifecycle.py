"""lit_dtrain's callbacks across the lifecycles of a Lightning project of one's own: the same callback objects
given to a second Trainer (a sweep loop, a next stage), which must start as fresh ones do."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks import ModelCheckpoint


class Regression(L.LightningModule):
    """A linear regression on 32 fixed samples, validated on the same data."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.lr = torch.nn.Linear(4, 1), lr

    def _loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader() -> DataLoader:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit(root: Path, callbacks: list, module: L.LightningModule, **trainer_kwargs) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(root), callbacks=callbacks, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=loader(), val_dataloaders=loader())
    return trainer


def test_a_model_checkpoint_reused_by_a_second_trainer_writes_into_that_trainers_run_dir(tmp_path: Path) -> None:
    """A sweep loop over the learning rate with one ModelCheckpoint(monitor=..., save_last=True) built before it:
    Lightning kept the first Trainer's dirpath and top-k, so the second run (lr 0.1) wrote its files into the first
    run's checkpoints/, over its epoch=0-step=8.ckpt (the same name), and its own run dir got none. Now it starts as a
    fresh object: each run dir holds its own files, with its own run's weights and best score."""
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    runs = {}
    for lr in (1e-3, 1e-1):
        root = tmp_path / f"lr{lr}"
        trainer = fit(root, [checkpoint], Regression(lr), max_steps=8, val_check_interval=4)
        runs[lr] = (root / "checkpoints", [p.detach().clone() for p in trainer.lightning_module.parameters()])
        assert Path(checkpoint.best_model_path).parent == root / "checkpoints"
        assert float(checkpoint.best_model_score) == float(trainer.callback_metrics["val_loss"])
    for directory, weights in runs.values():
        assert sorted(p.name for p in directory.iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
        saved = torch.load(directory / "epoch=0-step=8.ckpt", weights_only=True)["state_dict"]
        assert all(torch.equal(saved[f"net.{n}"], w) for n, w in zip(("weight", "bias"), weights))


def test_a_model_checkpoint_refitted_by_the_same_trainer_keeps_its_files(tmp_path: Path) -> None:
    """The same Trainer fitted again (max_steps raised) goes on: the same dirpath, its top-k ranked with the first
    fit's files (save_top_k=1 keeps one step file of the two fits)."""
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    trainer = fit(tmp_path, [checkpoint], Regression(), max_steps=4, val_check_interval=4)
    first = checkpoint.best_model_path
    trainer.fit_loop.epoch_loop.max_steps = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(trainer.lightning_module, train_dataloaders=loader(), val_dataloaders=loader())
    files = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert Path(first).name == "epoch=0-step=4.ckpt" and files == ["epoch=1-step=8.ckpt", "last.ckpt"]
