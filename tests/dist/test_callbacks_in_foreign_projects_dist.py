"""lit_dtrain's callbacks in a user's own Lightning project under 2-process DDP (gloo, CPU, 127.0.0.1).

The user's project is not lit_dtrain's: its own GPT-like module whose blocks are ``transformer.h`` (not ``blocks``),
a ``training_step`` that returns a bare loss, its own AdamW, its own ``DataLoader`` of dict samples (Lightning adds
the DistributedSampler), Lightning's ``Trainer(strategy="ddp")`` and ``ckpt_path``; no ``train()``, no Hydra.
Checked: no rank hangs, both ranks hold the same weights after every step, a spike on one rank (and on both) gets the
same action on both, and a resume from the user's checkpoint continues every callback (and the weights) exactly."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port, leave_rank

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

VOCAB, T, N_SAMPLES, BATCH = 64, 16, 32, 2  # 32 samples / (2 ranks x 2) = 8 steps an epoch


def _user_fits(rank: int, root: str) -> None:
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import (
        AdaptiveGradClip,
        LossSpikeMonitor,
        OncePerStepLRMonitor,
        OptimizerDiagnostics,
        SelectiveCheckpointing,
        WSDScheduler,
        token_throughput_monitor,
    )

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            h = self.ln(x)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(x)

    class UserGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, 32),
                                              "h": nn.ModuleList([Block(32) for _ in range(2)])})
            self.head = nn.Linear(32, VOCAB)
            self.spike: float | None = None  # set by Inject for one step
            self.example_input_array = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))

        def forward(self, ids):
            x = self.transformer["wte"](ids)
            for block in self.transformer["h"]:
                x = block(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            logits = self(ids[:, :-1])
            if self.spike is not None:
                logits = logits * self.spike
            return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, VOCAB, (T + 1,), generator=g), "index": i} for i in range(N_SAMPLES)]

    class Inject(L.Callback):
        """Logits x100 at the given steps, on the given ranks only."""

        def __init__(self, steps: dict[int, tuple[int, ...]]):
            self.steps = steps

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            on = trainer.global_rank in self.steps.get(trainer.global_step, ())
            pl_module.spike = 100.0 if on else None

    class Record(L.Callback):
        def __init__(self):
            self.params: dict[int, dict] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def fit(name: str, max_steps: int, inject: dict, actions: list[str], ckpt_path: str | None = None,
            save_every: int | None = None, ckpt_policy: str = "budget"):
        monitor = LossSpikeMonitor(actions=actions, warmup_steps=3, snapshot_every=2, cooldown_steps=2,
                                   path=os.path.join(root, f"{name}_spikes.jsonl"))
        clip, wsd = AdaptiveGradClip(warmup_steps=3), WSDScheduler(total_steps=16, warmup_steps=2, decay_steps=4)
        record = Record()
        ckpt = SelectiveCheckpointing(policy=ckpt_policy, module_pattern="transformer.h.*", memory_budget=0.7)
        callbacks = [Inject(inject), wsd, monitor, clip, OptimizerDiagnostics(every_n_steps=2),
                     ckpt,
                     OncePerStepLRMonitor(logging_interval="step"), token_throughput_monitor(window_size=2), record]
        if save_every:
            callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, f"{name}_ckpt"), every_n_train_steps=save_every,
                                             save_top_k=-1, filename="{step}"))
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, callbacks=callbacks,
                            logger=CSVLogger(root, name=name), log_every_n_steps=1,
                            enable_checkpointing=bool(save_every), enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root)
        trainer.fit(UserGPT(), train_dataloaders=DataLoader(samples, batch_size=BATCH), ckpt_path=ckpt_path)
        return {"global_step": trainer.global_step, "params": record.params,
                "events": [(e["step"], e["actions"], sorted(e["index"])) for e in monitor.events],
                "states": {"LossSpikeMonitor": monitor.state_dict(), "AdaptiveGradClip": clip.state_dict(),
                           "WSDScheduler": wsd.state_dict(), "SelectiveCheckpointing": ckpt.state_dict()},
                "lr": [g["lr"] for g in trainer.optimizers[0].param_groups]}

    one_rank = {5: (1,), 10: (0,)}  # a spike on rank 1's batch at step 5, on rank 0's at step 10
    results = {
        "straight": fit("straight", 14, one_rank, ["log", "skip", "lr_cooldown"], save_every=8),
        "both": fit("both", 8, {5: (0, 1)}, ["log", "rollback"], ckpt_policy="selective"),
    }
    results["resumed"] = fit("resumed", 14, one_rank, ["log", "skip", "lr_cooldown"],
                             ckpt_path=os.path.join(root, "straight_ckpt", "step=8.ckpt"))
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))


def _worker(rank: int, port: int, root: str) -> None:
    """The fits of the five tests below that run in ranks this file spawns (``mp.spawn``), in one process group: a
    spawn per test started two fresh Pythons (imports, gloo set-up) for fits of a few seconds. Each writes under its
    own dir of ``root``; a failure in any of them fails mp.spawn, naming it. The two SIGTERM runs come last: each
    rank's fits after a signal start from Lightning's handlers again (``_preemption_worker`` trains two more)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    _user_fits(rank, os.path.join(root, "user"))
    _fourier_fits(rank, os.path.join(root, "fourier"))
    _uneven_fit(rank, os.path.join(root, "uneven"))
    _preemption_fits(rank, os.path.join(root, "preempt"))
    _signal_in_agreement_fit(rank, os.path.join(root, "agreement"))
    leave_rank()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    from tests.conftest import make_corpus

    root = tmp_path_factory.mktemp("foreign")
    for name in ("user", "fourier", "uneven", "preempt", "agreement"):
        (root / name).mkdir()
    make_corpus(root / "fourier" / "corpus", n_files=4, size=2000)
    _lm_data(str(root / "fourier")).prepare_data()  # the token cache, built once before the ranks start
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=2, join=True)
    return root


@pytest.mark.slow
def test_user_project_callbacks_under_ddp(fitted: Path) -> None:
    root = fitted / "user"
    r0, r1 = (torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for name in ("straight", "both", "resumed"):
        a, b = r0[name], r1[name]
        assert a["global_step"] == b["global_step"]
        assert a["events"] == b["events"], name
        for step, params in a["params"].items():  # the ranks hold the same weights after every step
            for k, v in params.items():
                assert torch.equal(v, b["params"][step][k]), (name, step, k)
    straight, resumed = r0["straight"], r0["resumed"]
    print(straight["events"], r0["both"]["events"], resumed["events"], straight["states"])
    # the spike on one rank's batch was skipped on both, and its samples skipped again in the next epoch
    assert [(s, a) for s, a, _ in straight["events"]] == [(5, ["log", "skip", "lr_cooldown"]), (9, ["skip"]),
                                                          (10, ["log", "skip", "lr_cooldown"]), (12, ["skip"])]
    # the resume from the user's own ModelCheckpoint at step 8 continues every callback, and the weights, exactly
    assert resumed["events"] == straight["events"][1:]
    assert resumed["lr"] == straight["lr"]
    for step in range(9, 15):
        for k, v in resumed["params"][step].items():
            assert torch.equal(v, straight["params"][step][k]), (step, k)
    assert _flat(resumed["states"]) == _flat(straight["states"])
    # the loggers' rows, written by rank 0: one LR row per optimizer step, the spike and throughput metrics beside it
    rows = list(csv.DictReader((root / "straight" / "version_0" / "metrics.csv").open()))
    keys = ("lr-AdamW", "spike/count", "train/samples")
    steps_with = {k: sorted({int(r["step"]) for r in rows if r[k]}) for k in keys}
    assert steps_with == {k: list(range(14)) for k in steps_with}
    assert sum(1 for r in rows if r["lr-AdamW"]) == 14
    both = r0["both"]
    assert [(s, a) for s, a, _ in both["events"]] == [(5, ["log", "rollback"])]
    for k, v in both["params"][6].items():  # rolled back to the snapshot of step 4, on both ranks
        assert torch.equal(v, both["params"][4][k]), k


def _flat(value):
    """Tensors as lists, so that nested callback states compare with ==."""
    if isinstance(value, dict):
        return {k: _flat(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flat(v) for v in value]
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _fourier_fits(rank: int, root: str) -> None:
    """The user's own LM on ``LMDataModule(sampler=FourierSampler(...))``, with ``FourierSamplerCallback`` and a
    ``LossSpikeMonitor`` that skips (the sampler excludes the spike's samples): straight, and resumed at step 4."""
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

    from lit_dtrain.callbacks import FourierSamplerCallback, LossSpikeMonitor

    class UserLM(L.LightningModule):
        step_output_keys = ("loss", "token_loss", "index")

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.transformer = nn.ModuleDict({"wte": nn.Embedding(512, 16), "h": nn.ModuleList([nn.Linear(16, 16)])})
            self.head = nn.Linear(16, 512)
            self.spike_at: tuple[int, int] | None = None  # (step, rank): logits x100 there

        def training_step(self, batch, batch_idx):
            x = self.transformer["wte"](batch["input_ids"])
            logits = self.head(torch.tanh(self.transformer["h"][0](x)))
            if self.spike_at == (self.global_step, self.global_rank):
                logits = logits * 100.0
            token_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
            token_loss = token_loss.view_as(batch["labels"])
            return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), 1e-2)

    class Record(L.Callback):
        def __init__(self):
            self.params: dict[int, dict] = {}
            self.indices: dict[int, list[int]] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.indices[trainer.global_step] = batch["index"].tolist()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def fit(name: str, ckpt_path: str | None = None):
        data, module, record = _lm_data(root), UserLM(), Record()
        module.spike_at = (5, 1)
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=os.path.join(root, f"{name}.jsonl"))
        callbacks = [FourierSamplerCallback(), monitor, record]
        if ckpt_path is None:
            callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, f"{name}_ckpt"), every_n_train_steps=4,
                                             save_top_k=-1, filename="{step}"))
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=8, callbacks=callbacks,
                            logger=False, enable_checkpointing=ckpt_path is None, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return {"params": record.params, "indices": record.indices, "sampler": _flat(data.sampler.state_dict()),
                "events": [(e["step"], e["actions"], sorted(e["index"])) for e in monitor.events],
                "monitor": _flat(monitor.state_dict())}

    results = {"straight": fit("straight")}
    results["resumed"] = fit("resumed", os.path.join(root, "straight_ckpt", "step=4.ckpt"))
    torch.save(results, os.path.join(root, f"fourier{rank}.pt"))


def _lm_data(root: str):
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.datamodule import LMDataModule
    from lit_dtrain.data.samplers.fourier import FourierSampler

    source = CorpusSource(name="c", kind="files", paths=[os.path.join(root, "corpus")])
    return LMDataModule(sources=[source], block_size=16, batch_size=4, cache_dir=os.path.join(root, "cache"),
                        progress=False, max_val_windows=4, sampler=FourierSampler(step_unit=1))


def test_user_lm_with_fourier_sampler_under_ddp(fitted: Path) -> None:
    root = fitted / "fourier"
    r0, r1 = (torch.load(root / f"fourier{r}.pt", weights_only=False) for r in (0, 1))
    for name in ("straight", "resumed"):
        a, b = r0[name], r1[name]
        assert a["sampler"] == b["sampler"], name  # the same tables on both ranks
        assert a["events"] == b["events"] and a["monitor"] == b["monitor"], name
        for step, indices in a["indices"].items():  # each rank its own share of the global batch
            assert not set(indices) & set(b["indices"][step]), (name, step)
        for step, params in a["params"].items():
            for k, v in params.items():
                assert torch.equal(v, b["params"][step][k]), (name, step, k)
    straight, resumed = r0["straight"], r0["resumed"]
    print(straight["events"], straight["sampler"].keys() if isinstance(straight["sampler"], dict) else None)
    assert [(s, a) for s, a, _ in straight["events"]] == [(5, ["log", "skip"])]
    assert resumed["events"] == straight["events"]
    for step in range(5, 9):  # the resumed run draws the same batches and trains to the same weights
        assert resumed["indices"][step - 1] == straight["indices"][step - 1], step
        for k, v in resumed["params"][step].items():
            assert torch.equal(v, straight["params"][step][k]), (step, k)
    assert resumed["sampler"] == straight["sampler"]
    assert resumed["monitor"] == straight["monitor"]


class Regression(L.LightningModule):
    """A user's linear regression on dict batches ``{"x": [B, 4], "y": [B, 1]}``, AdamW; the loss x100 at
    ``spike_at`` = (step, rank)."""

    def __init__(self, spike_at: tuple[int, int] | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.spike_at = spike_at

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        return loss * (100.0 if (self.global_step, self.global_rank) == self.spike_at else 1.0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _uneven_fit(rank: int, root: str) -> None:
    """The user shards the data by hand (``use_distributed_sampler=False``): rank 0 holds 18 samples, rank 1 17,
    so the last batches hold 2 and 1. A spike on rank 0's last batch, skipped with the previous step's samples."""
    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import LossSpikeMonitor

    g = torch.Generator().manual_seed(rank)
    shard = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g), "index": 100 * rank + i}
             for i in range(18 - rank)]
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2, exclude_previous_steps=1,
                               path=os.path.join(root, "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, callbacks=[monitor], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=root)
    trainer.fit(Regression(spike_at=(4, 0)), train_dataloaders=DataLoader(shard, batch_size=4))
    torch.save({"events": [(e["step"], e["index"]) for e in monitor.events], "excluded": sorted(monitor.excluded)},
               os.path.join(root, f"uneven{rank}.pt"))


def test_spike_on_ranks_with_unequal_batches_excludes_exactly_their_samples(fitted: Path) -> None:
    """The spike's samples are gathered from ranks whose batches differ in size. Before, the all-gather of unequal
    tensors gave rank 0 an index that was not in the batch (0) and aborted rank 1 in gloo ("Received data size
    doesn't match expected size")."""
    root = fitted / "uneven"
    r0, r1 = (torch.load(root / f"uneven{r}.pt", weights_only=False) for r in (0, 1))
    assert r0 == r1
    assert r0["events"] == [(4, [16, 17, 116])]  # rank 0's last batch (2 samples), rank 1's (1 sample)
    assert r0["excluded"] == [12, 13, 14, 15, 16, 17, 112, 113, 114, 115, 116]  # and the previous step's


def _preemption_fits(rank: int, root: str) -> None:
    """SIGTERM to rank 1 alone at step 3 of a user's project with ``PreemptionCheckpoint``; then a resume from the
    saved file (an epoch boundary: 4 steps an epoch) and a straight run."""
    import signal

    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import AdaptiveGradClip, PreemptionCheckpoint, WSDScheduler

    class Sigterm(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if (trainer.global_step, trainer.global_rank) == (3, 1):
                os.kill(os.getpid(), signal.SIGTERM)

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)} for _ in range(32)]

    def fit(callbacks: list, ckpt_path: str | None = None) -> dict:
        wsd, clip = WSDScheduler(total_steps=12, warmup_steps=2, decay_steps=4), AdaptiveGradClip(warmup_steps=2)
        module = Regression()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12,
                            callbacks=[*callbacks, wsd, clip], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
        stopped = None
        try:
            trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
        except SystemExit as e:  # Lightning's SIGTERMException
            stopped = type(e).__name__
        return {"stopped": stopped, "step": trainer.global_step, "params": _flat(module.state_dict()),
                "states": _flat({"wsd": wsd.state_dict(), "clip": clip.state_dict()})}

    path = os.path.join(root, "preempt", "last.ckpt")
    results = {"signalled": fit([Sigterm(), PreemptionCheckpoint(dirpath=os.path.dirname(path))]),
               "resumed": fit([PreemptionCheckpoint(dirpath=os.path.dirname(path))], path), "straight": fit([])}
    torch.save(results, os.path.join(root, f"preempt{rank}.pt"))


def test_sigterm_to_one_rank_of_a_users_project_saves_and_resumes_exactly(fitted: Path) -> None:
    root = fitted / "preempt"
    r0, r1 = (torch.load(root / f"preempt{r}.pt", weights_only=False) for r in (0, 1))
    for r in (r0, r1):  # both ranks stopped at the end of the signalled step, after the save
        assert (r["signalled"]["stopped"], r["signalled"]["step"]) == ("SIGTERMException", 4)
        assert r["resumed"]["stopped"] is None and r["resumed"]["step"] == 12
        assert r["resumed"]["params"] == r["straight"]["params"] == r0["straight"]["params"]
        assert r["resumed"]["states"] == r["straight"]["states"]
    assert (root / "preempt" / "last.ckpt").is_file()


def test_under_ddp_spawn_the_launching_process_keeps_the_callbacks_state_from_before_fit(tmp_path: Path) -> None:
    """What docs/callbacks_in_your_project.md says of ``ddp_spawn``: the ranks train in child processes and Lightning
    hands back only the weights, so the callback objects here keep their pre-fit state; the run's files hold it.

    A child that aborts at its exit after the fit (SIGABRT, "terminate called without an active exception" from
    torch's gloo teardown: 2 of 4 full CI runs, never alone or in its file here) is tried again, twice at most, with
    fresh objects; every assertion holds for the attempt that completes."""
    from torch.multiprocessing import ProcessExitedException
    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import LossSpikeMonitor, WSDScheduler

    for attempt in range(3):
        root = tmp_path / f"attempt{attempt}"
        g = torch.Generator().manual_seed(0)
        data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g), "index": i} for i in range(32)]
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
        wsd = WSDScheduler(total_steps=6, decay_steps=2)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=6, callbacks=[monitor, wsd],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(root))
        try:
            trainer.fit(Regression(spike_at=(4, 1)), train_dataloaders=DataLoader(data, batch_size=4))
            break
        except ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
    assert (monitor.events, monitor.num_spikes, wsd.last_step, trainer.global_step) == ([], 0, -1, 0)
    records = (root / "spikes.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [4]  # written by rank 0's child


USER_SCRIPT = '''
import os, sys, time
import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader
from lit_dtrain.callbacks import PreemptionCheckpoint
from tests.dist.test_callbacks_in_foreign_projects_dist import Regression

class Slow(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.1)
        if trainer.global_step == 3:
            print(f"READY {trainer.global_rank}", flush=True)

if __name__ == "__main__":
    root, catch = sys.argv[1], sys.argv[2] == "catch"
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)} for _ in range(64)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=300, logger=False,
                        callbacks=[Slow(), PreemptionCheckpoint(dirpath=root)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    try:
        trainer.fit(Regression(), train_dataloaders=DataLoader(data, batch_size=4))
    except SIGTERMException:
        print(f"STOPPED {trainer.global_rank} {trainer.global_step}", flush=True)
        if catch:
            sys.exit(143)
        raise
'''


@pytest.mark.parametrize("catch", [False, True])
def test_sigterm_to_the_script_lightning_launched_from_stops_both_ranks(tmp_path: Path, catch: bool) -> None:
    """A user's ``python script.py`` with ``Trainer(strategy="ddp", devices=2)``: Lightning starts rank 1 from rank 0.
    SIGTERM to that process: both ranks save ``last.ckpt`` and stop; the script exits with 0 (Lightning's
    ``SIGTERMException`` has no code), or with 143 where it catches it, as docs/callbacks_in_your_project.md says."""
    import signal
    import subprocess
    import time

    from tests.conftest import PYTHON, subprocess_env

    script = tmp_path / "user_train.py"
    script.write_text(USER_SCRIPT)
    env = subprocess_env(tmp_path)
    env.update(MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([PYTHON, str(script), str(tmp_path), "catch" if catch else "raise"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "READY 0" in line:  # (rank 1's line may share it)
                proc.send_signal(signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    stopped = sorted(re.findall(r"STOPPED (\d) (\d+)", text))  # (the ranks share stdout: lines may interleave)
    assert [rank for rank, _ in stopped] == ["0", "1"], text[-3000:]
    assert stopped[0][1] == stopped[1][1] and 3 <= int(stopped[0][1]) < 300  # the same step, long before the end
    assert proc.returncode == (143 if catch else 0), text[-3000:]
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == int(stopped[0][1])


def _signal_in_agreement_fit(rank: int, root: str) -> None:
    """SIGTERM to rank 0 while its ``PreemptionCheckpoint`` waits in the ranks' agreement of step 3."""
    import signal

    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import PreemptionCheckpoint

    class SignalDuringAgreement(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if trainer.global_rank != 0:
                return
            agree = trainer.strategy.reduce_boolean_decision

            def agree_and_signal(decision, all=True):
                if trainer.global_step == 3:  # the signal comes while this rank waits for the others
                    os.kill(os.getpid(), signal.SIGTERM)
                return agree(decision, all=all)

            trainer.strategy.reduce_boolean_decision = agree_and_signal

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)} for _ in range(32)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12, logger=False,
                        callbacks=[SignalDuringAgreement(), PreemptionCheckpoint(dirpath=root)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root)
    stopped = None
    try:
        trainer.fit(Regression(), train_dataloaders=DataLoader(data, batch_size=4))
    except SystemExit as e:  # Lightning's SIGTERMException
        stopped = type(e).__name__
    torch.save({"stopped": stopped, "step": trainer.global_step}, os.path.join(root, f"agreement{rank}.pt"))


def test_a_sigterm_during_the_ranks_agreement_is_kept_for_the_next_step(fitted: Path) -> None:
    """The handler of a SIGTERM that came while ``PreemptionCheckpoint`` waited in its all-reduce runs when that
    returns, after the rank had read its flag: the flag was then overwritten with the agreed "no", and the run trained
    on to ``max_steps`` without a checkpoint (2 of 3 runs of a user's script signalled at a step's end, by hand). Now
    the next step's agreement carries it: both ranks save at step 4 and stop."""
    root = fitted / "agreement"
    for rank in (0, 1):
        result = torch.load(root / f"agreement{rank}.pt", weights_only=False)
        assert result == {"stopped": "SIGTERMException", "step": 4}, rank
    assert torch.load(root / "last.ckpt", weights_only=False)["global_step"] == 4
