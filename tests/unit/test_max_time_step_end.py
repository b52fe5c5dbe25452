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


def test_the_training_time_of_lightnings_timer_carries_over_a_resume():
    """A ``last.ckpt`` written by Lightning's ``Timer`` (lit_dtrain before ``StepEndTimer``, or a project's
    ``Trainer(max_time=...)``) holds its time under "Timer": a run that used up 4 s resumed from 0 s and trained on."""
    from lightning.pytorch.callbacks import Timer
    from lightning.pytorch.trainer import call

    from lit_dtrain.train_callbacks import StepEndTimer

    lightnings = L.Trainer(max_time="00:00:00:04", logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False)
    lightnings_timer = next(c for c in lightnings.callbacks if isinstance(c, Timer))
    lightnings_timer._offset = 11.0  # as loaded from a checkpoint of 11 s of training
    written = {"callbacks": call._call_callbacks_state_dict(lightnings)}

    ours = StepEndTimer(duration="00:00:00:04", interval="step")
    trainer = L.Trainer(callbacks=[ours], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    call._call_callbacks_load_state_dict(trainer, written)
    assert ours.time_elapsed("train") == 11.0 and ours.time_remaining() < 0  # (was 0.0 and 4.0: trained on)
    back = {"callbacks": call._call_callbacks_state_dict(trainer)}  # and an older lit_dtrain reads ours
    lightnings_timer._offset = 0
    call._call_callbacks_load_state_dict(lightnings, back)
    assert lightnings_timer.time_elapsed("train") == 11.0
    ours._offset = 0  # and one of lit_dtrain's checkpoints that held it under "StepEndTimer" (299c398 on)
    ours.on_load_checkpoint(trainer, None, {"callbacks": {"StepEndTimer": {"time_elapsed": {"train": 7.0}}}})
    assert ours.time_elapsed("train") == 7.0
