"""Helpers shared by the tests of LitLLM (test_module*.py): a tiny LitLLM, batches of random windows and a short
fit that returns the CSV logger's rows."""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lit_dtrain.data import window_batch
from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM
from lit_dtrain.optim import adamw


def tiny_lit(**kw) -> LitLLM:
    torch.manual_seed(0)
    model = build_llama(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
    return LitLLM(model, optimizer=functools.partial(adamw, lr=1e-2), **kw)


def window_loader(n_batches: int, batch_size: int = 2, seq: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 257, (n_batches * batch_size, seq + 1), generator=g)
    return [
        window_batch(windows[i : i + batch_size], torch.arange(i, i + batch_size))
        for i in range(0, len(windows), batch_size)
    ]


def fit(module: LitLLM, tmp_path: Path, steps: int, accumulate: int, callbacks=(), **trainer_kw) -> list[dict]:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"log_every_n_steps": 1, **trainer_kw},
    )
    trainer.fit(module, train_dataloaders=DataLoader(window_loader(steps * accumulate), batch_size=None))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))
