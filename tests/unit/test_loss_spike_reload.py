"""``LossSpikeMonitor`` beside ``Trainer(reload_dataloaders_every_n_epochs=1)``: the dataset's length that its "every
sample excluded" check compares with is the reloaded loader's, not the one at train start."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.unit.test_user_project_edges import SpikesAt6And7


class Growing(SpikesAt6And7):
    """8 samples more each epoch (batches of 4, in order): 8, 16, 24, ...; spikes at steps 6 and 7 (epoch 2)."""

    def train_dataloader(self):
        n = 8 * (self.trainer.current_epoch + 1)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
        return DataLoader([{"x": x[i], "y": y[i], "index": torch.tensor(i)} for i in range(n)], batch_size=4)


def test_a_reloaded_larger_dataset_is_counted_by_its_new_length(tmp_path: Path) -> None:
    """The spikes at steps 6 and 7 exclude samples 0..7 of the 24 that epoch 2 draws. The length taken at train start
    (8) made that 'every sample ... (8, indices 0..7) has been excluded', a RuntimeError at step 8; the run now trains
    on to max_steps, skipping only the steps whose batch holds an excluded sample."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", max_steps=20, reload_dataloaders_every_n_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[monitor])
    trainer.fit(Growing())
    assert trainer.global_step == 20 and sorted(monitor.excluded) == list(range(8))
    assert len(trainer.train_dataloader.dataset) == 32  # epoch 3 (steps 12..19), the last one trained
