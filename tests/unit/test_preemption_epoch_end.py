"""PreemptionCheckpoint and a signal during the validation that ends an epoch, in a project of one's own with a plain
map-style DataLoader: saved at that validation's end, the epoch's boundary, which Lightning resumes exactly. It was
saved one step later, mid-epoch, which a plain DataLoader does not resume exactly (Lightning restarts it from its
first batch): the resumed fit ended 0.013 off the straight one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import PreemptionCheckpoint, WSDScheduler
from tests.toys import TinyMLP


class Own(TinyMLP):
    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


class SigtermInValidation(L.Callback):
    """SIGTERM at the first batch of the validation after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def fit(root: Path, callbacks: list, ckpt_path=None, accumulate: int = 1, **limits) -> tuple[L.Trainer, Own]:
    """8 optimizer steps an epoch, validated after steps 4 and 8 of each (``val_check_interval=0.5``)."""
    module, wsd = Own(), WSDScheduler(warmup_steps=2, decay_fraction=0.4)
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[wsd, *callbacks],
                        limit_train_batches=8 * accumulate, val_check_interval=0.5, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root), **limits)
    trainer.fit(module, DataLoader(_data(256, 0), batch_size=4), DataLoader(_data(8, 1), batch_size=8),
                ckpt_path=ckpt_path)
    return trainer, module


def _weights(module: Own) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize(("accumulate", "limits"), [(1, {"max_epochs": 3}), (2, {"max_epochs": 3}),
                                                     (1, {"max_steps": 24, "max_epochs": -1})])
def test_a_sigterm_in_the_validation_that_ends_an_epoch_saves_there_and_resumes_exactly(tmp_path, accumulate, limits):
    _, straight = fit(tmp_path / "straight", [], accumulate=accumulate, **limits)
    preemption = PreemptionCheckpoint(str(tmp_path / "ckpt"))
    with pytest.raises(SIGTERMException):
        fit(tmp_path / "stopped", [preemption, SigtermInValidation(8)], accumulate=accumulate, **limits)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert preemption.saved_step == saved["global_step"] == 8  # (was 9: the next epoch's first step)
    assert saved["epoch"] == 0
    resumed_trainer, resumed = fit(tmp_path / "resumed", [PreemptionCheckpoint(str(tmp_path / "ckpt"))],
                                   ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), accumulate=accumulate, **limits)
    assert resumed_trainer.global_step == 24
    assert torch.equal(_weights(resumed), _weights(straight))  # (0.013 off before)


def test_a_sigterm_in_a_validation_mid_epoch_or_in_the_last_one_keeps_its_save_point(tmp_path: Path) -> None:
    """Mid-epoch (after step 4) the save stays at the next step's end: a save at that validation's end is mid-epoch
    too, no more exact to resume. In the fit's last validation no step follows: nothing is saved, the fit ends."""
    preemption = PreemptionCheckpoint(str(tmp_path / "mid"))
    with pytest.raises(SIGTERMException):
        fit(tmp_path / "mid", [preemption, SigtermInValidation(4)], max_epochs=3)
    assert preemption.saved_step == 5
    last = PreemptionCheckpoint(str(tmp_path / "last"))
    trainer, _ = fit(tmp_path / "last", [last, SigtermInValidation(24)], max_epochs=3)
    assert trainer.global_step == 24 and last.signalled and last.saved_step is None
    assert not (tmp_path / "last" / "last.ckpt").exists()
