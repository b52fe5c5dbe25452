"""Helpers shared by test_selective_checkpointing*.py: a small Llama, its loss and gradients, and a Lightning fit of
a module with callbacks."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.module import LitLLM

CFG = dict(vocab_size=257, block_size=64, n_layer=4, n_head=4, n_kv_head=2, d_model=64)


def make_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**CFG))


def loss_fn(model, ids):
    return lambda: F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())


def grads(model, ids) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model, ids)().backward()
    return [p.grad.clone() for p in model.parameters()]


def token_batches(n: int, seq: int = 32, vocab: int = 257) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, vocab, (seq,), generator=g)} for _ in range(n)]
    for d in data:
        d["labels"] = torch.roll(d["input_ids"], -1)
    return DataLoader(data, batch_size=2)


def fit(module, callbacks, steps: int = 3, precision="32-true"):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, precision=precision, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, token_batches(2 * steps))
    return trainer


def lit_llm() -> LitLLM:
    return LitLLM(make_model(), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
