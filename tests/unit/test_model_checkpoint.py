"""lit_dtrain's ModelCheckpoint: last.ckpt holds the newest validation's state, not the best one's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def test_last_ckpt_is_written_at_every_validation_not_only_at_a_new_best(tiny_cfg):
    """lightning 2.6 writes last.ckpt only where the top-k checkpoint changed: with a val/loss that stopped
    improving (mode=max here: every later validation is 'worse'), a run that failed at step 5 left last.ckpt at
    step 2, the first validation, and resume=auto trained steps 2-4 again."""
    from lit_dtrain.train import train

    common = ("trainer.max_steps=6", "trainer.val_check_interval=2", "callbacks.model_checkpoint.mode=max",
              "sample.max_new_tokens=0")
    fault = ("+callbacks.fault._target_=tests.faults.RaiseOnceAt", "+callbacks.fault.hook=on_after_backward",
             "+callbacks.fault.step=5")
    cfg = tiny_cfg(*common, *fault)
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        train(cfg)
    ckpts = Path(cfg.paths.checkpoint_dir)
    best = [p for p in ckpts.iterdir() if p.name.startswith("step")]
    assert len(best) == 1 and _step(best[0]) == 2  # the top-k checkpoint did not change after step 2
    assert _step(ckpts / "last.ckpt") == 4  # the newest validation's
    metrics, _ = train(tiny_cfg(*common, "resume=auto"))
    assert metrics["steps"] == 6 and _step(ckpts / "last.ckpt") == 6


def test_it_is_lightnings_model_checkpoint_in_a_project_of_ones_own():
    from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

    from lit_dtrain.callbacks import ModelCheckpoint

    assert issubclass(ModelCheckpoint, LightningModelCheckpoint)
    assert ModelCheckpoint(save_last=True).state_key == LightningModelCheckpoint(save_last=True).state_key
