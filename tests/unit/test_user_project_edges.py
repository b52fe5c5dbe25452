"""lit_dtrain's callbacks at the edges of a user's own Lightning project: a ``PreemptionCheckpoint`` stop while the
module accumulates gradients by hand, a ``WSDScheduler`` whose decay lies past the trainer's last step. Each test
checks the result (the resumed weights, the warning's words), not only that the run finished."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_dtrain.callbacks import PreemptionCheckpoint
from tests.unit.test_callbacks_in_foreign_projects import UserModule, regression_data


class SigtermAtBatch(L.Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx, self.sent = batch_idx, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(tmp_path: Path, callbacks, ckpt_path=None) -> tuple[UserModule, L.Trainer]:
    module = UserModule(manual=True, step_every=4)  # 8 batches an epoch: updates at batches 3 and 7
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, regression_data(), ckpt_path=ckpt_path)
    return module, trainer


def test_a_sigterm_between_manual_accumulation_steps_saves_after_the_step_that_takes_the_grads(tmp_path: Path):
    """A module that accumulates by hand (``manual_backward`` every batch, ``step()`` every 4th) gets SIGTERM at batch
    5, mid-window. The save waits for batch 7's update: the file is at step 2, and a resume from it ends with the
    straight run's weights. It saved at batch 5 (step 1) before: the grads of batches 4 and 5 were lost and the resumed
    update at batch 7 had only those of batches 6 and 7 (max weight difference 0.043 after 4 updates)."""
    straight, _ = _fit(tmp_path / "a", [])
    stop = PreemptionCheckpoint(dirpath=str(tmp_path / "ck"))
    try:
        _fit(tmp_path / "b", [SigtermAtBatch(5), stop])
        raise AssertionError("the SIGTERM did not stop the fit")
    except SIGTERMException:
        pass
    assert stop.saved_step == 2
    resumed, trainer = _fit(tmp_path / "c", [], ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert trainer.global_step == 4 and resumed.steps_run == 8  # the second epoch only
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
