"""2-process gloo checks of the compressed DDP hook on a bf16 model (``trainer.precision=bf16-true``) with a tied
embedding/head and a gradient clip after the reduce, one spawn for every codec: the hook gets the bf16 bucket,
error-feedback residuals stay fp32 and are keyed once for the tied parameter, the clipped averaged gradient and the
parameters are bitwise equal across ranks, and ``comm/compression_ratio`` counts plain DDP's bytes in bf16. The same
ranks then fit a manual-optimization module with two optimizers under local SGD (``max_epochs``)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.strategies import CommSession, Communicator, CompressedDDPStrategy, build_compressor
from tests.conftest import free_port, leave_rank

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one spawn: ~37 s on the shared 2-core machine

WORLD, VOCAB, STEPS = 2, 32, 3
CODECS = ["none", "int8", "int4", "powersgd", "topk", "sign"]


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


class TwoOptimizers(L.LightningModule):
    """Manual optimization, each batch steps the first layer's optimizer, then the second's (``one``: one optimizer)."""

    def __init__(self, one: bool = False) -> None:
        super().__init__()
        self.automatic_optimization, self.one = False, one
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        for optimizer in [self.optimizers()] if self.one else self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(self.b(self.a(batch[0] + self.global_rank)).pow(2).mean())
            optimizer.step()

    def configure_optimizers(self):
        if self.one:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


def _fit_two_optimizers(one: bool = False, **limits) -> dict:
    strategy = CompressedDDPStrategy(local_update={"name": "local_sgd", "sync_period": 100}, log_comm_metrics=False)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
                        **(limits or {"max_epochs": 1}))
    module = TwoOptimizers(one)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=2))
    params = torch.cat([p.detach().view(-1) for p in module.parameters()])
    return {"syncs": strategy.local_update.num_syncs, "bytes": strategy.session.total_bytes, "params": params}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))  # a launched rank, for the Lightning fit at the end
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for name in CODECS:
        session = CommSession(build_compressor(name), None)
        net = TiedLM().to(torch.bfloat16)
        ddp = DistributedDataParallel(net, bucket_cap_mb=0.001)  # several buckets
        session.attach(ddp, Communicator())
        dtypes, reduce = set(), session.compressor.reduce

        def recording_reduce(flat, *args, _reduce=reduce, _dtypes=dtypes, **kwargs):
            _dtypes.add(flat.dtype)
            return _reduce(flat, *args, **kwargs)

        session.compressor.reduce = recording_reduce
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        grads_equal = []
        for step in range(STEPS):
            x = torch.randint(0, VOCAB, (8, 9), generator=torch.Generator().manual_seed(100 * step + rank))
            F.cross_entropy(ddp(x[:, :-1]).float().reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            grad = torch.cat([p.grad.float().view(-1) for p in net.parameters()])
            both = [torch.empty_like(grad) for _ in range(WORLD)]
            dist.all_gather(both, grad)
            grads_equal.append(torch.equal(both[0], both[1]))
            optimizer.step()
            optimizer.zero_grad()
            metrics = session.after_optimizer_step(CommSession.named_params(net))
        params = torch.cat([p.detach().float().view(-1) for p in net.parameters()])
        both = [torch.empty_like(params) for _ in range(WORLD)]
        dist.all_gather(both, params)
        residuals = getattr(session.compressor, "residuals", {})
        results[name] = {
            "bucket_dtypes": {str(d) for d in dtypes}, "grads_equal": grads_equal,
            "params_equal": torch.equal(both[0], both[1]),
            "residuals": {k: str(v.dtype) for k, v in residuals.items()},
            "ratio": metrics["comm/compression_ratio"], "total_bytes": session.total_bytes,
            "numel": params.numel(), "names": sorted(session.names.values()),
        }
    results["two_optimizers"] = _fit_two_optimizers()
    # max_steps=5 of 3 batches an epoch: the fifth step is one optimizer's, or the first of the third batch's two
    results["by_steps"] = {one: _fit_two_optimizers(one, max_steps=5, max_epochs=-1) for one in (True, False)}
    torch.save(results, f"{out}.rank{rank}")
    leave_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("bf16") / "results.pt")
    mp.spawn(_worker, args=(free_port(), out), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(WORLD)]


def test_bf16_tied_clipped_fit_under_every_codec(runs):
    for name in CODECS:
        r = runs[0][name]
        assert r["bucket_dtypes"] == {"torch.bfloat16"}, name
        assert r["grads_equal"] == [True] * STEPS and r["params_equal"], name
        assert r["names"] == ["emb.weight", "mid.bias", "mid.weight"], name  # the tied weight once
        assert set(r["residuals"].values()) <= {"torch.float32"}, name
        if name in ("int4", "powersgd", "topk", "sign"):  # error feedback: one residual per parameter, tied once
            assert sorted(r["residuals"]) == r["names"], name
        assert r["ratio"] == pytest.approx(STEPS * 2 * r["numel"] / r["total_bytes"]), name  # dense in bf16
        assert runs[1][name]["total_bytes"] == r["total_bytes"], name
    assert runs[0]["none"]["ratio"] == 1.0


def test_two_optimizers_sync_once_at_the_last_batch_of_a_fit_by_epochs(runs):
    """Under manual optimization the fit's last batch synced after each optimizer's step (2 syncs, 200 bytes here); the
    sync now waits for the batch's training_step to return: one sync of the 25 parameters, ranks still equal."""
    r0, r1 = runs[0]["two_optimizers"], runs[1]["two_optimizers"]
    assert (r0["syncs"], r0["bytes"]) == (1, 25 * 4)
    assert torch.equal(r0["params"], r1["params"])


def test_manual_optimization_by_max_steps_syncs_once_at_the_last_batch(runs):
    """With one optimizer and max_steps=5 the batch before the fifth step synced too (global_step + 1 was read after
    the batch's step was counted: 2 syncs, 200 bytes); with two, the fifth step, the sixth and the batch after them
    each synced (3 syncs, 300 bytes, the second optimizer's step on the averaged first layer). Now one sync each."""
    for one in (True, False):
        r0, r1 = runs[0]["by_steps"][one], runs[1]["by_steps"][one]
        assert (r0["syncs"], r0["bytes"]) == (1, 25 * 4), one
        assert torch.equal(r0["params"], r1["params"]), one
