"""2-process gloo tests of the compressed DDP hook and of CompressedDDPStrategy.

One raw-DDP spawn (module fixture) runs every variant and records what the tests below check:
the hook ran (counters), reduced gradients vs the exact mean (per-codec bounds), replicas
bit-identical, bytes accounted == bytes handed to torch.distributed (recorded by wrapping it) ==
the codec's formula, and convergence on a tiny regression problem. The Lightning tests run
``Trainer(devices=2, accelerator="cpu", strategy=CompressedDDPStrategy(...))`` for hook
registration on CPU, logged metrics, and exact resume. Most of their fits run in sequence in one
pair of launched rank processes (module fixtures ``fits`` and ``resume_fits``, each fit in its own
directory): a Lightning spawn per fit cost two fresh Pythons for a fit of a few steps.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.strategies import (
    CHECKPOINT_KEY,
    CommSession,
    Communicator,
    CompressedDDPStrategy,
    build_compressor,
    build_local_update,
)
from lit_dtrain.strategies import comm as comm_module
from tests.conftest import free_port, leave_rank

pytestmark = pytest.mark.dist

WORLD = 2
VARIANTS = {  # name -> (compressor spec, local-update spec)
    "none": ("none", None),
    "fp16": ("fp16", None),
    "bf16": ("bf16", None),
    "int8": ({"name": "int8", "block_size": 64}, None),
    "int4": ({"name": "int4", "block_size": 64, "error_feedback": True}, None),
    "powersgd": ({"name": "powersgd", "matrix_approximation_rank": 2, "warm_start": False}, None),
    "topk": ({"name": "topk", "ratio": 0.05}, None),
    "sign": ("sign", None),
    "local_sgd": (None, {"name": "local_sgd", "sync_period": 4}),
    # outer momentum 0.9 (the default, tuned for H ~ 500) overshoots at H = 4 on this toy problem: the
    # effective outer step is lr / (1 - momentum) = 7 H-step displacements (final loss 0.80 vs 0.24)
    "diloco": (None, {"name": "diloco", "sync_period": 4, "outer_lr": 0.5, "outer_momentum": 0.5}),
}
STEPS = 60



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


def _raw_worker(rank: int, port: int, out_path: str, variants: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    handed: list[int] = []  # bytes of every tensor our code hands to a collective
    # torch < 2.13 has no all_gather_single
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real_all_reduce, real_all_gather = dist.all_reduce, getattr(dist, gather_name)

    def recording_all_reduce(tensor, *args, **kwargs):
        handed.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    def recording_all_gather(out, tensor, *args, **kwargs):
        handed.append(tensor.numel() * tensor.element_size())
        return real_all_gather(out, tensor, *args, **kwargs)

    seen_segments: list[list] = []
    real_bucket_segments = comm_module.bucket_segments

    def recording_bucket_segments(bucket, names):
        seen_segments.append(real_bucket_segments(bucket, names))
        return seen_segments[-1]

    dist.all_reduce = recording_all_reduce
    setattr(dist, gather_name, recording_all_gather)
    comm_module.bucket_segments = recording_bucket_segments
    results: dict = {}
    try:
        for name, (compressor, local_update) in variants.items():
            session = CommSession(build_compressor(compressor), build_local_update(local_update))
            net = make_net()
            ddp = DistributedDataParallel(net, bucket_cap_mb=0.004)  # ~1000 floats: several buckets
            session.attach(ddp, Communicator())
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
            exact = make_net()
            res = {"losses": [], "handed": [], "accounted": [], "segments": [], "segments_later": []}
            for step in range(STEPS):
                handed.clear()
                seen_segments.clear()
                x, y = regression_batch(step, rank)
                session.before_optimizer_step(CommSession.named_params(net))
                F.mse_loss(ddp(x), y).backward()
                if step == 0:  # one reduction compared with the exact mean (same weights, same data)
                    F.mse_loss(exact(x), y).backward()
                    local = torch.cat([p.grad.view(-1) for p in exact.parameters()])
                    everyone = torch.empty(WORLD * local.numel())
                    real_all_gather(everyone, local)
                    res["local_grads"] = everyone.view(WORLD, -1)
                    res["reduced"] = torch.cat([p.grad.view(-1) for p in net.parameters()])
                    res["segments"] = [[(s.name, s.offset, s.numel, s.shape) for s in segs] for segs in seen_segments]
                if step == 2:  # DDP rebuilds its buckets after the first iteration
                    res["segments_later"] = [[(s.name, s.offset, s.numel, s.shape) for s in segs]
                                             for segs in seen_segments]
                optimizer.step()
                optimizer.zero_grad()
                metrics = session.after_optimizer_step(CommSession.named_params(net))
                res["handed"].append(sum(handed))
                res["accounted"].append(int(metrics["comm/bytes_per_step"]))
                with torch.no_grad():  # a fixed evaluation batch, same on both ranks
                    xe, ye = regression_batch(10_000, 0, batch=256)
                    res["losses"].append(F.mse_loss(net(xe), ye).item())
            params = torch.cat([p.detach().view(-1) for p in net.parameters()])
            both = torch.empty(WORLD * params.numel())
            real_all_gather(both, params)
            res["params_equal_across_ranks"] = bool(torch.equal(both.view(WORLD, -1)[0], both.view(WORLD, -1)[1]))
            res["hook_calls"] = session.hook_calls
            res["num_calls"] = session.compressor.num_calls if session.compressor is not None else None
            res["num_syncs"] = session.local_update.num_syncs if session.local_update is not None else None
            res["compression_ratio"] = session.metrics()["comm/compression_ratio"]
            res["param_count"] = params.numel()
            results[name] = res
    finally:
        dist.all_reduce = real_all_reduce
        setattr(dist, gather_name, real_all_gather)
        comm_module.bucket_segments = real_bucket_segments
    torch.save(results, f"{out_path}.rank{rank}")
    leave_rank()


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("raw") / "results.pt")
    mp.spawn(_raw_worker, args=(free_port(), out, VARIANTS), nprocs=WORLD, join=True)
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hook_ran_every_step_and_replicas_stay_identical(raw, name):
    res0, res1 = raw[0][name], raw[1][name]
    assert res0["hook_calls"] >= STEPS and res0["hook_calls"] == res1["hook_calls"]
    if res0["num_calls"] is not None:  # local updates register the hook too, but it sends nothing
        assert len(res0["segments_later"]) >= 2  # the tiny bucket cap produced several buckets (after step 0)
        assert res0["hook_calls"] == len(res0["segments"]) + (STEPS - 1) * len(res0["segments_later"])
        assert res0["num_calls"] == res0["hook_calls"]  # the compressor handled every bucket
    if name == "local_sgd":
        assert res0["num_syncs"] == STEPS // 4
    assert res0["params_equal_across_ranks"], "replicas diverged"
    if res0["num_syncs"] is None:
        assert res0["losses"] == res1["losses"]
    else:  # replicas differ between syncs and agree right after each one
        assert res0["losses"][3::4] == res1["losses"][3::4] and res0["losses"] != res1["losses"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bytes_accounted_equal_bytes_handed_to_collectives(raw, name):
    for res in raw:
        assert res[name]["accounted"] == res[name]["handed"]
        assert sum(res[name]["handed"]) > 0


def expected_bytes(name: str, segments: list) -> int:
    """The codec's byte formula for one step, from the bucket layouts the hook saw."""
    total = 0
    for segs in segments:
        n = sum(s[2] for s in segs)
        if name == "none":
            total += 4 * n
        elif name in ("fp16", "bf16"):
            total += 2 * n
        elif name in ("int8", "int4"):  # a block of 64 values starts at every parameter
            total += (n if name == "int8" else math.ceil(n / 2)) + 4 * sum(math.ceil(s[2] / 64) for s in segs)
        elif name == "topk":
            total += 8 * math.ceil(0.05 * n)
        elif name == "sign":
            total += math.ceil(n / 8) + 4 * len(segs)
        elif name == "powersgd":
            for _, _, numel, shape in segs:
                if len(shape) >= 2 and numel > 2 * 2 * (shape[0] + numel // shape[0]):
                    total += 4 * 2 * (shape[0] + numel // shape[0])
                else:
                    total += 4 * numel
    return total


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8", "int4", "topk", "sign", "powersgd"])
def test_bytes_match_the_codec_formula(raw, name):
    res = raw[0][name]
    assert res["accounted"][0] == expected_bytes(name, res["segments"])  # first step: DDP's initial buckets
    assert res["accounted"][2] == expected_bytes(name, res["segments_later"])  # after DDP rebuilt them
    dense = 4 * res["param_count"]
    assert res["compression_ratio"] == pytest.approx(dense / (sum(res["accounted"]) / STEPS), rel=1e-9)


def test_local_updates_send_nothing_between_syncs(raw):
    res = raw[0]["local_sgd"]
    n = res["param_count"]
    assert res["accounted"] == [4 * n if (s + 1) % 4 == 0 else 0 for s in range(STEPS)]
    assert raw[0]["local_sgd"]["compression_ratio"] == pytest.approx(4.0)
    assert raw[0]["diloco"]["accounted"] == res["accounted"]


def _step0(raw, name):
    res = raw[0][name]
    local = res["local_grads"]  # (world, numel): each rank's own gradient at step 0
    return res["reduced"], local.mean(0), local


def test_uncompressed_is_the_exact_mean(raw):
    reduced, mean, _ = _step0(raw, "none")
    assert torch.allclose(reduced, mean, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("name", "unit_roundoff"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_precision_is_near_exact(raw, name, unit_roundoff):
    """Two roundings (x/W to half, then the half-precision sum): |err| <= 2u max_r|g_r| + 2^-24."""
    reduced, mean, local = _step0(raw, name)
    err = (reduced - mean).abs()
    assert torch.all(err <= 2 * unit_roundoff * local.abs().amax(0) + 2.0**-24)
    assert err.max() > 0


@pytest.mark.parametrize(("name", "levels"), [("int8", 127), ("int4", 7)])
def test_int_quantization_error_bound(raw, name, levels):
    """Stated bound: each rank errs by <= s/2 per value with s = max|block| / L, so the mean errs by
    <= max_r max|g_r| / (2 L). Checked per 64-value block, blocks starting at every parameter."""
    reduced, mean, local = _step0(raw, name)
    err = (reduced - mean).abs()
    for segs in raw[0][name]["segments"]:
        for _, start, numel, _ in segs:
            stop = start + numel
            for b in range(start, stop, 64):
                block = slice(b, min(b + 64, stop))
                bound = local[:, block].abs().max() / (2 * levels)
                assert err[block].max() <= bound * (1 + 1e-5) + 1e-9
    assert err.max() > 0  # it did quantize


def test_topk_error_is_a_contraction(raw):
    """Mean of per-rank top-k: ||R - mean|| <= mean_r ||g_r - topk(g_r)|| <= sqrt(1 - ratio) mean_r ||g_r||."""
    reduced, mean, local = _step0(raw, "topk")
    assert (reduced - mean).norm() <= math.sqrt(1 - 0.05) * local.norm(dim=1).mean()
    assert (reduced != 0).sum() <= WORLD * sum(math.ceil(0.05 * sum(s[2] for s in segs))
                                               for segs in raw[0]["topk"]["segments"])


def test_sign_error_is_a_contraction(raw):
    """Scaled sign per parameter p: ||p - scale sign(p)||^2 = ||p||^2 - ||p||_1^2 / n <= ||p||^2."""
    reduced, mean, local = _step0(raw, "sign")
    bound = 0.0
    for r in range(WORLD):
        sq = 0.0
        for segs in raw[0]["sign"]["segments"]:
            for _, offset, numel, _ in segs:
                p = local[r, offset : offset + numel]
                sq += (p.pow(2).sum() - p.abs().sum() ** 2 / numel).item()
        bound += math.sqrt(max(sq, 0.0)) / WORLD
    assert (reduced - mean).norm() <= bound * (1 + 1e-4)


def test_powersgd_is_an_orthogonal_projection_of_the_mean(raw):
    """Step 0 (no residual, no warm start): each compressed matrix comes back as P P^T M_mean with P
    orthonormal, so ||out||^2 + ||M_mean - out||^2 = ||M_mean||^2; uncompressed vectors are exact."""
    reduced, mean, _ = _step0(raw, "powersgd")
    compressed = 0
    for segs in raw[0]["powersgd"]["segments"]:
        for _, offset, numel, shape in segs:
            out, m = reduced[offset : offset + numel], mean[offset : offset + numel]
            if len(shape) >= 2 and numel > 4 * (shape[0] + numel // shape[0]):
                compressed += 1
                assert (out.pow(2).sum() + (m - out).pow(2).sum()).item() == pytest.approx(m.pow(2).sum().item(),
                                                                                          rel=1e-4)
                assert (m - out).norm() > 1e-3 * m.norm()  # rank 2 of a 48 x 32 gradient: not exact
            else:
                assert torch.allclose(out, m, atol=1e-7)
    assert compressed >= 3


def test_convergence_parity_on_a_tiny_problem(raw):
    """60 AdamW steps on a regression task: every variant ends within 25% of uncompressed DDP's loss."""
    base = raw[0]["none"]["losses"]
    assert base[-1] < 0.3 * base[0]
    for name in VARIANTS:
        losses = raw[0][name]["losses"]
        assert losses[-1] < 1.25 * base[-1] + 1e-3, (name, losses[-1], base[-1])


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


def test_lightning_registers_hook_on_cpu_gloo_and_logs_comm_metrics(tmp_path):
    trainer = fit(tmp_path, "sign", max_steps=3, compressor="sign")
    for d in dumps(tmp_path, "sign", "end"):
        assert d["device"] == "cpu" and d["backend"] == "gloo"
        assert d["compressor"]["num_calls"] >= 3  # Lightning's own DDPStrategy would have skipped the hook on CPU
        assert d["compressor"]["residuals"]  # error feedback kept residuals
    m = trainer.callback_metrics
    assert m["comm/compression_ratio"] > 20  # ~32x minus per-parameter scales
    assert m["comm/bytes_per_step"] > 0 and m["comm/time_ms"] >= 0


def test_strategy_registry_and_config_errors():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "ddp_compressed" in StrategyRegistry
    strategy = StrategyRegistry.get("ddp_compressed")
    assert isinstance(strategy, CompressedDDPStrategy) and strategy.compressor.name == "powersgd"
    with pytest.raises(ValueError, match="local-update rule skips"):
        CompressedDDPStrategy(compressor="topk", local_update="local_sgd")
    with pytest.raises(ValueError, match="remove ddp_comm_hook"):
        CompressedDDPStrategy(ddp_comm_hook=lambda s, b: None)


EPOCH_UPDATES = {"diloco": {"name": "diloco", "sync_period": 4}, "local_sgd": {"name": "local_sgd", "sync_period": 4}}


def _fit_by_epochs(tmp: Path, key: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=2, limit_train_batches=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key]),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True)],
    )
    trainer.fit(TinyModule(str(tmp), "epochs"))


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_a_fit_that_ends_by_epochs_checkpoints_the_synchronized_model(fits, key):
    """max_epochs=2 of 3 batches: 6 steps, syncs at 4 and at the last step, before that step's checkpoint. Only
    max_steps was checked: a fit by epochs synced in on_train_end, after ModelCheckpoint wrote last.ckpt (rank 0's
    unsynchronized parameters; DiLoCo without its last outer step: 0.22 off in a 2-rank project of 14 steps)."""
    tmp = fitted(fits, _fit_by_epochs, key)
    end = dumps(tmp, "epochs", "end")  # the module's on_train_end runs before the strategy's fallback sync
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    assert end[0]["local_update"]["num_syncs"] == 2 and end[0]["local_update"]["steps_since_sync"] == 0
    last = torch.load(tmp / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    assert_same({k.removeprefix("net."): v for k, v in last["state_dict"].items()}, end[0]["params"], "last.ckpt")


class _StopAfterStep(L.Callback):
    """Ask the fit to stop after optimizer step ``step`` (as ``EarlyStopping`` or ``max_time`` do, after the step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _fit_stopped_after_a_step(tmp: Path, key: str) -> None:
    import warnings

    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=12, logger=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key]),
        callbacks=[_StopAfterStep(6), L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModule(str(tmp), "stopped"))
    said = [str(w.message) for w in caught if "the fit stopped at step" in str(w.message)]
    torch.save(said, tmp / f"warnings_rank{trainer.global_rank}.pt")


def test_a_checkpoint_written_at_a_stop_between_syncs_is_rank_zeros_and_said_so(fits):
    """A stop decided after step 6 (period 4), no validation: ModelCheckpoint writes last.ckpt at the epoch's end,
    before the strategy's final sync in on_train_end. Its state_dict is rank 0's own parameters (every rank's are in
    lit_dtrain_comm, so a resume continues exactly: test_resume_restores_comm_state_exactly's local_sgd case), not the
    model the module holds after the fit; that went unsaid. Rank 0 now warns, naming the step and the steps since
    the sync."""
    tmp = fitted(fits, _fit_stopped_after_a_step, "local_sgd")
    last = torch.load(tmp / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6 and last[CHECKPOINT_KEY]["local_update"]["steps_since_sync"] == 2
    own = [rank["params"] for rank in last[CHECKPOINT_KEY]["per_rank"]]
    assert_same(last["state_dict"], own[0], "last.ckpt's state_dict")
    assert any(not torch.equal(own[0][k], own[1][k]) for k in own[0])  # between syncs: the ranks differ
    (message,) = torch.load(tmp / "warnings_rank0.pt")
    assert message.startswith("CompressedDDPStrategy: the fit stopped at step 6, 2 steps after the last local_sgd "
                              "sync, and a checkpoint was written at that step"), message
    assert "holds rank 0's own parameters" in message and "trainer.save_checkpoint" in message
    assert torch.load(tmp / "warnings_rank1.pt") == []


class UnevenModule(TinyModule):
    """TinyModule whose DataLoader (one's own: ``use_distributed_sampler=False``) holds 3 batches on rank 0, 4 on 1."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(3 + self.global_rank, 1)), batch_size=1)

    def _dump(self, when: str) -> None:  # a marker only: strategy=ddp has no comm state
        (Path(self.dump_dir) / f"{self.tag}_{when}_rank{self.global_rank}").touch()


def _fit_uneven(tmp: Path, key: str) -> None:
    from lit_dtrain.strategies import make_ddp  # strategy=ddp's

    strategy = (make_ddp(collective_timeout_s=20) if key == "ddp"
                else CompressedDDPStrategy(local_update=EPOCH_UPDATES[key], collective_timeout_s=20))
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, enable_checkpointing=False, strategy=strategy,
    )
    trainer.fit(UnevenModule(str(tmp), "uneven"))


@pytest.mark.parametrize("key", ["local_sgd", "ddp"])
def test_ranks_whose_epochs_differ_in_length_fail_at_once_naming_them(fits, key):
    """3 batches on rank 0, 4 on rank 1, max_epochs=1, local SGD period 4: rank 0's sync at its last step (3) met
    rank 1's next per-batch SIGTERM broadcast (Lightning's) and both hung until collective_timeout_s. Under
    ``strategy=ddp`` (Lightning's DDPStrategy) rank 0 finished its 3 steps and rank 1 failed in its 4th step's
    all-reduce (gloo's 'Connection closed by peer'). Both ranks now raise a ConfigError at the epoch's first batch,
    before any step."""
    name = f"{_fit_uneven.__name__}_{key}"
    for rank in range(WORLD):
        outcome = torch.load(fits / f"outcomes_rank{rank}.pt", weights_only=False)[name]
        assert outcome.startswith("ConfigError: the ranks' training epochs differ in length (rank 0: 3 batches, its "
                                  "epoch ends after step 3; rank 1: 4 batches, its epoch ends after step 4)"), outcome
    assert not list((fits / name).glob("uneven_end_*"))  # no rank finished its fit


class ValidatingModule(TinyModule):
    """TinyModule with a validation on a fixed per-rank batch; dumps the parameters at each validation."""

    def validation_step(self, batch, batch_idx):
        x, y = regression_batch(10_000, self.global_rank)
        self.log("val/loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1)

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._dump(f"val{self.trainer.global_step}")
            if self.global_rank == 0:
                loss = self.trainer.callback_metrics["val/loss"]
                torch.save(loss, Path(self.dump_dir) / f"loss{self.trainer.global_step}.pt")


VALIDATION_RUNS = {  # key -> (local update, accumulate_grad_batches)
    "local_sgd": ({"name": "local_sgd", "sync_period": 4}, 1),
    "diloco": ({"name": "diloco", "sync_period": 4, "outer_lr": 0.5, "outer_momentum": 0.5}, 2),
}


def _fit_validating(tmp: Path, key: str) -> None:
    local_update, accumulate = VALIDATION_RUNS[key]
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=9, val_check_interval=5, limit_val_batches=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate, strategy=CompressedDDPStrategy(local_update=local_update),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", save_top_k=-1)],
    )
    trainer.fit(ValidatingModule(str(tmp), "val"))


@pytest.mark.parametrize("key, syncs", [
    ("local_sgd", (3, 1)),  # syncs after steps 4, 5 (early: val), 9 (its period)
    # accumulate_grad_batches=2: validations after batches 5, 10, 15 (steps 2, 5, 7); syncs at them and at step 9
    # (the last), all early
    ("diloco", (4, 4)),
])
def test_a_validation_between_syncs_sees_the_synchronized_model(fits, key, syncs):
    """val_check_interval=5 batches, sync_period=4, 9 steps. The validation came 1 step after the sync of step 4: each
    rank validated its own parameters (val/loss a mean over different models) and the checkpoint written after it
    held rank 0's. Now the step before it synchronizes early (with accumulate_grad_batches=2 the validation follows
    batch 5, a batch without a step: the strategy's on_validation_start synchronizes)."""
    tmp = fitted(fits, _fit_validating, key)
    val_step = 5 // VALIDATION_RUNS[key][1]  # the optimizer steps taken when the validation runs
    at_val = dumps(tmp, "val", f"val{val_step}")
    assert_same(at_val[0]["params"], at_val[1]["params"], "ranks at the validation")
    net = make_net()
    net.load_state_dict(at_val[0]["params"])
    with torch.no_grad():
        expected = sum(F.mse_loss(net(x), y) for x, y in (regression_batch(10_000, r) for r in range(WORLD))) / WORLD
    torch.testing.assert_close(torch.load(tmp / f"loss{val_step}.pt"), expected)
    saved = torch.load(tmp / "ckpt" / f"step={val_step}.ckpt", weights_only=True)["state_dict"]
    assert_same({k.removeprefix("net."): v for k, v in saved.items()}, at_val[0]["params"], "checkpoint after it")
    end = dumps(tmp, "val", "end")
    assert (end[0]["local_update"]["num_syncs"], end[0]["local_update"]["num_early_syncs"]) == syncs


RESUME_RUNS = {
    "powersgd": {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2}},
    # on 3 ranks gloo's all-reduce sums in an order that depends on a value's place in the bucket; the first step
    # after a start runs on DDP's initial bucket, so it must be reduced as the saved buckets were (2 of 4 KB)
    "powersgd_3_ranks": {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2},
                         "bucket_cap_mb": 0.004},
    # several DDP buckets (4 KB: TinyModule's 10.6 KB of gradients make 2 after DDP's rebuild): the first step
    # after a start runs on DDP's initial single bucket, where top-k used to select across the bucket boundary
    "topk_buckets": {"compressor": {"name": "topk", "ratio": 0.05}, "bucket_cap_mb": 0.004},
    "int8": {"compressor": {"name": "int8", "error_feedback": True, "block_size": 64}},
    # reduce-scatter int8: each rank's share of the mean and its error ("server residual") must come back too;
    # stochastic rounding: the second rounding's noise too (drawn by the share's owner)
    "int8_rs": {"compressor": {"name": "int8_rs", "error_feedback": True, "block_size": 64,
                               "stochastic_rounding": True}},
    # stochastic rounding: its noise must not depend on the bucket layout, which differs after a start
    "int8_sr": {"compressor": {"name": "int8", "error_feedback": True, "block_size": 64,
                               "stochastic_rounding": True}},
    "diloco": {"local_update": {"name": "diloco", "sync_period": 2,
                                "compressor": {"name": "int4", "error_feedback": True}}},
    "local_sgd": {"local_update": {"name": "local_sgd", "sync_period": 3}},  # step 4: mid-period
}


def _fit_straight_and_resumed(tmp: Path, name: str, world: int = WORLD, spawn: bool = False) -> None:
    """8 steps straight, checkpointing every 4; then 8 steps resumed from the straight run's step-4 checkpoint (in
    launched ranks, or each fit through Lightning's spawn launcher)."""
    fit(tmp, "straight", max_steps=8, world=world, spawn=spawn, **RESUME_RUNS[name])
    fit(tmp, "resumed", max_steps=8, ckpt_path=str(tmp / "straight" / "step=4.ckpt"), world=world, spawn=spawn,
        **RESUME_RUNS[name])


def _fit_straight_and_resumed_3_ranks(tmp: Path, name: str) -> None:
    _fit_straight_and_resumed(tmp, name, world=3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["powersgd", "int8", "int8_sr", "int8_rs", "diloco", "local_sgd", "topk_buckets",
                                  "powersgd_3_ranks"])
def test_resume_restores_comm_state_exactly(request, tmp_path, name):
    world = 3 if name.endswith("_3_ranks") else WORLD
    if world == WORLD:  # the 2-rank runs are fitted together, in one process group
        tmp = fitted(request.getfixturevalue("resume_fits"), _fit_straight_and_resumed, name)
    else:  # 3 launched ranks, both fits in one group (Lightning's spawn launcher started 3 Pythons per fit)
        jobs = [(_fit_straight_and_resumed_3_ranks, name)]
        run_rank_processes(_one_group_worker, str(tmp_path), jobs, world, timeout=900, world=world)
        tmp = fitted(tmp_path, _fit_straight_and_resumed_3_ranks, name, world)
    saved = torch.load(tmp / "straight" / "step=4.ckpt", weights_only=True)[CHECKPOINT_KEY]
    at4 = dumps(tmp, "straight", "step4", world)
    start = dumps(tmp, "resumed", "start", world)
    for r in range(world):
        # the checkpoint holds every rank's state as it was at step 4, and each rank got its own back
        assert_same(saved["per_rank"][r]["compressor"], at4[r]["compressor"], f"rank{r} saved")
        assert_same(start[r]["compressor"], at4[r]["compressor"], f"rank{r} restored")
        assert_same(start[r]["counters"], at4[r]["counters"], f"rank{r} counters")
        assert_same(start[r]["local_update"], at4[r]["local_update"], f"rank{r} local update")
        assert_same(start[r]["local_update_rank"], at4[r]["local_update_rank"], f"rank{r} local residual")
    end_straight, end_resumed = dumps(tmp, "straight", "end", world), dumps(tmp, "resumed", "end", world)
    for r in range(world):
        # every rank resumes from its own parameters and optimizer state, not rank 0's: the resumed run
        # reproduces the straight one bit for bit (before, local updates restarted all ranks from rank 0's)
        assert_same(start[r]["params"], at4[r]["params"], f"rank{r} params at resume")
        assert_same(end_resumed[r]["params"], end_straight[r]["params"], f"rank{r} params after resume")
    if name == "local_sgd":  # the checkpoint fell between syncs, where the ranks' parameters differ
        assert not torch.equal(at4[0]["params"]["0.weight"], at4[1]["params"]["0.weight"])
    if name == "diloco":
        assert start[0]["local_update"]["num_syncs"] == 2 and start[0]["local_update"]["outer_params"]
        assert start[0]["local_update_rank"]["residuals"] != {}  # the int4 pseudo-gradient residual
        assert not torch.equal(start[0]["local_update_rank"]["residuals"]["net.0.weight"],
                               start[1]["local_update_rank"]["residuals"]["net.0.weight"])  # rank-local
    elif name in ("powersgd", "int8", "int8_sr", "int8_rs", "topk_buckets", "powersgd_3_ranks"):
        assert not torch.equal(start[0]["compressor"]["residuals"]["net.0.weight"],
                               start[1]["compressor"]["residuals"]["net.0.weight"])  # rank-local
        assert_same(end_resumed[1]["compressor"], end_straight[1]["compressor"], "compressor after resume")
        if name == "int8_rs":
            assert start[0]["compressor"]["server_residuals"] and start[1]["compressor"]["server_residuals"]
        if name == "powersgd_3_ranks":  # the resumed run's first bucket held the 2 saved ones
            assert len(saved["per_rank"][0]["counters"]["bucket_layout"]) == 2


def _fit_plain_resumes(root: Path, key: str) -> None:
    """Write a compressed checkpoint at step 4, resume it with plain DDP (``make_ddp``, as ``strategy=ddp`` does)
    and with the same compressed strategy; record every rank's warnings about the resume."""
    import warnings
    from functools import partial

    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.strategies import make_ddp

    rank = int(os.environ["RANK"])  # as_launched_rank's
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 257, (64, 17), generator=g)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]

    def fit(strategy, max_steps: int, tag: str, ckpt_path: str | None = None) -> list[str]:
        torch.manual_seed(0)
        lit = LitLLM(Llama(LlamaConfig(block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)),
                     optimizer=partial(adamw, lr=1e-3))
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=max_steps, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=Path(root) / tag, filename="{step}",
                                                                           every_n_train_steps=4, save_top_k=-1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(lit, train_dataloaders=DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
        return [str(w.message) for w in caught if CHECKPOINT_KEY in str(w.message)]

    results = {}
    for name, kwargs in (("powersgd", {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2}}),
                         ("local_sgd", {"local_update": {"name": "local_sgd", "sync_period": 3}})):  # 4: mid-period
        fit(CompressedDDPStrategy(log_comm_metrics=False, **kwargs), 5, name)  # not 4: the last step syncs
        ckpt = str(Path(root) / name / "step=4.ckpt")
        results[name] = {
            "plain": fit(make_ddp(collective_timeout_s=60), 6, f"{name}_plain", ckpt),
            "same": fit(CompressedDDPStrategy(log_comm_metrics=False, **kwargs), 6, f"{name}_same", ckpt),
        }
    torch.save(results, Path(root) / f"plain_resume_rank{rank}.pt")


@pytest.mark.slow
def test_plain_ddp_resume_of_a_compressed_checkpoint_warns_what_it_drops(resume_fits):
    """``strategy=ddp`` on a checkpoint of ``strategy=ddp_compressed/...`` is legitimate (a decay branch), but it
    drops the error-feedback residuals (PowerSGD) or every rank's own parameters and optimizer state (local SGD,
    here mid-period): rank 0 warns once, naming the preset and the state, and a same-preset resume does not."""
    tmp = fitted(resume_fits, _fit_plain_resumes, "powersgd_and_local_sgd")
    r0, r1 = (torch.load(tmp / f"plain_resume_rank{r}.pt", weights_only=False) for r in range(WORLD))
    for name in ("powersgd", "local_sgd"):
        assert r1[name]["plain"] == [], name  # rank-zero only
        assert r0[name]["same"] == r1[name]["same"] == [], name  # the compressed strategy restores it all
        (message,) = r0[name]["plain"]
        assert f"strategy=ddp_compressed/{name}" in message and "DDPStrategy" in message, message
        assert "2 ranks" in message, message
    powersgd = r0["powersgd"]["plain"][0]
    assert "error-feedback residuals" in powersgd and "PowerSGD Q matrices" in powersgd, powersgd
    local_sgd = r0["local_sgd"]["plain"][0]
    assert "1 step since the last sync" in local_sgd and "rank 0's parameters" in local_sgd, local_sgd


ELASTIC = ("int8", "powersgd", "local_sgd", "diloco")  # codecs of RESUME_RUNS resumed on another number of ranks


def _expected_elastic(saved: dict, name: str) -> dict:
    """What every rank of a resume on another world size takes of ``saved`` (the checkpoint's comm state): rank 0's
    codec state with the mean of the ranks' residuals; for local updates the mean of their parameters."""
    ranks = saved["per_rank"]

    def mean(get):
        held = [get(r) for r in ranks]
        return {n: sum((h[n] for h in held[1:]), held[0][n].clone()).div(len(held)) for n in held[0]}

    out = {"counters": ranks[0]["counters"]}
    for key in ("compressor", "local_update"):
        if ranks[0][key] is not None:
            out[key] = {**ranks[0][key], "residuals": mean(lambda r, key=key: r[key]["residuals"])}
    if name in ("local_sgd", "diloco"):
        out["params"] = mean(lambda r: r["params"])
    return out


def _fit_elastic_up(tmp: Path, name: str) -> None:
    """Resume on 2 ranks the straight fit's step-4 checkpoint cut to rank 0's entry, as one process writes it."""
    import warnings

    rank = int(os.environ["RANK"])
    ckpt = torch.load(tmp.parent / f"_fit_straight_and_resumed_{name}" / "straight" / "step=4.ckpt", weights_only=True)
    ckpt[CHECKPOINT_KEY] = {**ckpt[CHECKPOINT_KEY], "world_size": 1, "per_rank": ckpt[CHECKPOINT_KEY]["per_rank"][:1]}
    path = tmp / f"one_rank{rank}.ckpt"
    torch.save(ckpt, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp, "up", max_steps=6, ckpt_path=str(path), spawn=False, **RESUME_RUNS[name])
    said = [str(w.message) for w in caught if "written on" in str(w.message)]
    torch.save({"one_rank": ckpt[CHECKPOINT_KEY], "loss": float(trainer.callback_metrics["train/loss"]),
                "step": trainer.global_step, "warnings": said}, tmp / f"up_rank{rank}.pt")


def _assert_kept(start: dict, expected: dict, where: str) -> None:
    assert_same(start["counters"], expected["counters"], f"{where} counters")
    for key, dumped in (("compressor", "compressor"), ("local_update", "local_update_rank")):
        if key in expected:
            assert_same(start[dumped], expected[key], f"{where} {key}")
    if "params" in expected:
        assert_same({f"net.{k}": v for k, v in start["params"].items()}, expected["params"], f"{where} params")


@pytest.mark.slow
@pytest.mark.parametrize("name", ELASTIC)
@pytest.mark.usefixtures("no_group_left")
def test_a_resume_on_another_number_of_ranks_keeps_what_it_can_and_says_what_it_drops(resume_fits, tmp_path, name):
    """2 -> 1 (a 1-process fit here) and 1 -> 2 (the 2-rank group): before, 'the checkpoint holds compressor state
    of 2 ranks but this run has 1' refused both. The replicated state is kept exactly, every rank takes the mean of
    the saved residuals (and, under local updates, parameters), rank 0 warns once, and training goes on."""
    import warnings

    tmp = fitted(resume_fits, _fit_straight_and_resumed, name)
    saved = torch.load(tmp / "straight" / "step=4.ckpt", weights_only=True)[CHECKPOINT_KEY]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, "down", max_steps=6, ckpt_path=str(tmp / "straight" / "step=4.ckpt"), world=1,
                      spawn=False, **RESUME_RUNS[name])
    (message,) = [str(w.message) for w in caught if "written on" in str(w.message)]
    assert message.startswith("lit_dtrain_comm: the checkpoint was written on 2 ranks and this run has 1"), message
    (start,) = dumps(tmp_path, "down", "start", world=1)
    _assert_kept(start, _expected_elastic(saved, name), "2 -> 1")
    at4 = dumps(tmp, "straight", "step4")
    assert_same(start["local_update"], at4[0]["local_update"], "2 -> 1 local update")
    assert trainer.global_step == 6 and math.isfinite(trainer.callback_metrics["train/loss"])
    if name in ("int8", "powersgd"):
        assert "compressor error-feedback residuals of 2 ranks are replaced on every rank by their mean" in message
    if name == "local_sgd":  # mid-period: the ranks' parameters differ, each starts from their mean
        assert "mean of the 2 ranks' parameters, which differ 1 step after the last sync" in message, message
        assert "every rank takes rank 0's optimizer state (rank 1's is dropped)" in message, message
    if name == "diloco":  # step 4 is a sync (period 2): the parameters are equal and kept exactly
        assert "parameters" not in message.split("optimizer")[0] and "pseudo-gradient compressor" in message
        assert_same(start["params"], at4[0]["params"], "2 -> 1 synchronized params")

    up = fitted(resume_fits, _fit_elastic_up, name)
    records = [torch.load(up / f"up_rank{r}.pt", weights_only=False) for r in range(WORLD)]
    expected = _expected_elastic(records[0]["one_rank"], name)
    for r, (record, begin) in enumerate(zip(records, dumps(up, "up", "start"), strict=True)):
        _assert_kept(begin, expected, f"1 -> 2 rank{r}")
        assert_same(begin["local_update"], at4[0]["local_update"], f"1 -> 2 rank{r} local update")
        assert record["step"] == 6 and math.isfinite(record["loss"]), record
    assert len(records[0]["warnings"]) == 1 and records[1]["warnings"] == []  # rank 0, once
    assert "written on 1 rank and this run has 2" in records[0]["warnings"][0]
    if name in ("int8", "powersgd"):
        assert "compressor error-feedback residual of 1 rank goes to every rank" in records[0]["warnings"][0]


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


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> Path:
    """The fits of the tests not marked slow (each reads its own directory)."""
    jobs = [(_fit_by_epochs, key) for key in sorted(EPOCH_UPDATES)] + [(_fit_stopped_after_a_step, "local_sgd")]
    jobs += [(_fit_validating, key) for key in VALIDATION_RUNS]
    jobs += [(_fit_scale_record, "topk"), (_fit_manual, "topk"), (_fit_init_scale, "topk")]
    jobs += [(_fit_with_a_branch, key) for key in UNUSED_CODECS]
    jobs.append((_fit_with_a_branch_zeroed_in_place, "sign"))
    jobs += [(_fit_unfrozen_at_resume, key) for key in sorted(EPOCH_UPDATES)]
    jobs.append((_fit_frozen_between_syncs, "local_sgd"))
    jobs += [(_fit_two_optimizers, key) for key in sorted(TOGGLE_RUNS)]
    jobs += [(_fit_overflow, key) for key in OVERFLOW_CODECS]
    # last: without the epoch-length check they fail only at the timeout (or leave the group broken)
    jobs += [(_fit_uneven, "local_sgd"), (_fit_uneven, "ddp")]
    return fit_in_one_group(tmp_path_factory.mktemp("fits"), jobs)


@pytest.fixture(scope="module")
def resume_fits(tmp_path_factory) -> Path:
    """The straight and resumed fits of every 2-rank variant of test_resume_restores_comm_state_exactly, and the
    plain-DDP resumes of test_plain_ddp_resume_of_a_compressed_checkpoint_warns_what_it_drops."""
    jobs = [(_fit_straight_and_resumed, name) for name in RESUME_RUNS if not name.endswith("_3_ranks")]
    jobs.append((_fit_plain_resumes, "powersgd_and_local_sgd"))  # test_plain_ddp_resume_of_a_compressed_checkpoint_...
    jobs += [(_fit_elastic_up, name) for name in ELASTIC]  # after the straight fits whose checkpoints they cut
    return fit_in_one_group(tmp_path_factory.mktemp("resume"), jobs)


def _nan_one_rank_worker(rank: int, port: int, root: str, local_update: dict, monitor: bool) -> None:
    """Rank 1's loss is NaN after 4 steps under a local-update rule (no per-step gradient all-reduce, so only rank 1's
    gradients are NaN and only rank 1's LitLLM raises NonFiniteError). Records what each rank raised, and when."""
    import os
    import time
    from functools import partial

    as_launched_rank(rank, port)
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from tests.faults import PoisonLossAtStep

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 257, (64, 17), generator=g)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    torch.manual_seed(0)
    lit = LitLLM(Llama(LlamaConfig(block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)),
                 optimizer=partial(adamw, lr=1e-3))
    callbacks = [PoisonLossAtStep(4, rank=1)] + ([LossSpikeMonitor(actions=["log"], warmup_steps=2)] if monitor else [])
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=12, logger=False, enable_checkpointing=False,
                        strategy=CompressedDDPStrategy(local_update=local_update, collective_timeout_s=30,
                                                       log_comm_metrics=False),
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root)
    outcome = {"type": None, "message": None}
    try:
        trainer.fit(lit, train_dataloaders=DataLoader(data, batch_size=2))
    except BaseException as e:  # noqa: BLE001 - record what this rank raised
        outcome = {"type": type(e).__name__, "message": str(e)}
    outcome["time"] = time.time()
    torch.save(outcome, Path(root) / f"nan_one_rank{rank}.pt")
    os._exit(0)  # not mp.spawn's join: it would kill the surviving rank as soon as rank 1 failed


@pytest.mark.slow
@pytest.mark.parametrize(("name", "monitor"), [("local_sgd", False), ("diloco", True)])
def test_nan_on_one_rank_under_local_updates_names_the_cause_on_the_other(tmp_path, name, monitor):
    """Rank 1 stops with NonFiniteError at step 4; rank 0's next collective (the monitor's all-reduce, or the sync)
    then fails. Its error must say that rank 1 stopped and why, not only gloo's 'Connection closed by peer'."""
    spec = {"name": name, "sync_period": 3}
    run_rank_processes(_nan_one_rank_worker, str(tmp_path), spec, monitor)
    r0, r1 = (torch.load(tmp_path / f"nan_one_rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert r1["type"] == "NonFiniteError" and "step 4" in r1["message"], r1
    assert r0["type"] is not None, r0  # the survivor failed too ...
    assert r0["time"] - r1["time"] < 20, (r0, r1)  # ... at once, not after the 30 s collective timeout
    message = r0["message"]
    assert "rank 1 stopped" in message and "NonFiniteError" in message, message
    assert "non-finite gradients at step 4" in message, message


class _ScaleRecord(L.Callback):
    """Halves the GradScaler's scale after step 2 (as an overflow does) and records the scale the codec was told."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float | None]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        scaler = trainer.precision_plugin.scaler
        self.seen.append((float(scaler.get_scale()), trainer.strategy.compressor.grad_scale))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            trainer.precision_plugin.scaler.update(new_scale=512.0)
        if trainer.is_global_zero and trainer.global_step == trainer.max_steps:
            torch.save(self.seen, Path(pl_module.dump_dir) / "scales.pt")


def _fit_scale_record(tmp: Path, key: str) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[_ScaleRecord()],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy=CompressedDDPStrategy(compressor=key, log_comm_metrics=False),
    )
    trainer.fit(TinyModule(str(tmp), "scale"))


def test_strategy_tells_the_codec_the_gradscaler_scale(fits):
    """16-mixed (here a CPU GradScaler): before each step the strategy passes the scaler's scale to the codec, so its
    error-feedback residual follows the scaler's changes (test_error_feedback_follows_a_gradscaler_change_of_scale).
    Before, the codec was never told: a residual made under 1024 was added at twice its value under 512."""
    tmp = fitted(fits, _fit_scale_record, "topk")
    seen = torch.load(tmp / "scales.pt", weights_only=True)
    assert [s for s, _ in seen] == [1024.0] * 3 + [512.0] * 3  # no overflow here: only the forced halving
    assert all(told == s for s, told in seen), seen
    residual = torch.load(tmp / "scale_end_rank0.pt", weights_only=True)["compressor"]
    assert residual["grad_scale"] == 512.0 and residual["residuals"]


class _FailAt(TinyModule):
    """TinyModule that fails at ``step``: raises ``ValueError`` (``how="raise"``), or exits the process with no error
    recorded (``how="exit"``: as a rank killed by the OOM killer or a signal would)."""

    def __init__(self, dump_dir: str, tag: str, step: int, how: str) -> None:
        super().__init__(dump_dir, tag)
        self.fail_step, self.how = step, how

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_step and self.how == "raise":
            raise ValueError(f"planned failure of {self.tag}")
        if self.global_step == self.fail_step and self.how == "exit":
            os._exit(3)
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass

    def on_train_end(self) -> None:
        pass


def _fits_worker(rank: int, port: int, root: str, plan: list[tuple[str, dict]], compressor: str) -> None:
    """Fits in sequence in one process group (the group outlives a fit); ``plan`` is ``[(tag, {rank: how})]`` with
    ``how`` as in :class:`_FailAt`, failing at step 2. Each outcome is caught (as a caller that goes on would) and
    recorded."""
    as_launched_rank(rank, port)
    outcomes = []
    for tag, how in plan:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            strategy=CompressedDDPStrategy(compressor=compressor, collective_timeout_s=30, log_comm_metrics=False),
        )
        try:
            trainer.fit(_FailAt(root, tag, step=2, how=how.get(rank)))
            outcomes.append({"type": None, "message": None, "step": trainer.global_step})
        except Exception as e:  # noqa: BLE001 - the caller catches the failure and goes on
            outcomes.append({"type": type(e).__name__, "message": str(e), "step": trainer.global_step})
        torch.save(outcomes, Path(root) / f"fits_rank{rank}.pt")
    os._exit(0)


def run_fits(tmp_path: Path, plan: list[tuple[str, dict]], compressor: str = "sign") -> list[list[dict]]:
    """Each rank's outcomes of :func:`_fits_worker`."""
    run_rank_processes(_fits_worker, str(tmp_path), plan, compressor)
    paths = [tmp_path / f"fits_rank{r}.pt" for r in range(WORLD)]  # none: the rank exited in its first fit
    return [torch.load(path, weights_only=False) if path.exists() else [] for path in paths]


@pytest.mark.parametrize("compressor", ["sign", "int8", "int8_rs"])
def test_a_gather_codec_fails_when_a_peer_dies_instead_of_reading_garbage(tmp_path, compressor):
    """Rank 1 exits at step 2 with no error recorded (as a killed rank). Rank 0's next all_gather must fail and say
    that a peer stopped; before, the Communicator never read the all_gather's result, so its error was dropped and
    rank 0 decoded the uninitialized output buffer as rank 1's payload and finished all 6 steps. (``int8_rs``: its
    blocking all_to_all comes first and must fail the same way.)"""
    r0, r1 = run_fits(tmp_path, [("fit", {1: "exit"})], compressor)
    assert r1 == []  # rank 1 exited in the fit
    (outcome,) = r0
    assert outcome["type"] == "PeerRankFailedError" and outcome["step"] == 2, outcome
    assert "without a recorded error" in outcome["message"], outcome["message"]


@pytest.mark.parametrize("second", ["exit", "raise"])
def test_a_caught_failure_of_an_earlier_fit_is_not_blamed_for_a_later_one(tmp_path, second):
    """Two fits in one process group: in the first both ranks raise at step 2 and the caller catches it; in the
    second rank 1 exits at step 2 without a recorded error, or raises another error alone. Rank 0 must not name the
    first fit's ValueError (still in the store) as the cause of the second failure, and must name the second's."""
    r0, r1 = run_fits(tmp_path, [("fit1", {0: "raise", 1: "raise"}), ("fit2", {1: second})])
    assert [o["type"] for o in r1] == ["ValueError"] * (1 if second == "exit" else 2), r1
    assert r0[0]["type"] == "ValueError" and "planned failure of fit1" in r0[0]["message"], r0
    assert r0[1]["type"] == "PeerRankFailedError" and r0[1]["step"] == 2, r0
    message = r0[1]["message"]
    assert "fit1" not in message, message
    if second == "exit":
        assert "without a recorded error" in message, message
    else:
        assert "rank 1 stopped at step 2: ValueError: planned failure of fit2" in message, message


class _BranchModule(TinyModule):
    """TinyModule with a branch (``branch``) that every rank uses only at steps 0 and 3: at the other steps it is
    unused on all ranks, so under ``find_unused_parameters=True`` DDP leaves its ``.grad`` None. Records the
    branch's error-feedback residual after every step."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.branch = nn.Linear(16, 8)
        self.seen: list[tuple[int, bool, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(self.global_step, self.global_rank)
        out = self.net(x) + (self.branch(x) if self.global_step % 3 == 0 else 0)
        return F.mse_loss(out, y)

    def on_train_start(self) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        compressor = self.trainer.strategy.compressor
        residual = compressor.residuals["branch.weight"].clone()
        server = getattr(compressor, "server_residuals", {}).get("branch.weight")  # int8_rs: this rank's share
        if server is not None:
            residual = torch.cat([residual.view(-1), server])
        self.seen.append((self.global_step - 1, self.branch.weight.grad is None, residual))

    def on_train_end(self) -> None:
        torch.save(self.seen, Path(self.dump_dir) / f"branch_rank{self.global_rank}.pt")


UNUSED_CODECS = {
    "sign": "sign",
    "topk": "topk",
    "powersgd": {"name": "powersgd", "matrix_approximation_rank": 1},
    "int8_rs": {"name": "int8_rs", "error_feedback": True, "block_size": 64},
}


def _fit_with_a_branch(tmp: Path, key: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        strategy=CompressedDDPStrategy(compressor=UNUSED_CODECS[key], find_unused_parameters=True,
                                       log_comm_metrics=False),
    )
    trainer.fit(_BranchModule(str(tmp), "branch"))


@pytest.mark.parametrize("key", list(UNUSED_CODECS))
def test_a_globally_unused_parameter_keeps_its_residual_until_it_is_used_again(fits, key):
    """find_unused_parameters=True, error-feedback codec: at a step where no rank used ``branch``, DDP leaves its grad
    None and discards what the hook sent for it, so its residual must stay as it was (to be sent at its next use).
    Before, the hook sent part of it and kept the rest, and the sent part was lost: the residual drained."""
    tmp = fitted(fits, _fit_with_a_branch, key)
    for rank in range(WORLD):
        seen = torch.load(tmp / f"branch_rank{rank}.pt", weights_only=True)
        assert [(step, unused) for step, unused, _ in seen] == [(s, s % 3 != 0) for s in range(6)], seen
        for (step, unused, residual), (_, _, before) in zip(seen[1:], seen):
            assert before.abs().sum() > 0, (rank, step)  # the codec left something in it at the step before
            if unused:
                assert torch.equal(residual, before), (rank, step, (residual - before).abs().sum())
            else:
                assert not torch.equal(residual, before), (rank, step)


class _BranchModuleZeroedInPlace(_BranchModule):
    """:class:`_BranchModule` whose optimizer zeroes gradients in place: DDP leaves an unused branch's grad zeros."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if batch_idx % 2 == 1:  # the second of a step's 2 micro-batches: after its optimizer step
            super().on_train_batch_end(outputs, batch, batch_idx)


def _fit_with_a_branch_zeroed_in_place(tmp: Path, key: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=2,
        strategy=CompressedDDPStrategy(compressor=UNUSED_CODECS[key], find_unused_parameters=True,
                                       log_comm_metrics=False),
    )
    trainer.fit(_BranchModuleZeroedInPlace(str(tmp), "branch"))


def test_an_unused_parameter_keeps_its_residual_when_grads_are_zeroed_in_place(fits):
    """As test_a_globally_unused_parameter_keeps_its_residual_until_it_is_used_again, with ``zero_grad(set_to_none=
    False)`` and 2 micro-batches per step (``no_sync``): the unused branch's grad is then zeros, not None, and the
    strategy tells it unused from DDP's used map. Before, its residual drained at every unused step (sign: L1 6.07 ->
    2.97) and what the hook sent of it was lost."""
    tmp = fitted(fits, _fit_with_a_branch_zeroed_in_place, "sign")
    for rank in range(WORLD):
        seen = torch.load(tmp / f"branch_rank{rank}.pt", weights_only=True)
        assert [step for step, _, _ in seen] == list(range(6)), seen
        for (step, _, residual), (_, _, before) in zip(seen[1:], seen):
            assert torch.equal(residual, before) == (step % 3 != 0), (rank, step, (residual - before).abs().sum())


class _FrozenFirstLayer(TinyModule):
    """TinyModule whose first layer is frozen (before the fit), or is unfrozen / frozen at step ``toggle_at``."""

    def __init__(self, dump_dir: str, tag: str, frozen: bool, toggle_at: int | None = None) -> None:
        super().__init__(dump_dir, tag)
        self.net[0].requires_grad_(not frozen)
        self.toggle_at = toggle_at

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_step == self.toggle_at:
            self.net[0].requires_grad_(not self.net[0].weight.requires_grad)


def _fit_toggling(tmp: Path, key: str, tag: str, max_steps: int, checkpoint: bool = False, **module_kwargs) -> None:
    """A 2-rank fit of :class:`_FrozenFirstLayer` under ``EPOCH_UPDATES[key]`` (period 4), with
    ``find_unused_parameters`` (DDP refuses a layer frozen mid-fit without it); ``checkpoint``: at its last step,
    ``tmp/tag/step=N.ckpt``."""
    resume = module_kwargs.pop("ckpt_path", None)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / tag, filename="{step}",
                                                     every_n_train_steps=max_steps)] if checkpoint else []
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=checkpoint, callbacks=callbacks,
                        strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key], log_comm_metrics=False,
                                                       find_unused_parameters=True))
    trainer.fit(_FrozenFirstLayer(str(tmp), tag, **module_kwargs), ckpt_path=resume)


def _fit_unfrozen_at_resume(tmp: Path, key: str) -> None:
    """4 steps with ``net.0`` frozen (checkpoint at step 4), then a resume to step 8 with it trainable; for local SGD
    also a straight 8 steps that unfreezes it at step 4 (DiLoCo refuses a change of what trains within a fit)."""
    _fit_toggling(tmp, key, "frozen", 4, checkpoint=True, frozen=True)
    _fit_toggling(tmp, key, "resumed", 8, frozen=False, ckpt_path=str(tmp / "frozen" / "step=4.ckpt"))
    if key == "local_sgd":
        _fit_toggling(tmp, key, "straight", 8, frozen=True, toggle_at=4)


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_a_layer_unfrozen_at_a_resume_trains_on_under_local_updates(fits, key):
    """A layer frozen when the checkpoint was written and trainable in the resumed fit (progressive unfreezing across
    fits, as the docs advise for DiLoCo): it is not among the checkpoint's per-rank parameters nor DiLoCo's outer
    state. Before, both resumes failed at setup with a bare ``KeyError: 'net.0.weight'`` (and DiLoCo's next step
    with 'DiLoCo state has no outer parameters'). Now the layer starts from its loaded value, the same on every
    rank; local SGD's resume is bit for bit a straight fit that unfroze it at that step, and DiLoCo starts its outer
    loop for it at that value with zero momentum."""
    tmp = fitted(fits, _fit_unfrozen_at_resume, key)
    start, end = dumps(tmp, "resumed", "start"), dumps(tmp, "resumed", "end")
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    assert not torch.equal(end[0]["params"]["0.weight"], start[0]["params"]["0.weight"])  # it trained
    if key == "local_sgd":
        for r, straight in enumerate(dumps(tmp, "straight", "end")):
            assert_same(end[r]["params"], straight["params"], f"rank{r} resumed vs straight")
    else:
        assert "net.0.weight" in end[0]["local_update"]["outer_params"]


def _fit_frozen_between_syncs(tmp: Path, key: str) -> None:
    """Local SGD (period 4): ``net.0`` frozen at step 2, between syncs, in a straight 8-step fit; and in a resume from
    a step-2 checkpoint with ``net.0`` frozen from the start."""
    _fit_toggling(tmp, key, "straight", 8, frozen=False, toggle_at=2)
    _fit_toggling(tmp, key, "first", 2, checkpoint=True, frozen=False)
    _fit_toggling(tmp, key, "resumed", 8, frozen=True, ckpt_path=str(tmp / "first" / "step=2.ckpt"))


def test_a_layer_frozen_between_local_sgd_syncs_is_averaged_first(fits):
    """Local SGD averages the trainable parameters only. A layer frozen 2 steps after a sync (each rank had trained
    its own copy) kept each rank's copy for good: the 2-rank fit ended with the ranks' ``net.0`` differing, and its
    checkpoints held rank 0's. Now the first forward with a changed set of trainable parameters syncs those that
    trained until then (an early sync): the ranks end equal, and a resume from a step-2 checkpoint with the layer
    frozen (each rank's own copy restored, then averaged) is bit for bit that straight fit."""
    tmp = fitted(fits, _fit_frozen_between_syncs, "local_sgd")
    straight, resumed = dumps(tmp, "straight", "end"), dumps(tmp, "resumed", "end")
    assert_same(straight[0]["params"], straight[1]["params"], "the straight fit's ranks")
    for r in range(WORLD):
        assert_same(resumed[r]["params"], straight[r]["params"], f"rank{r} resumed vs straight")


class _TwoOptimizers(TinyModule):
    """Manual optimization, GAN-style: ``net.g`` stepped every batch, ``net.d`` every second batch, each step with
    ``toggle_optimizer`` (which switches ``requires_grad`` off on the other optimizer's parameters)."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.automatic_optimization = False
        self.net = nn.ModuleDict({"g": make_net(), "d": nn.Linear(8, 1)})
        self.d_residuals: list[torch.Tensor] = []

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.g.parameters(), lr=0.05), torch.optim.SGD(self.net.d.parameters(), lr=0.05)]

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(batch_idx, self.global_rank)
        g, d = self.net.g, self.net.d
        losses = [lambda: F.mse_loss(g(x), y) + d(g(x)).mean(), lambda: (d(g(x).detach()) ** 2).mean()]
        for opt, loss in zip(self.optimizers()[: 1 + batch_idx % 2], losses):
            self.toggle_optimizer(opt)
            self.manual_backward(loss())
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # the discriminator's residual after each batch
        codec = self.trainer.strategy.compressor
        if codec is not None:
            self.d_residuals.append(codec.residuals["net.d.weight"].clone())

    def on_train_end(self) -> None:
        super().on_train_end()
        torch.save(self.d_residuals, Path(self.dump_dir) / f"d_residuals_rank{self.global_rank}.pt")


TOGGLE_RUNS = {**EPOCH_UPDATES, "int8_ef": {"name": "int8", "error_feedback": True, "block_size": 64}}


def _fit_two_optimizers(tmp: Path, key: str) -> None:
    """12 optimizer steps (8 batches) of :class:`_TwoOptimizers` under ``TOGGLE_RUNS[key]`` (period 4)."""
    comm = {"local_update" if key in EPOCH_UPDATES else "compressor": TOGGLE_RUNS[key]}
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=12, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        strategy=CompressedDDPStrategy(**comm, log_comm_metrics=False, find_unused_parameters=True))
    trainer.fit(_TwoOptimizers(str(tmp), "gan"))


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_local_updates_sync_every_optimizers_parameters_under_toggle_optimizer(fits, key):
    """A sync falls in one optimizer's step, where ``toggle_optimizer`` has switched the other's parameters off.
    The rule synced the trainable parameters only: local SGD averaged the toggled optimizer's alone (every sync at
    steps 4, 8 and 12 fell in the discriminator's or the generator's step), so the ranks' other parameters never met
    (0.021 apart at the end), and DiLoCo raised 'the trainable parameters changed since its outer loop started'."""
    tmp = fitted(fits, _fit_two_optimizers, key)
    end = dumps(tmp, "gan", "end")
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    assert end[0]["local_update"]["num_syncs"] == 3
    if key == "diloco":
        assert {"net.g.0.weight", "net.d.weight"} <= set(end[0]["local_update"]["outer_params"])


def test_a_toggled_off_optimizers_residual_waits_for_its_next_step(fits):
    """Under an error-feedback codec and ``find_unused_parameters``, the generator's step leaves the discriminator
    (toggled off) unused: DDP discards what the hook sent for it, and the strategy puts its residual back, but it
    only looked among the ``requires_grad`` parameters, so that residual was sent and lost at every generator step
    (int8: drained to 0 after each). It must be what the discriminator's own step left, until its next step."""
    tmp = fitted(fits, _fit_two_optimizers, "int8_ef")
    end = dumps(tmp, "gan", "end")
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    for rank in range(WORLD):
        after = torch.load(tmp / f"d_residuals_rank{rank}.pt", weights_only=True)  # batch b: D stepped iff b is odd
        for b in range(1, len(after) - 1, 2):
            assert after[b].abs().sum() > 0, (rank, b)
            assert torch.equal(after[b + 1], after[b]), (rank, b)


OVERFLOW_CODECS = {  # every codec with error feedback (and PowerSGD's warm start, int8_rs's server residuals)
    "fp16_ef": {"name": "fp16", "error_feedback": True},
    "int8_ef": {"name": "int8", "error_feedback": True, "block_size": 64},
    "int4": {"name": "int4", "block_size": 64},
    "topk": {"name": "topk", "ratio": 0.05},
    "sign": "sign",
    "powersgd": {"name": "powersgd", "matrix_approximation_rank": 1},
    "int8_rs_ef": {"name": "int8_rs", "error_feedback": True, "block_size": 64},
}
OVERFLOW_STEP = 2


class _OverflowModule(TinyModule):
    """TinyModule whose rank 1 alone puts an inf into one value of ``net.0.weight``'s gradient at ``OVERFLOW_STEP``
    (a tensor hook: it runs before DDP's bucket sees the gradient). Records after every step the compressor's state,
    the GradScaler's scale and the parameters. Its output is multiplied by ``gain`` outside autocast: every other
    gradient is an fp16 value under 16-mixed (CPU autocast runs these layers in fp16), on which the fp16 codec's
    residual stays 0."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.gain = nn.Parameter(torch.ones(8))
        self.seen: list[dict] = []

        def poison(grad):
            if self.global_rank == 1 and self.global_step == OVERFLOW_STEP:
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        self.net[0].weight.register_hook(poison)

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(self.global_step, self.global_rank)
        with torch.autocast("cpu", enabled=False):
            return F.mse_loss(self.net(x).float() * self.gain, y)

    def on_train_start(self) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        state = self.trainer.strategy.compressor.state_dict()
        self.seen.append(
            {
                "step": self.global_step,
                "scale": float(self.trainer.precision_plugin.scaler.get_scale()),
                "state": {k: state[k] for k in ("residuals", "server_residuals", "q_memory") if k in state},
                "params": {k: v.detach().clone() for k, v in self.state_dict().items()},
            }
        )

    def on_train_end(self) -> None:
        torch.save(self.seen, Path(self.dump_dir) / f"{self.tag}_rank{self.global_rank}.pt")


def _fit_overflow(tmp: Path, tag: str) -> None:
    """A 16-mixed fit (CPU GradScaler, several DDP buckets) through the codec ``OVERFLOW_CODECS[tag]``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    _fit_16_mixed(_OverflowModule(str(tmp), tag), str(tmp), OVERFLOW_CODECS[tag], scaler, OVERFLOW_STEP + 2,
                  bucket_cap_mb=0.004)


def _fit_16_mixed(module, root: str, spec, scaler, max_steps: int, **strategy_kwargs) -> None:
    """``module`` fitted on every rank under 16-mixed with ``scaler``, through the codec ``spec``."""
    from lightning.pytorch.plugins import MixedPrecision

    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy=CompressedDDPStrategy(
            compressor=spec, collective_timeout_s=60, log_comm_metrics=False, **strategy_kwargs
        ),
    )
    trainer.fit(module)


class _ManualOverflowModule(_OverflowModule):
    """:class:`_OverflowModule` under manual optimization: its backward, so the comm hook, runs before
    ``optimizer.step`` (and before the strategy's ``optimizer_step``). Records at every reduce the loss scale the codec
    was told and the GradScaler's scale the bucket holds."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.automatic_optimization = False
        self.told: list[tuple[int, float | None, float]] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()
        opt.zero_grad()

    def on_train_start(self) -> None:
        codec, scaler = self.trainer.strategy.compressor, self.trainer.precision_plugin.scaler
        reduce = codec.reduce

        def recording(flat, segments, comm, step):
            self.told.append((step, codec.grad_scale, float(scaler.get_scale())))
            return reduce(flat, segments, comm, step)

        codec.reduce = recording

    def on_train_end(self) -> None:
        torch.save(self.told, Path(self.dump_dir) / f"told_rank{self.global_rank}.pt")


def _fit_manual(tmp: Path, tag: str) -> None:
    """The overflow fit of top-k (several buckets) under manual optimization."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    module = _ManualOverflowModule(str(tmp), "manual")
    _fit_16_mixed(module, str(tmp), OVERFLOW_CODECS[tag], scaler, OVERFLOW_STEP + 2, bucket_cap_mb=0.004)


def test_manual_optimization_tells_the_codec_the_scale_before_its_backward(fits):
    """Under manual optimization the comm hook runs in ``manual_backward``, before the strategy's ``optimizer_step``,
    which was where the codec was told the scale: after the skipped step (scale 1024 -> 512) the hook added the
    residual, made under 1024, to a bucket under 512 (at twice its value), and the late rescale then halved the new
    residual. Every reduce must run under the scale its bucket holds, as under automatic optimization."""
    tmp = fitted(fits, _fit_manual, "topk")
    for rank in range(WORLD):
        told = torch.load(tmp / f"told_rank{rank}.pt", weights_only=True)
        assert {scale for _, _, scale in told} == {1024.0, 512.0}, told  # the skip at step 2 halved it
        assert all(codec == scale for _, codec, scale in told), (rank, told)


def _fit_init_scale(tmp: Path, tag: str) -> None:
    """One 16-mixed top-k fit of 2 steps, without overflow, under a GradScaler whose ``init_scale`` (1000.1) fp32
    does not hold: the scaler keeps it as fp32 1000.0999755859375 from the first step on."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.1)
    # (the module's overflow is at step 2: never reached)
    _fit_16_mixed(_OverflowModule(str(tmp), "init_scale"), str(tmp), OVERFLOW_CODECS[tag], scaler, 2)


def test_a_first_step_under_an_init_scale_fp32_cannot_hold_is_not_taken_for_a_skip(fits):
    """The skip is told by the scale going down in the step. Before the first step the GradScaler reports its
    ``init_scale`` as the Python float given, after it the fp32 it holds: for 1000.1 that is lower, and the strategy
    took the taken first step for a skipped one and undid it in the codec (its residuals back to zero)."""
    tmp = fitted(fits, _fit_init_scale, "topk")
    for rank in range(WORLD):
        first = torch.load(tmp / f"init_scale_rank{rank}.pt", weights_only=True)[0]
        assert first["scale"] == torch.tensor(1000.1, dtype=torch.float32).item() < 1000.1  # taken, not halved
        assert any(r.abs().sum() > 0 for r in first["state"]["residuals"].values()), rank  # the step's residual


@pytest.mark.parametrize("tag", list(OVERFLOW_CODECS))
def test_a_step_skipped_for_one_ranks_overflow_leaves_every_ranks_residuals_as_they_were(fits, tag):
    """16-mixed, several DDP buckets: at one step rank 1's gradient holds an inf and rank 0's is finite. Every rank
    must see the overflow (the GradScaler halves its scale and skips the step on both: parameters unchanged and
    equal), and since the step's gradient is discarded, as in plain DDP, every rank's error-feedback state (worker
    residuals, PowerSGD's Qs, int8_rs's server residuals) must be exactly what it was before the step."""
    tmp = fitted(fits, _fit_overflow, tag)
    ranks = [torch.load(tmp / f"{tag}_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank, seen in enumerate(ranks):
        before, after = seen[OVERFLOW_STEP - 1], seen[OVERFLOW_STEP]
        where = f"{tag} rank {rank}"
        assert (before["scale"], after["scale"]) == (1024.0, 512.0), where  # the scaler skipped the step
        assert_same(after["params"], before["params"], f"{where} params")  # no rank stepped alone
        assert_same(after["params"], ranks[0][OVERFLOW_STEP]["params"], f"{where} params across ranks")
        assert any(r.abs().sum() > 0 for r in before["state"]["residuals"].values()), where
        assert_same(after["state"], before["state"], f"{where} state")
        assert not torch.equal(seen[-1]["params"]["net.0.weight"], after["params"]["net.0.weight"]), where
