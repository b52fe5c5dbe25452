"""``LitLLM`` seeds each micro-batch's forward from (run seed, step, micro-batch, rank): two micro-batches of one step,
or two ranks of one micro-batch, draw other dropout masks; the same four draw the same masks (lit_dtrain.step_rng)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import lightning as L
import torch
from torch.utils.data import DataLoader

import lit_dtrain.module as module_file
from lit_dtrain.data import window_batch
from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM
from lit_dtrain.optim import adamw


def dropout_lit() -> LitLLM:
    torch.manual_seed(0)
    model = build_llama(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16, dropout=0.5)
    return LitLLM(model, optimizer=functools.partial(adamw, lr=1e-2))


def one_batch() -> dict:
    windows = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    return window_batch(windows, torch.arange(2))


def test_each_micro_batch_of_a_step_is_seeded_with_its_own_position(monkeypatch):
    """With accumulate_grad_batches=2 the 4 forwards of 2 steps are seeded (step, micro-batch) = (0,0) (0,1) (1,0)
    (1,1); a micro index stuck at 0 gave both micro-batches of a step the same dropout masks."""
    seen = []
    real = module_file.step_seed
    monkeypatch.setattr(module_file, "step_seed", lambda *a: seen.append(a) or real(*a))
    batches = [one_batch() for _ in range(4)]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    lit = dropout_lit()
    torch.manual_seed(1234)
    trainer.fit(lit, train_dataloaders=DataLoader(batches, batch_size=None))
    assert [a[1:] for a in seen] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert {a[0] for a in seen} == {1234}  # the run's seed (train.py's seed_everything)


def test_micro_batches_and_ranks_draw_other_masks_and_the_same_position_the_same():
    lit, batch = dropout_lit(), one_batch()
    lit._draws_random, lit._run_seed = True, 1337

    def loss_at(step: int, micro: int, rank: int) -> torch.Tensor:
        lit._trainer = SimpleNamespace(global_step=step, global_rank=rank)
        lit._loss_step, lit._loss_count = (step, micro) if micro else (None, 0)
        return lit._forward_rng_of_step(batch).detach()

    first = loss_at(3, 0, 0)
    assert torch.equal(loss_at(3, 0, 0), first)  # a function of the position: a resumed run draws these again
    for other in (loss_at(3, 1, 0), loss_at(3, 0, 1), loss_at(4, 0, 0)):  # the next micro-batch, rank 1, step 4
        assert not torch.equal(other, first)
    lit._trainer = None
