"""``trainer.max_time`` stops a run at the end of an optimizer step, not in the middle of its accumulation: with
``accumulate_grad_batches=4`` Lightning's ``Timer`` stopped one at micro-batch 37 of step 9; ``last.ckpt`` threw
micro-batch 37 away and the resumed run's first step was one micro-batch short."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import pytest
import torch


class _SlowFirstBatch(L.Callback):
    """Uses up ``trainer.max_time=00:00:00:01`` in the first micro-batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 0:
            time.sleep(1.0)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_max_time_stop_lands_on_an_optimizer_steps_end(tiny_cfg, accumulate):
    from lit_dtrain.train import train

    cfg = tiny_cfg(f"trainer.accumulate_grad_batches={accumulate}", "+trainer.max_time=00:00:00:01",
                   "sample.max_new_tokens=0",
                   "+callbacks.slow._target_=tests.unit.test_max_time_step_end._SlowFirstBatch")
    metrics, _ = train(cfg)
    assert metrics["stopped"] == "max_time" and metrics["steps"] == 1  # (Lightning's Timer: step 0 with 3)
    ckpt = torch.load(Path(cfg.paths.checkpoint_dir) / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 1 and ckpt["LMDataModule"]["micro_step"] == accumulate  # whole step, none thrown
