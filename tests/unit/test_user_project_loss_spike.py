"""lit_dtrain's ``LossSpikeMonitor`` in a Lightning project of a user's own (see
test_callbacks_in_foreign_projects.py): batches whose ``index`` holds no integer sample indices, and ``skip`` with a
plain DataLoader whose one batch is the whole dataset."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.unit._user_project_helpers import DictBatchModule, IndexedDataset, regression_data


class IdDataset(torch.utils.data.Dataset):
    """Dict samples ``{"x", "y", "index"}`` whose ``index`` is the user's own id: a string, or a float."""

    def __init__(self, kind: str) -> None:
        self.data, self.kind = regression_data().dataset, kind

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x, y = self.data[i]
        return {"x": x, "y": y, "index": f"sample-{i}" if self.kind == "str" else float(i)}


@pytest.mark.parametrize("kind", ["str", "float"])
def test_loss_spike_monitor_names_an_index_that_holds_no_integer_sample_indices(tmp_path: Path, kind: str) -> None:
    """A user's batch whose ``index`` holds string ids failed in ``torch.as_tensor`` ("too many dimensions 'str'"),
    with ``log`` alone too, and float values were truncated into exclusions. ``skip`` now says what ``index`` must
    hold before the first step trains; ``log`` ignores such an index and still records the spikes."""
    data = DataLoader(IdDataset(kind), batch_size=8)
    module = DictBatchModule()
    skip = LossSpikeMonitor(actions=["log", "skip"], path=str(tmp_path / "skip.jsonl"))
    got = "list of str" if kind == "str" else "torch.float64 values"
    with pytest.raises(TypeError, match=rf"needs the batch key 'index' to hold integer sample indices.*got {got}\."):
        L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[skip]).fit(module, data)
    assert module.steps_run == 0
    log = LossSpikeMonitor(actions=["log"], warmup_steps=3, z_threshold=1.0, rel_threshold=None,
                           path=str(tmp_path / "log.jsonl"))
    L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[log]).fit(DictBatchModule(), data)
    assert log.num_spikes > 0 and [e["index"] for e in log.events if "index" in e] == [[]] * log.num_spikes


class SpikeAtStep(DictBatchModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (100.0 if self.global_step == 6 else 1.0)


def test_loss_spike_skip_with_a_plain_dataloader_refuses_to_exclude_every_sample(tmp_path: Path) -> None:
    """Without a sampler, a later step whose batch holds an excluded index is skipped. A spike in a full-batch
    DataLoader excluded every sample, and every later step was skipped: the run trained nothing more and ended as if
    it had trained. Now the exclusion raises, naming it (as a sampler with exclude() does), after the spike is
    recorded."""
    data = DataLoader(IndexedDataset(), batch_size=64, shuffle=True)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    module = SpikeAtStep()
    trainer = L.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    with pytest.raises(RuntimeError, match=r"spike at step 6 failed .*every sample of the train DataLoader's dataset "
                                           r"that its epochs draw \(64, indices 0..63\) has been excluded"):
        trainer.fit(module, data)
    assert [e["step"] for e in monitor.events] == [6] and sorted(monitor.events[0]["index"]) == list(range(64))
