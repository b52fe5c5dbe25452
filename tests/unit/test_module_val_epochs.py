"""Each validation's ``val/loss`` and ``val/<source>/loss`` are the token means of that validation's windows alone:
the metrics start again at every validation, and each source's windows count in its own metric."""

from __future__ import annotations

import functools

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_dtrain.data import window_batch
from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM, token_loss
from lit_dtrain.optim import adamw


def windows(seed: int, n: int) -> list[dict]:
    w = torch.randint(0, 257, (n, 17), generator=torch.Generator().manual_seed(seed))
    return [window_batch(w[i : i + 2], torch.arange(i, i + 2)) for i in range(0, n, 2)]


def mean_loss(lit: LitLLM, *loaders: list[dict]) -> float:
    with torch.no_grad():
        losses = [token_loss(lit.model(b["input_ids"]), b["labels"]) for batches in loaders for b in batches]
    return float(torch.cat([x.reshape(-1) for x in losses]).double().mean())


def test_each_validation_reports_its_own_windows_per_source_and_in_all():
    torch.manual_seed(0)
    lit = LitLLM(build_llama(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16),
                 optimizer=functools.partial(adamw, lr=1e-2), val_names=["a", "b"])
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    for a, b in ((windows(1, 4), windows(2, 6)), (windows(3, 2), windows(4, 8))):
        trainer.validate(lit, dataloaders=[DataLoader(a, batch_size=None), DataLoader(b, batch_size=None)],
                         verbose=False)
        got = {k: float(v) for k, v in trainer.callback_metrics.items()}
        assert abs(got["val/a/loss"] - mean_loss(lit, a)) < 1e-5
        assert abs(got["val/b/loss"] - mean_loss(lit, b)) < 1e-5
        assert abs(got["val/loss"] - mean_loss(lit, a, b)) < 1e-5
        assert abs(mean_loss(lit, a) - mean_loss(lit, b)) > 1e-4  # (the sources' means differ)
