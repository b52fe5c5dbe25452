"""The 2-rank fits of test_callbacks_in_foreign_projects_dist.py, run by its module fixture in one pair of spawned rank
processes (``_worker``): a user's own GPT-like module and regression under Lightning's ``Trainer(strategy="ddp")`` with
lit_dtrain's callbacks, the user's LM on ``LMDataModule(sampler=FourierSampler(...))``, data sharded by hand into
unequal batches, and SIGTERM to one rank (at a step, and inside the ranks' agreement). Each fit writes its results
under its own dir of the root."""

from __future__ import annotations

import os

import lightning as L
import torch

from tests.conftest import leave_rank

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
    """The fits of the five tests of test_callbacks_in_foreign_projects_dist.py that run in ranks its fixture spawns
    (``mp.spawn``), in one process group: a spawn per test started two fresh Pythons (imports, gloo set-up) for fits
    of a few seconds. Each writes under its own dir of ``root``; a failure in any of them fails mp.spawn, naming it.
    The two SIGTERM runs come last: each rank's fits after a signal start from Lightning's handlers again
    (``_preemption_worker`` trains two more)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    _user_fits(rank, os.path.join(root, "user"))
    _fourier_fits(rank, os.path.join(root, "fourier"))
    _uneven_fit(rank, os.path.join(root, "uneven"))
    _preemption_fits(rank, os.path.join(root, "preempt"))
    _signal_in_agreement_fit(rank, os.path.join(root, "agreement"))
    leave_rank()


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
