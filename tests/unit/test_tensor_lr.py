"""A Tensor LR (what a compiled or capturable optimizer step is given) is set in place by every LR writer of
lit_dtrain, as torch's own LR schedulers do: the WSD callback replaced it with a float, and the per-step scaling of
``lr_cooldown`` and the FourierSampler's stages with another tensor, so a compiled step recompiled or kept reading the
old object."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import WSDScheduler
from lit_dtrain.callbacks._lr_scaling import restore_lrs, scale_lrs_for_step
from lit_dtrain.schedules.lr import wsd_lr_factor, wsd_scheduler

PEAK = 0.01
WSD = dict(total_steps=10, warmup_steps=2, decay_fraction=0.4)


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=torch.tensor(PEAK))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(40, 4), batch_size=4)


class LRProbe(L.Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        lr = optimizer.param_groups[0]["lr"]
        self.seen.append((lr, float(lr)))


def test_the_wsd_callback_fills_a_tensor_lr_in_place():
    probe = LRProbe()
    module = TinyLM()
    trainer = L.Trainer(accelerator="cpu", max_steps=10, callbacks=[WSDScheduler(**WSD), probe], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and all(seen is lr for seen, _ in probe.seen)
    expected = [PEAK * wsd_lr_factor(s, **WSD) for s in range(10)]
    assert [value for _, value in probe.seen] == pytest.approx(expected, rel=1e-6)


def test_scaling_and_the_step_scheduler_keep_the_tensor_lr_object():
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([param], lr=torch.tensor(PEAK))
    lr = opt.param_groups[0]["lr"]
    scheduler = wsd_scheduler(opt, **WSD)
    scheduler.set_step(5)  # a resume moves the schedule: the LR is set, not replaced
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(PEAK * wsd_lr_factor(5, **WSD))
    before = float(lr)
    scale_lrs_for_step(opt, 0.25)  # lr_cooldown or a FourierSampler stage, for one update
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(before * 0.25)
    param.grad = torch.ones(2)
    opt.step()  # its post-hook puts the LR back
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(before)
    scale_lrs_for_step(opt, 0.5)
    assert restore_lrs(opt) and opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(before)
