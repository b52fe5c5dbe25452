"""Tiny Lightning pieces for callback and strategy tests: a linear regression on 64 seeded samples."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


class RegressionData(torch.utils.data.Dataset):
    """64 samples ``{"x": [4], "y": sum(x), "index"}``, each drawn from its own seed; ``spread`` scales sample i
    by ``1 + i % 7`` so that gradient norms vary from batch to batch."""

    def __init__(self, spread: bool = False) -> None:
        self.spread = spread

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        if self.spread:
            x = x * (1 + i % 7)
        return {"x": x, "y": x.sum(0, keepdim=True), "index": torch.tensor(i)}


class TinyRegression(L.LightningModule):
    """``nn.Linear(4, 1)`` (seeded) trained with plain SGD at ``lr`` on :class:`RegressionData`, batch 4."""

    def __init__(self, lr: float = 0.01, spread: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.lr, self.spread = lr, spread

    def loss(self, batch) -> torch.Tensor:
        return ((self.net(batch["x"]) - batch["y"]) ** 2).mean()

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RegressionData(self.spread), batch_size=4)


class TinyMLP(L.LightningModule):
    """A seeded ``4 -> 8 -> 1`` tanh MLP and its squared error on a batch ``{"x": [n, 4], "y": [n, 1]}``; a project
    of one's own subclasses it with its steps, data and optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss(self, batch) -> torch.Tensor:
        return (self.net(batch["x"]) - batch["y"]).square().mean()
