"""Helpers shared by the test_fourier_sampler_*.py files."""

from __future__ import annotations

import lightning as L
import torch

from lit_dtrain.data.samplers import FourierSampler

# ---- the sampler ---------------------------------------------------------------------------------------------


def feed(sampler: FourierSampler, steps: int, batch: int = 8, T: int = 64, start: int = 0, hot=()):
    """Draw and observe ``steps`` steps with deterministic synthetic token losses (``hot`` indices: high loss)."""
    batches = []
    for step in range(start, start + steps):
        idx = sampler.global_batch(step, batch)
        g = torch.Generator().manual_seed(step)
        loss = torch.rand(batch, T, generator=g) + idx[:, None].float() % 3
        for i, j in enumerate(idx.tolist()):
            if j in hot:
                loss[i] += 4.0
        sampler.observe(loss, idx, step + 1)
        batches.append(idx)
    return torch.stack(batches)


def make(num_samples: int = 50, seed: int = 0, **kw) -> FourierSampler:
    s = FourierSampler(**kw)
    s.setup(num_samples, seed=seed)
    return s


def _observations(steps: int, batch: int = 8, T: int = 64, n: int = 50) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed (token_loss, index) pairs, one per step, that do not depend on what a sampler draws."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(n, (batch,), generator=g)
        out.append((torch.rand(batch, T, generator=g) * (1 + idx[:, None].float() % 4), idx))
    return out


class _LrRecorder(L.Callback):
    """Records the LR that each optimizer update used (a step pre-hook registered after the sampler's)."""

    def __init__(self):
        self.used, self.after = [], []

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        opt.register_step_pre_hook(lambda o, a, k: self.used.append(o.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(trainer.optimizers[0].param_groups[0]["lr"])


FOURIER = [
    "data/sampler=fourier",
    "callbacks=[default,fourier_sampler]",
    "data.sampler.step_unit=0.4",  # stages: warmup steps 0-1 (LR x0.1), ramp 2-7 (x0.5), stable from 8
    "scheduler=constant",
    "sample.max_new_tokens=0",
    "trainer.log_every_n_steps=1",
]


# ---- stand-ins for the callback's trainer and module -----------------------------------------------------------


class _FakeTrainer:
    def __init__(self, sampler):
        self.datamodule = type("DM", (), {"sampler": sampler})()


class _Recorder:
    """A stand-in LightningModule: ``log(name, value)`` calls by the trainer's ``global_step`` at the time."""

    def __init__(self, trainer):
        self.trainer, self.logged = trainer, {}

    def log(self, name, value, **kw):
        self.logged.setdefault(self.trainer.global_step, {})[name] = value
