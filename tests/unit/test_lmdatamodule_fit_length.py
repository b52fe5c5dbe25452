"""A fit on ``LMDataModule`` must end: its training stream is endless, so an epoch never ends."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.data import CorpusSource, LMDataModule
from lit_dtrain.errors import ConfigError


class _Bigram(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(257, 257)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        if self.steps > 20:  # without the check, Trainer(max_epochs=1) never stopped
            raise RuntimeError("trained past 20 steps: the fit does not end")
        logits = self.logits(batch["input_ids"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, corpus: Path, **trainer_kwargs) -> _Bigram:
    data = LMDataModule([CorpusSource(name="t", kind="files", paths=[str(corpus)])], block_size=16, batch_size=2,
                        cache_dir=str(tmp_path / "cache"), progress=False)
    module = _Bigram()
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, **trainer_kwargs)
    trainer.fit(module, datamodule=data)
    return module


@pytest.mark.parametrize("kwargs", [{"max_epochs": 1}, {}])
def test_a_trainer_without_max_steps_is_refused_before_the_first_step(tmp_path: Path, corpus: Path, kwargs) -> None:
    with pytest.raises(ConfigError, match=r"LMDataModule draws training batches by step, so an epoch never ends, .*"
                                          r"would train forever: give Trainer\(max_steps=N\)"):
        _fit(tmp_path, corpus, **kwargs)


@pytest.mark.parametrize("kwargs", [{"max_steps": 3}, {"max_epochs": 1, "limit_train_batches": 3}])
def test_trainers_whose_fit_ends_train(tmp_path: Path, corpus: Path, kwargs) -> None:
    assert _fit(tmp_path, corpus, **kwargs).steps == 3


def test_the_tuner_runs_on_a_trainer_without_max_steps(tmp_path: Path, corpus: Path) -> None:
    """Tuner.lr_find (and scale_batch_size) sets max_steps for its search, then remakes the train DataLoader with the
    Trainer's own max_steps=-1 back: the check, made there, refused 'Tuner(Trainer()).lr_find(...)' after its search
    (a pattern that fits with a Trainer of its own afterwards), losing the result. The check is at the first batch."""
    from lightning.pytorch.tuner import Tuner

    data = LMDataModule([CorpusSource(name="t", kind="files", paths=[str(corpus)])], block_size=16, batch_size=2,
                        cache_dir=str(tmp_path / "cache"), progress=False)
    module = _Bigram()
    module.lr = 0.1
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp_path))
    finder = Tuner(trainer).lr_find(module, datamodule=data, num_training=4, update_attr=False)
    assert len(finder.results["lr"]) == 4 and module.steps == 4
