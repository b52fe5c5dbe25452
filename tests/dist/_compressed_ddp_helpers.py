"""Helpers shared by the tests/dist/test_compressed_ddp_*.py files: the tiny problem and module, Lightning fits
and their dumps, launching rank processes and running fits in one process group."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.strategies import CompressedDDPStrategy
from tests.conftest import free_port

WORLD = 2



def regression_batch(step: int, rank: int, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific batch of a fixed teacher: y = tanh(x A) B + noise."""
    teacher = torch.Generator().manual_seed(12345)
    a, b = torch.randn(16, 24, generator=teacher), torch.randn(24, 8, generator=teacher) / 4
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, 16, generator=g)
    return x, torch.tanh(x @ a) @ b + 0.01 * torch.randn(batch, 8, generator=g)


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 8))


# --- Lightning -------------------------------------------------------------------------------------
class TinyModule(L.LightningModule):
    """A tiny regression LightningModule whose batch is a pure function of (global_step, rank)."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__()
        self.net = make_net()
        self.dump_dir, self.tag = dump_dir, tag

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(self.global_step, self.global_rank)
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(10_000, 1)), batch_size=1)

    def _dump(self, when: str) -> None:
        s = self.trainer.strategy
        lu = s.local_update
        torch.save({
            "compressor": s.compressor.state_dict() if s.compressor is not None else None,
            "local_update": lu.state_dict() if lu is not None else None,
            "local_update_rank": lu.rank_local_state_dict() if lu is not None else None,
            "counters": s.session.counters_state_dict(),
            "params": {k: v.detach().clone() for k, v in self.net.state_dict().items()},
            "device": str(s.root_device), "backend": dist.get_backend(),
        }, Path(self.dump_dir) / f"{self.tag}_{when}_rank{self.global_rank}.pt")

    def on_train_start(self) -> None:
        self._dump("start")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == 4:
            self._dump("step4")

    def on_train_end(self) -> None:
        self._dump("end")


def fit(tmp: Path, tag: str, max_steps: int, ckpt_path: str | None = None, world: int = WORLD, spawn: bool = True,
        **strategy_kwargs) -> L.Trainer:
    """Fit TinyModule on ``world`` ranks: started by Lightning's spawn launcher (``spawn``), or in ranks launched
    already (:func:`as_launched_rank`; Lightning's spawn launcher would start ``world`` more processes in each)."""
    launch = {"start_method": "spawn"} if spawn else {}
    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1,
        strategy=CompressedDDPStrategy(**launch, **strategy_kwargs),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / tag, filename="{step}", every_n_train_steps=4,
                                                       save_top_k=-1)],
    )
    trainer.fit(TinyModule(str(tmp), tag), ckpt_path=ckpt_path)
    return trainer


def dumps(tmp: Path, tag: str, when: str, world: int = WORLD) -> list[dict]:
    return [torch.load(tmp / f"{tag}_{when}_rank{r}.pt", weights_only=True) for r in range(world)]


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def as_launched_rank(rank: int, port: int, world: int = WORLD) -> None:
    """Make this process rank ``rank`` of ``world`` as a launcher would (Lightning then joins that group), one
    thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)


def run_rank_processes(target, *args, timeout: float = 240, world: int = WORLD) -> None:
    """Run ``target(rank, port, *args)`` in one spawned process per rank, without ``mp.spawn``'s join (which kills
    the other ranks as soon as one fails); a process still alive after ``timeout`` seconds is killed."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in range(world)]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()


def _one_group_worker(rank: int, port: int, root: str, jobs: list[tuple], world: int = WORLD) -> None:
    """Each ``(fit, key)`` of ``jobs`` as ``fit(root / f"{fit name}_{key}", key)``, in sequence in one process group
    (the group outlives a fit), each recorded as done or as the error it raised."""
    as_launched_rank(rank, port, world)
    outcomes: dict[str, str | None] = {}
    for job, key in jobs:
        tmp = Path(root) / f"{job.__name__}_{key}"
        tmp.mkdir(exist_ok=True)
        try:
            job(tmp, key)
            outcomes[tmp.name] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test that reads this fit
            outcomes[tmp.name] = f"{type(e).__name__}: {e}"
        torch.save(outcomes, Path(root) / f"outcomes_rank{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fit_in_one_group(root: Path, jobs: list[tuple]) -> Path:
    """Every 2-rank fit of ``jobs`` in one pair of launched processes: a Lightning spawn per fit started two Pythons
    (imports, gloo set-up) for a fit of a few steps, most of each test's time."""
    run_rank_processes(_one_group_worker, str(root), jobs, timeout=900)
    return root


def fitted(root: Path, job, key: str, world: int = WORLD) -> Path:
    """The directory of ``job``'s fit for ``key`` in :func:`fit_in_one_group`'s ``root``, the fit done on each rank."""
    name = f"{job.__name__}_{key}"
    for rank in range(world):
        path = root / f"outcomes_rank{rank}.pt"
        outcomes = torch.load(path, weights_only=False) if path.exists() else {}
        assert name in outcomes, f"rank {rank} never finished {name} (an earlier fit hung or killed it)"
        assert outcomes[name] is None, f"rank {rank}: {name} failed: {outcomes[name]}"
    return root / name
