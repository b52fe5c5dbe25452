"""2-process gloo test of ``OptimizerDiagnostics`` under FSDP, where each rank holds a shard of every parameter,
gradient and Adam state: its figures were rank 0's shard's (grad RMS 0.0945 where the model's is 0.1446), logged as
the model's. They are summed over the ranks' shards now. Lightning refuses FSDP on a CPU, so the model is torch's
FullyShardedDataParallel (``device_id`` cpu, which torch 2.13 runs under gloo) and the trainer a stand-in whose
strategy is named as Lightning's FSDP and reduces as it does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel

from lit_dtrain.callbacks import OptimizerDiagnostics
from tests.conftest import free_port, leave_rank

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one spawn: ~23 s on the shared 2-core machine


class StandInFSDPStrategy:
    """What ``OptimizerDiagnostics`` asks of Lightning's ``FSDPStrategy``: its device and a summing reduce."""

    root_device = torch.device("cpu")

    @staticmethod
    def reduce(tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        assert reduce_op == "sum"
        dist.all_reduce(tensor)
        return tensor


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def _diagnosed_step(model: torch.nn.Module, world_size: int, strategy) -> dict[str, float]:
    """Two AdamW steps on the same batch on every rank; the second is a diagnostic step. Its figures."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, eps=1e-3)
    trainer = SimpleNamespace(world_size=world_size, strategy=strategy, optimizers=[optimizer], global_step=0,
                              precision_plugin=None)
    diag = OptimizerDiagnostics(every_n_steps=2)
    diag.on_train_start(trainer, None)
    torch.manual_seed(1)
    batch = torch.randn(4, 8)
    for step in range(2):
        trainer.global_step = step
        model(batch).pow(2).mean().backward()
        diag.on_after_backward(trainer, None)
        optimizer.step()
        optimizer.zero_grad()
    return dict(diag._pending)


def _worker(rank: int, port: int, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sharded = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"), use_orig_params=True)
    shard_numel = sum(p.numel() for p in sharded.parameters())
    figures = _diagnosed_step(sharded, 2, StandInFSDPStrategy())
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"figures": figures, "shard_numel": shard_numel}, f)
    leave_rank()


def test_fsdp_figures_are_the_whole_models(tmp_path):
    out = str(tmp_path / "figures")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    whole = _diagnosed_step(_model(), 1, SimpleNamespace())
    assert sorted(r["shard_numel"] for r in ranks) == [40, 41]  # each rank holds about half of the 81 parameters
    assert set(whole) == {"optim/0/grad_rms", "optim/0/update_to_param_rms", "optim/0/eps_dominated_frac"}
    for rank in ranks:  # every rank's figures are the unsharded model's (same batch on both ranks: same gradients)
        assert rank["figures"].keys() == whole.keys()
        for name, value in whole.items():
            assert rank["figures"][name] == pytest.approx(value, rel=1e-5), name
