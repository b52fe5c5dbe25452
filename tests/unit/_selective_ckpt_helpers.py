"""Helpers shared by test_selective_checkpointing*.py: a small Llama, its loss and gradients, and a Lightning fit of
a module with callbacks, and the budget probe on measurements of known bytes."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lit_dtrain.callbacks._checkpoint_budget as budget
from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe
from lit_dtrain.callbacks._checkpoint_policies import BlockProfile, apply_checkpointing, estimate_peak, uniform_plan
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


RETAINED = {"none": 10.0, "selective": 5.0, "full": 1.0}  # bytes one block keeps after its forward, per mode


def fake_measurements(monkeypatch, wrappers, overshoot, retained=RETAINED) -> None:
    """The probe's measurements replaced: 4 blocks whose measured bytes are ``retained`` (a verified plan's peak: its
    estimate plus ``overshoot(plan)``), ``full`` costing 4 s and ``selective`` 1 s a block; the plan is read from
    ``wrappers()``."""
    profiles = [BlockProfile(retained=dict(retained))] * 4

    def measure(step, root, modules=()):
        plan = [w.mode for w in wrappers()]
        peak = estimate_peak(profiles, plan, 0.0)
        if modules:  # a uniform pass
            return SimpleNamespace(max_act=peak, retained=[retained[plan[0]]] * 4, calls=[1] * 4)
        return SimpleNamespace(max_act=peak + overshoot(plan))

    monkeypatch.setattr(budget, "measure_activation_memory", measure)
    monkeypatch.setattr(budget, "time_block_ops", lambda fn, blocks, policy: ([4.0] * 4, [1.0] * 4))


def fake_probe(monkeypatch, overshoot, memory_budget, retained=RETAINED, **kwargs):
    """The probe of :func:`fake_measurements`'s 4 blocks; returns ``(plan, report, wrappers)``."""
    blocks = [torch.nn.Linear(2, 2) for _ in range(4)]
    wrappers = apply_checkpointing(blocks, uniform_plan(4, "none"))
    fake_measurements(monkeypatch, lambda: wrappers, overshoot, retained)
    root = torch.nn.Sequential(*blocks)
    plan, report = budget_plan_from_probe(lambda: root(torch.ones(1, 2)).sum(), root, blocks, wrappers,
                                          memory_budget, **kwargs)
    return plan, report, wrappers
