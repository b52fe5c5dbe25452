"""A SIGTERM after a non-finite update: AtomicCheckpointIO does not write the NaN weights, and PreemptionCheckpoint's
line says so and names the checkpoint a resume continues. It said 'saved <path> at step N' of a file never written."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_dtrain.callbacks import PreemptionCheckpoint
from lit_dtrain.checkpoint import AtomicCheckpointIO
from tests.unit.test_preemption import Own


class NanWeightsThenSigterm(L.Callback):
    """Save a finite ``step2.ckpt`` after step 2; make the weights NaN in step 4 and send SIGTERM during it."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and not (self.dirpath / "step2.ckpt").exists():
            trainer.save_checkpoint(self.dirpath / "step2.ckpt")
        if trainer.global_step == 4:
            with torch.no_grad():
                pl_module.net[0].weight.fill_(float("nan"))
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("hint", [None, "resume=auto"])
def test_a_sigterm_save_of_nan_weights_says_none_was_saved_and_what_resumes(tmp_path: Path, caplog, hint) -> None:
    module = Own()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=24, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        plugins=[AtomicCheckpointIO(n for n, _ in module.named_parameters())],
                        callbacks=[NanWeightsThenSigterm(tmp_path),
                                   PreemptionCheckpoint(dirpath=str(tmp_path), resume_hint=hint)])
    with caplog.at_level("INFO"), pytest.raises(SIGTERMException):
        trainer.fit(module)
    assert not (tmp_path / "last.ckpt").exists()
    assert "SIGTERM received: saved" not in caplog.text
    assert "SIGTERM received: no checkpoint saved at step 4 (its weights are not finite: see the warning above); " \
           f"exiting cleanly. The newest finite checkpoint is {tmp_path / 'step2.ckpt'} (step 2)" in caplog.text
    if hint is None:
        assert f"resume with trainer.fit(..., ckpt_path={str(tmp_path / 'step2.ckpt')!r})" in caplog.text
    else:
        assert "which resume=auto continues: resume with resume=auto" in caplog.text
