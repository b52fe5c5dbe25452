"""Lightning's ``LearningRateFinder`` callback (the search runs inside the fit, at fit start, without the Trainer's
other callbacks, and restores the fit's start after it) beside lit_dtrain's callbacks in a project of one's own."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateFinder

from lit_dtrain.callbacks import FourierSamplerCallback, LossSpikeMonitor, WSDScheduler
from tests.unit._user_project_helpers import UpdateLRs, UserLM, UserModule, lm_data, regression_data


class Tunable(UserLM):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(per_token=True)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), self.lr)


def _fit(tmp_path: Path, callbacks, module, data=None, **kwargs) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if data is None:
            trainer.fit(module, regression_data(n=256))
        else:
            trainer.fit(module, datamodule=data)
    return trainer


def test_wsd_schedules_the_lr_the_finder_suggests(tmp_path: Path):
    """The finder sets the suggested LR in the optimizer before ``WSDScheduler`` reads its peaks (Lightning runs the
    tuner callbacks first): every step's LR is the suggestion times the schedule's factor."""
    module, wsd, record = UserModule(), WSDScheduler(warmup_steps=2, decay_fraction=0.3), UpdateLRs()
    module.lr = 1e-2
    module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), module.lr)
    finder = LearningRateFinder(num_training_steps=20, early_stop_threshold=None)
    trainer = _fit(tmp_path, [wsd, finder, record], module, max_epochs=2, limit_train_batches=24)
    assert module.lr != 1e-2 and wsd.base_lrs == [[module.lr]] and wsd.total_steps == trainer.global_step == 48
    assert record.used[0] == [module.lr * wsd.lr_factor(k) for k in range(48)]


def test_the_finder_on_a_fourier_sampler_is_named_and_require_updates_false_fits_as_at_its_lr(tmp_path: Path):
    """The search trains without ``FourierSamplerCallback``, so the sampler stopped it at step 2 with 'never received
    a training update: add the callback', which was in the Trainer, and named only ``Tuner.lr_find``. With
    ``require_updates=False`` the search draws from the prior, the callback feeds the fit after it, and the fit ends
    bitwise as one started at the suggested LR (weights, sampler table, datamodule step)."""

    def run(root: Path, finder: bool, lr: float = 1e-2, require_updates: bool = True):
        root.mkdir()
        data = lm_data(root)
        data.sampler.require_updates = require_updates
        callbacks = [FourierSamplerCallback(), LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)]
        if finder:
            callbacks.append(LearningRateFinder(num_training_steps=15, early_stop_threshold=None))
        module = Tunable(lr)
        _fit(root, callbacks, module, data, max_steps=8)
        return module, data

    with pytest.raises(RuntimeError, match=r"never received a training update.*LearningRateFinder"):
        run(tmp_path / "a", finder=True)
    tuned, data = run(tmp_path / "b", finder=True, require_updates=False)
    straight, straight_data = run(tmp_path / "c", finder=False, lr=tuned.lr, require_updates=False)
    assert tuned.lr != 1e-2 and data.micro_step == straight_data.micro_step == 8
    assert all(torch.equal(a, b) for a, b in zip(tuned.parameters(), straight.parameters()))
    table, straight_table = data.sampler.state_dict(), straight_data.sampler.state_dict()
    assert table["updates"] == straight_table["updates"] == 8
    assert torch.equal(torch.as_tensor(table["visits"]), torch.as_tensor(straight_table["visits"]))
