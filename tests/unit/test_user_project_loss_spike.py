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


class _Corrupt(torch.utils.data.Dataset):
    """Dict samples ``{"x", "y", "index"}``; batch 10 (samples 80-87, 8 a batch) is corrupt: inputs and targets 100x."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(160, 8, generator=g)
        self.x[80:88] *= 100.0
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "index": i}


class _BatchNormNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))
        self.at_step = {}  # global_step -> the state the step starts from

    def training_step(self, batch, batch_idx):
        self.at_step[self.trainer.global_step] = {k: v.clone() for k, v in self.state_dict().items()}
        return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2)


@pytest.mark.filterwarnings("ignore:LossSpikeMonitor. there is no datamodule")
def test_a_skipped_step_leaves_the_modules_buffers_as_they_were(tmp_path: Path) -> None:
    """``skip`` dropped the step's gradients, but its forward had already moved BatchNorm's running statistics and
    batch counter: a corrupt batch, skipped, took running_var from 0.57 to 371 (mean), and the eval-mode loss on
    held-out data from 7.16 to 8.40 (8.18 at step 20, where it is 4.90 now). The buffers are put back as well."""
    module, monitor = _BatchNormNet(), LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", max_steps=20, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(_Corrupt(), batch_size=8))
    assert [(e["step"], e["index"]) for e in monitor.events] == [(10, list(range(80, 88)))]
    before, after = module.at_step[10], module.at_step[11]
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and buffers (running_var, the counter)
    assert not torch.equal(module.at_step[9]["net.1.running_var"], before["net.1.running_var"])  # others move them


@pytest.mark.filterwarnings("ignore:LossSpikeMonitor. there is no datamodule")
def test_a_weight_average_listed_first_takes_in_no_buffers_of_a_skipped_step(tmp_path: Path) -> None:
    """Lightning's EMAWeightAveraging (which averages buffers too) updates at batch end: listed before the monitor, it
    took in the skipped batch's running_var before the monitor put it back (185.6 where the other order has 0.58).
    The buffers are put back before the optimizer step now, in either order."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    averages = []
    for ema_first in (True, False):
        monitor, ema = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5), EMAWeightAveraging(decay=0.5)
        trainer = L.Trainer(accelerator="cpu", max_steps=11, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ema, monitor] if ema_first else [monitor, ema], default_root_dir=tmp_path)
        trainer.fit(_BatchNormNet(), DataLoader(_Corrupt(), batch_size=8))
        assert [e["step"] for e in monitor.events] == [10]
        averages.append(ema._average_model.module.state_dict())
    assert all(torch.equal(averages[0][k], averages[1][k]) for k in averages[1])


class _CastsItsBuffersInPlace(L.LightningModule):
    """Casts its buffers to bfloat16 in place at its first forward, as FSDP's mixed precision does in its root
    pre-forward (``_cast_buffers_to_dtype_and_device``: ``buffer.data = buffer.to(bf16)``), and sums its inputs into a
    buffer; step 0's targets are inf (a NaN loss, skipped)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
        self.register_buffer("input_sum", torch.zeros(8))
        self.cast_tensor, self.at_step = None, {}

    def training_step(self, batch, batch_idx):
        if self.cast_tensor is None:
            self.input_sum.data = self.input_sum.to(torch.bfloat16)
            self.cast_tensor = self.input_sum
        self.at_step[self.trainer.global_step] = (self.input_sum.dtype, self.input_sum.clone())
        self.input_sum.add_(batch["x"].sum(0).to(self.input_sum.dtype))
        y = torch.where(torch.tensor(self.trainer.global_step == 0), torch.inf, batch["y"])
        return torch.nn.functional.mse_loss(self.net(batch["x"]), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2)


@pytest.mark.filterwarnings("ignore:LossSpikeMonitor. there is no datamodule")
def test_a_skip_puts_buffers_back_in_the_dtype_a_cast_in_place_gave_them(tmp_path: Path) -> None:
    """The buffers copied at the step's start (float32) were set back whole where the forward had cast them in place
    (FSDP's mixed precision, bfloat16): after the skipped step 0 the module held a new float32 tensor in place of the
    one FSDP cast (which it never casts again). They are copied into the tensor the module holds now."""
    module, monitor = _CastsItsBuffersInPlace(), LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(_Corrupt(), batch_size=8))
    assert [e["step"] for e in monitor.events] == [0]
    assert module.input_sum is module.cast_tensor and module.at_step[1][0] == torch.bfloat16
    assert torch.equal(module.at_step[1][1], torch.zeros(8, dtype=torch.bfloat16))  # step 0's sum put back


class _CopiesSeen(L.Callback):
    """Listed after the monitor: the buffer copies it holds at each step's start (kept alive, so that a new copy
    cannot take a freed one's place)."""

    def __init__(self, monitor: LossSpikeMonitor) -> None:
        self.monitor, self.seen = monitor, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen[trainer.global_step] = [copy for _, _, copy in self.monitor._step_buffers]


@pytest.mark.filterwarnings("ignore:LossSpikeMonitor. there is no datamodule")
def test_a_step_writes_its_buffer_copies_over_the_last_steps(tmp_path: Path) -> None:
    """With skip, every step's start cloned every buffer: a new allocation a step (a 256 MiB buffer: 180-550 ms of CPU
    a step on 2 cores, its page faults; 35 ms for a copy into the kept tensor). The last step's copies are written over
    now, and the skip puts back the same values (BatchNorm's statistics and counter as before the spiking step)."""
    module, monitor = _BatchNormNet(), LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5)
    seen = _CopiesSeen(monitor)
    trainer = L.Trainer(accelerator="cpu", max_steps=14, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor, seen],
                        default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(_Corrupt(), batch_size=8))
    assert [e["step"] for e in monitor.events] == [10]
    assert len(seen.seen[0]) == 3  # running_mean, running_var, num_batches_tracked
    for first, last in ((0, 10), (11, 13)):  # new copies after the restore at step 10 (one may now be a buffer)
        assert all(all(a is b for a, b in zip(seen.seen[first], seen.seen[s])) for s in range(first, last + 1))
    assert all(torch.equal(module.at_step[10][k], module.at_step[11][k]) for k in module.at_step[10])
    assert monitor._buffer_copies is None  # released at the fit's end


def test_a_buffer_copy_that_became_the_buffer_is_not_written_over() -> None:
    """A buffer that the module replaced by another shape is set back whole by restore_buffers: the copy is then the
    buffer itself, and writing the next step's copy into it would copy the buffer onto itself (no value kept)."""
    from lit_dtrain.callbacks._spike_step import buffer_values, restore_buffers

    net = torch.nn.BatchNorm1d(4)
    values = buffer_values(net)
    net.running_mean = torch.zeros(5)  # replaced by the step (another shape): set back whole
    restore_buffers(net, values)
    assert net.running_mean is values[0][2]
    again = buffer_values(net, values)
    assert again[0][2] is not net.running_mean and torch.equal(again[0][2], net.running_mean)
    assert again[1][2] is values[1][2]  # running_var's copy is written over
    net.running_mean.add_(1.0)
    assert torch.equal(again[0][2], torch.zeros(4))


class _NestedBufferNet(_BatchNormNet):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ragged", torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)]))


@pytest.mark.filterwarnings("ignore:LossSpikeMonitor. there is no datamodule", "ignore:The PyTorch API of nested")
def test_a_nested_buffer_is_copied_and_put_back_whole(tmp_path: Path) -> None:
    """A nested tensor has no sizes: the check whether last step's copy fits raised at every step from the second
    ('RuntimeError: Internal error: NestedTensorImpl doesn't support sizes'), and the skip's restore at a spike."""
    module, monitor = _NestedBufferNet(), LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5)
    trainer = L.Trainer(accelerator="cpu", max_steps=14, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor],
                        default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(_Corrupt(), batch_size=8))
    assert [e["step"] for e in monitor.events] == [10]
    assert [t.tolist() for t in module.ragged.unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
    assert torch.equal(module.at_step[10]["net.1.running_var"], module.at_step[11]["net.1.running_var"])
