"""2-process gloo tests of ``make_fsdp``'s strategy (``EvenEpochsFSDPStrategy``) in a real ``Trainer``, one spawn:

- ``fit``, then ``validate`` on the same Trainer, as ``train()`` ends every run. Lightning wraps only a module whose
  blocks are no FSDP units yet, so the validation found the LightningModule unwrapped and its own parameters (the
  embeddings, the head) the fit's 1-D flat shards: ``RuntimeError: 'weight' must be 2-D`` (Lightning #19015), after
  training and saving.
- a single-device checkpoint (a plain optimizer's state, as DDP's) resumed under FSDP, with param groups that are not
  in the model's order: Lightning gave parameters another's Adam moments (``strategies/fsdp_resume.py``).

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

    def configure_optimizers(self):  # groups as LitLLM's, by name (FSDP has flattened the shapes by now): the weights
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]  # first, then the biases: not the
        biases = [p for n, p in self.named_parameters() if not n.endswith("weight")]  # model's order
        return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2)


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


def _data():
    from torch.utils.data import DataLoader

    ids = torch.randint(0, VOCAB, (16, T + 1), generator=torch.Generator().manual_seed(0))
    return ids, DataLoader(list(ids[:4]), batch_size=2), DataLoader(list(ids[8:]), batch_size=2)  # 2 steps an epoch


def _fit_one_device(max_steps: int, ckpt_path: str | None = None) -> L.Trainer:
    module = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, _data()[1], ckpt_path=ckpt_path)
    return trainer


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    from torch.distributed.fsdp import FullyShardedDataParallel

    ids, train, val = _data()
    module = TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_cpu_fsdp(), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, train)
    validated = trainer.validate(module, val, verbose=False)[0]["val/loss"]
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model), torch.no_grad():
        whole = torch.stack([module.loss(ids[8 + 2 * i:10 + 2 * i]) for i in range(4)]).mean().item()
        embedding_shape = tuple(module.wte.weight.shape)
    resumed = TinyLM()  # the one-device checkpoint of step 2 (an epoch's end), on 2 ranks to step 4
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_cpu_fsdp(), max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(resumed, train, ckpt_path=os.path.join(root, "one_device.ckpt"))
    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
        weights = {k: v.clone() for k, v in resumed.state_dict().items()}
    torch.save({"validated": validated, "whole": whole, "embedding_shape": embedding_shape, "resumed": weights},
               os.path.join(root, f"rank{rank}.pt"))
    leave_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("fsdp")
    _fit_one_device(2).save_checkpoint(root / "one_device.ckpt")
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=2, join=True)
    return root, [torch.load(root / f"rank{rank}.pt") for rank in (0, 1)]


def test_a_one_device_checkpoint_resumes_under_fsdp_with_each_parameters_own_optimizer_state(ranks) -> None:
    """Every rank trains on every batch (no distributed sampler): the resume to step 4 is the one-device resume's.
    Under Lightning's own load the first step failed, 'RuntimeError: The size of tensor a (48) must match the size of
    tensor b (2048)': a parameter had been given another's Adam moments."""
    root, got_by_rank = ranks
    one_device = _fit_one_device(4, ckpt_path=str(root / "one_device.ckpt")).lightning_module.state_dict()
    for got in got_by_rank:
        for name, value in one_device.items():
            torch.testing.assert_close(got["resumed"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda detail, name=name: f"{name}: {detail}")


def test_validate_after_fit_runs_on_the_fits_sharded_model(ranks) -> None:
    for got in ranks[1]:
        assert got["embedding_shape"] == (VOCAB, D)
        # the validation's loss is the trained model's (its 4 batches: 2 on each rank, averaged over the ranks)
        assert got["validated"] == pytest.approx(got["whole"], rel=1e-5)
