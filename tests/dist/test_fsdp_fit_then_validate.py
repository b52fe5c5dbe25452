"""2-process gloo test of ``make_fsdp``'s strategy (``EvenEpochsFSDPStrategy``) in a real ``Trainer``: ``fit``, then
``validate`` on the same Trainer, as ``train()`` ends every run. Lightning wraps only a module whose blocks are no
FSDP units yet, so the validation found the LightningModule unwrapped and its own parameters (the embeddings, the
head) the fit's 1-D flat shards: ``RuntimeError: 'weight' must be 2-D`` (Lightning #19015), after training and saving.

Lightning runs FSDP on GPUs only (it passes torch's FSDP ``device_id=None`` on a CPU, and the strategy refuses a CPU
accelerator), so the ranks run a subclass let onto the CPU, with torch's ``device_id`` the CPU (torch 2.13 runs that
under gloo); the rest is the strategy's own."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from tests.conftest import free_port, leave_rank

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]  # one spawn: ~25 s, 2 cores shared

VOCAB, T, D = 64, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class TinyLM(L.LightningModule):
    """An embedding and a head at the root (the root FSDP unit's flat parameter), two blocks as FSDP units."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList([Block(), Block()])

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids[:, :-1])
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _cpu_fsdp():
    """``make_fsdp``'s strategy let onto the CPU: the accelerator check off, torch's FSDP given ``device_id`` cpu."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lit_dtrain.strategies import EvenEpochsFSDPStrategy, make_fsdp

    class CpuFSDP(EvenEpochsFSDPStrategy):
        accelerator = property(lambda self: self._accelerator, lambda self, value: setattr(self, "_accelerator", value))

        def _setup_model(self, model):
            if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                return super()._setup_model(model)
            return FullyShardedDataParallel(model, device_id=torch.device("cpu"), **self.kwargs)

    strategy = make_fsdp(wrap_modules=[Block], collective_timeout_s=120)
    strategy.__class__ = CpuFSDP
    return strategy


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.utils.data import DataLoader

    ids = torch.randint(0, VOCAB, (16, T + 1), generator=torch.Generator().manual_seed(0))
    train, val = DataLoader(list(ids[:8]), batch_size=2), DataLoader(list(ids[8:]), batch_size=2)
    module = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_cpu_fsdp(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, train)
    validated = trainer.validate(module, val, verbose=False)[0]["val/loss"]
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model), torch.no_grad():
        whole = torch.stack([module.loss(ids[8 + 2 * i:10 + 2 * i]) for i in range(4)]).mean().item()
        embedding_shape = tuple(module.wte.weight.shape)
    torch.save({"validated": validated, "whole": whole, "embedding_shape": embedding_shape},
               os.path.join(root, f"rank{rank}.pt"))
    leave_rank()


def test_validate_after_fit_runs_on_the_fits_sharded_model(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["embedding_shape"] == (VOCAB, D)
        # the validation's loss is the trained model's (its 4 batches: 2 on each rank, averaged over the ranks)
        assert got["validated"] == pytest.approx(got["whole"], rel=1e-5)
