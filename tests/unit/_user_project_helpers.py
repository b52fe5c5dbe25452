"""Helpers shared by the tests of lit_dtrain's callbacks in a Lightning project of a user's own (test_callbacks_in_
foreign_projects.py, test_user_project_*.py and others): the user's module, data and ``fit``, a byte-level LM on
lit_dtrain's ``LMDataModule``, dict-batch datasets, an LR recorder and exact state comparison."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, batch_size: int = 8) -> DataLoader:
    """The user's own DataLoader: ``(x, y)`` tuples, no ``index``, no dict; some samples 8x larger (grad spikes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    x[5::11] *= 8.0
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


class UserModule(L.LightningModule):
    """``nn.Sequential`` MLP; ``training_step`` returns the bare loss. ``groups``: two param groups with LRs 1e-2 and
    1e-3; ``scheduler``: a ``StepLR`` of its own; ``manual``: manual optimization (every optimizer steps each batch);
    ``two``: two optimizers (AdamW for the first layer, SGD for the last); ``step_every``: under manual optimization,
    accumulate the grads of that many batches per update."""

    def __init__(
        self,
        groups: bool = False,
        scheduler: bool = False,
        manual: bool = False,
        two: bool = False,
        step_every: int = 1,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.groups, self.scheduler, self.two, self.step_every = groups, scheduler, two, step_every
        self.automatic_optimization = not manual
        self.example_input_array = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        self.steps_run = 0  # training_step calls

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.manual_backward(loss / self.step_every)
        if (batch_idx + 1) % self.step_every == 0:
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        return None

    def configure_optimizers(self):
        if self.two:
            return torch.optim.AdamW(self.net[0].parameters(), 1e-2), torch.optim.SGD(self.net[2].parameters(), 1e-2)
        if self.groups:
            opt = torch.optim.AdamW(
                [{"params": self.net[0].parameters(), "lr": 1e-2}, {"params": self.net[2].parameters(), "lr": 1e-3}]
            )
        else:
            opt = torch.optim.AdamW(self.parameters(), 1e-2)
        if self.scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}
        return opt


def fit(
    tmp_path: Path,
    callbacks,
    module: L.LightningModule | None = None,
    max_steps: int = 8,
    ckpt_path=None,
    save_every: int | None = None,
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs,
) -> L.Trainer:
    if save_every:
        callbacks = [
            *callbacks,
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=save_every
            ),
        ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=bool(save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(tmp_path),
        **trainer_kwargs,
    )
    module = module if module is not None else UserModule()
    if datamodule is not None:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    else:
        trainer.fit(module, regression_data(), ckpt_path=ckpt_path)
    return trainer


def _equal(a, b) -> bool:
    """Exact equality of nested states holding tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


MIXED = {"precision": "bf16-mixed", "accumulate_grad_batches": 2}


class UserLM(L.LightningModule):
    """A user's own byte-level LM on lit_dtrain's ``LMDataModule`` batches (``input_ids``, ``labels``, ``index``);
    ``training_step`` returns the bare loss unless ``per_token``, which returns the keys the FourierSampler reads."""

    def __init__(self, per_token: bool = False, declare: tuple[str, ...] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)
        self.per_token = per_token
        if declare is not None:
            self.step_output_keys = declare
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        logits = self.head(self.embed(batch["input_ids"]))  # (B, T, V)
        token_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        token_loss = token_loss.view_as(batch["labels"])  # (B, T)
        if not self.per_token:
            return token_loss.mean()
        return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2)


def lm_data(tmp_path: Path):
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.datamodule import LMDataModule
    from lit_dtrain.data.samplers.fourier import FourierSampler

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    source = CorpusSource(name="text", kind="files", paths=[str(corpus)])
    return LMDataModule(
        sources=[source],
        block_size=16,
        batch_size=4,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        sampler=FourierSampler(step_unit=1),
    )


class UpdateLRs(L.Callback):
    """Records the LR of param group ``group`` at every update of every optimizer (step pre-hooks, so the LR the update
    used)."""

    def __init__(self, group: int = 0) -> None:
        self.group = group

    def on_train_start(self, trainer, pl_module) -> None:
        self.used = {i: [] for i in range(len(trainer.optimizers))}
        for i, opt in enumerate(trainer.optimizers):
            opt.register_step_pre_hook(lambda o, a, kw, i=i: self.used[i].append(o.param_groups[self.group]["lr"]))


class DictBatchModule(UserModule):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch["x"], batch["y"]), batch_idx)


class IndexedDataset(torch.utils.data.Dataset):
    """The user's ``(x, y)`` samples as dicts with their position under ``index``."""

    def __init__(self) -> None:
        self.data = regression_data().dataset

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x, y = self.data[i]
        return {"x": x, "y": y, "index": i}
