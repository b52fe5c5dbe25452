"""lit_dtrain's callbacks under Lightning's Trainer modes and entry points in a project of one's own: a second
``trainer.fit`` of the same Trainer on another datamodule (staged training). ``fast_dev_run`` is tested beside each
callback (``test_model_checkpoint.py``, ``test_wsd_trainer_horizon.py``), ``trainer.test()``/``predict()`` in
``test_throughput.py``."""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lit_dtrain.callbacks import LossSpikeMonitor


class Indexed(Dataset):
    """32 regression samples as dict batches with their ``index``; ``seed`` picks other data."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(32, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True), "index": i}


class Data(L.LightningDataModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(self.seed), batch_size=4)


class Spiking(L.LightningModule):
    """A linear regression whose loss is 30x on a batch that holds a sample of ``spike`` (the first data's 13)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.spike, self.indices = torch.nn.Linear(4, 1), {13}, []

    def training_step(self, batch, batch_idx):
        self.indices.append(batch["index"].tolist())
        loss = F.mse_loss(self.net(batch["x"]), batch["y"])
        return loss * 30 if self.spike & set(batch["index"].tolist()) else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _staged(tmp_path, second_data, clear: bool = False) -> tuple[LossSpikeMonitor, list[str]]:
    """Fit 8 steps on Data(0) (the batch of samples 12..15 spikes at step 3 and is excluded), then 8 more of the same
    Trainer on ``second_data`` without a spike; the monitor and the warnings of the second fit."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=str(tmp_path))
    module, first = Spiking(), Data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=first)
    assert monitor.excluded == [12, 13, 14, 15]
    module.spike = set()
    if clear:
        monitor.excluded.clear()
    trainer.fit_loop.epoch_loop.max_steps = 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=first if second_data is None else second_data)
    return monitor, [str(w.message) for w in caught if "LossSpikeMonitor: this fit" in str(w.message)]


def test_exclusions_cleared_between_two_fits_are_not_skipped(tmp_path):
    """monitor.excluded.clear() between two fits of the same Trainer (staged training on other data): the second fit
    still skipped its step 11, whose batch held indices 12..15 (the device copy of the exclusions was kept)."""
    monitor, _ = _staged(tmp_path, Data(7), clear=True)
    assert monitor.excluded == [] and [e["step"] for e in monitor.events] == [3]


def test_a_second_fit_on_another_datamodule_is_told_its_exclusions_name_other_samples(tmp_path):
    """Staged training: the same Trainer fitted on a second datamodule skipped its step 11, whose batch held indices
    12..15, because samples 12..15 of the first data had spiked (an 'excluded_sample' event, no word). It still
    skips them (the indices may be the same data's), and says so, naming the indices and how to start afresh."""
    monitor, said = _staged(tmp_path / "other", Data(7))
    assert [e["step"] for e in monitor.events if e["reasons"] == ["excluded_sample"]] == [11]
    assert len(said) == 1 and "another Data than the previous fit" in said[0] and "[12, 13, 14, 15]" in said[0]
    assert "monitor.excluded.clear()" in said[0]
    monitor, said = _staged(tmp_path / "cleared", Data(7), clear=True)  # the way out it names: nothing to say
    assert said == []
    monitor, said = _staged(tmp_path / "same", None)  # the same datamodule again: its own samples, no warning
    assert said == [] and [e["step"] for e in monitor.events if e["reasons"] == ["excluded_sample"]] == [11]
