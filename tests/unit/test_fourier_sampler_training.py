"""FourierSampler under Lightning: micro-batch scoring, exact resume through a trainer checkpoint, the stage lr."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import open_dict

from lit_dtrain.callbacks import FourierSamplerCallback
from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.train import train
from tests.unit._fourier_helpers import FOURIER, _LrRecorder, make


class _RecordingSampler(FourierSampler):
    """A FourierSampler that records the (first index, step) of every observe()."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[int, int]] = []

    def observe(self, token_loss, index, step):
        self.seen.append((int(index[0]), step))
        return super().observe(token_loss, index, step)


class _IndexData(L.LightningDataModule):
    """Batches ``{"index": [i]}`` for i in range(epoch_length), one epoch after another, and a recording sampler."""

    def __init__(self, epoch_length: int = 64) -> None:
        super().__init__()
        self.epoch_length = epoch_length
        self.sampler = _RecordingSampler(step_unit=1)
        self.sampler.setup(64, seed=0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([{"index": torch.tensor([i])} for i in range(self.epoch_length)],
                                           batch_size=None)


class _TokenLossModule(L.LightningModule):
    """A plain module returning loss, token_loss and index; ``training_step`` returns None (Lightning's way to skip a
    batch) at the batch indices ``skip``."""

    def __init__(self, skip: tuple[int, ...] = (), lr: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.skip, self.lr = skip, lr

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        token_loss = self.w * torch.linspace(1, 2, 16)[None]
        return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize(("accumulate", "epoch_length"), [(1, 64), (3, 64), (2, 5)])
def test_every_micro_batch_is_scored_at_its_own_optimizer_step(accumulate, epoch_length):
    """Stage and mix boundaries fall on the right step: observe() gets the optimizer step the micro-batch belongs
    to (at batch end Lightning has already advanced global_step after the last micro-batch, not the others). With 5
    batches an epoch and accumulate 2, Lightning steps after the epoch's lone 5th batch: that is step 2's only one."""
    data = _IndexData(epoch_length)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, accumulate_grad_batches=accumulate, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FourierSamplerCallback()])
    trainer.fit(_TokenLossModule(), datamodule=data)
    seen = data.sampler.seen
    if epoch_length == 5:
        assert seen == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (0, 3), (1, 3)]
        return
    assert [step for _, step in seen] == [i // accumulate for i in range(4 * accumulate)]
    assert [i for i, _ in seen] == list(range(4 * accumulate))


def _events(run_dir: Path, steps: bool = False) -> dict:
    """Each TensorBoard tag's values (with ``steps``: its steps) in the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import event_files

    tags = {}
    for f in event_files(run_dir):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags[tag] = [e.step if steps else e.value for e in acc.Scalars(tag)]
    return tags


@pytest.mark.parametrize("lag", [0, 1])
def test_exact_resume_through_trainer_checkpoint(tiny_cfg, lag):
    n = 5
    common = FOURIER + ["trainer.val_check_interval=5", f"data.sampler.lag={lag}"]
    _, straight = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", run="straight"))
    _, first = train(tiny_cfg(*common, f"trainer.max_steps={n}", run="split"))
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    _, resumed = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", f"ckpt_path={ckpt}", run="split"))
    a, b = straight["datamodule"].sampler, resumed["datamodule"].sampler
    assert isinstance(a, FourierSampler) and a.updates == b.updates == 2 * n - lag
    assert len(a._pending) == len(b._pending) == lag  # lag=1: the last step's update, saved unapplied
    if lag:
        assert torch.equal(a._pending[0].records(), b._pending[0].records())
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert int((a.visits > 0).sum()) > 0
    assert torch.equal(a.probabilities(2 * n), b.probabilities(2 * n))
    assert torch.equal(a.global_batch(2 * n, 8), b.global_batch(2 * n, 8))
    wa, wb = straight["module"].model.state_dict(), resumed["module"].model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    logged = _events(Path(straight["trainer"].default_root_dir))
    for tag in ("fourier/mix", "fourier/bands", "fourier/prob_entropy", "fourier/top_band_energy"):
        assert tag in logged, tag
    assert logged["fourier/bands"][0] == 4.0 and logged["fourier/bands"][-1] == 8.0
    assert logged["fourier/prob_entropy"][-1] <= math.log(straight["datamodule"].num_train_samples) + 1e-6
    steps = _events(Path(straight["trainer"].default_root_dir), steps=True)  # lag=1: the last one at train end
    assert steps["fourier/top_band_energy"] == steps["fourier/mix"] == list(range(2 * n))


def test_stage_lr_multiplier_is_applied_inside_the_step(tiny_cfg):
    cfg = tiny_cfg(*FOURIER, "trainer.max_steps=10", "trainer.val_check_interval=10", "scheduler.warmup_steps=0")
    with open_dict(cfg):
        cfg.callbacks["lr_recorder"] = {"_target_": f"{__name__}._LrRecorder"}
    _, objects = train(cfg)
    rec = next(c for c in objects["trainer"].callbacks if isinstance(c, _LrRecorder))
    lr = cfg.optimizer.lr
    expected = [lr * (0.1 if s < 2 else 0.5 if s < 8 else 1.0) for s in range(10)]
    assert rec.used == pytest.approx(expected)
    assert rec.after == pytest.approx([lr] * 10)  # the scheduler's LR is restored after every update


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_batch_the_module_skips_is_left_out(accumulate):
    """``training_step`` returning None is Lightning's way to skip a batch (it passes ``{}`` to on_train_batch_end);
    the callback raised StepOutputError ("got keys []") there and stopped the run. It now leaves such a batch out and
    observes the others."""
    data = _IndexData()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=accumulate, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FourierSamplerCallback()])
    trainer.fit(_TokenLossModule(skip=(2, 3) if accumulate == 1 else (2,), lr=0.1), datamodule=data)
    if accumulate == 1:  # steps 2 and 3 are skipped whole
        assert data.sampler.seen == [(0, 0), (1, 1), (4, 4)]
    else:  # step 1 keeps its second micro-batch
        assert data.sampler.seen == [(0, 0), (1, 0), (3, 1), (4, 2), (5, 2), (6, 3), (7, 3), (8, 4), (9, 4)]


def test_gradient_accumulation_over_more_than_two_micro_batches_trains(tiny_cfg):
    """The sampler's check for a missing callback (no update by micro-step 2) fired under accumulate_grad_batches=3:
    the first optimizer step, and with it the first update, ends after micro-step 2 is drawn. With the callback
    attached the check is off, and every micro-batch is learned from."""
    cfg = tiny_cfg(*FOURIER, "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.accumulate_grad_batches=3")
    _, objects = train(cfg)
    assert objects["trainer"].global_step == 3
    assert objects["datamodule"].sampler.updates == 9


def test_the_missing_callback_check_still_fires_without_a_feeder():
    s = make()
    s.expect_updates()  # a feeder is attached: updates arrive at its optimizer steps
    s.global_batch(5, 4)
    with pytest.raises(RuntimeError, match="fourier_sampler"):
        make().global_batch(2, 4)
