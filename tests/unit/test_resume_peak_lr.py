"""A resume runs at the configured peak LR, not the checkpoint's, in both WSD forms.

``ckpt_path=... optimizer.lr=1e-3`` (a run's LR lowered after an instability) ran on at the checkpoint's 3e-3
without a word: ``LambdaLR.load_state_dict`` restores its ``base_lrs`` and the ``WSDScheduler`` callback restored its
saved peaks. A resume with the same LRs goes on bit for bit as before.
"""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.callbacks import WSDScheduler
from lit_dtrain.schedules import wsd_lr_factor, wsd_scheduler
from tests.unit.test_wsd_callback import BASE, LRRecorder, Toy, fit

KW = dict(total_steps=12, warmup_steps=2, decay_steps=4)
LOWER = (0.02, 0.01)


class LowerToy(Toy):
    """Toy configured with lower peak LRs."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(
            [{"params": self.a.parameters(), "lr": LOWER[0]}, {"params": self.b.parameters(), "lr": LOWER[1]}]
        )
        if self.schedule is None:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": wsd_scheduler(optimizer, **self.schedule), "interval": "step"}}


@pytest.mark.parametrize("form", ["scheduler", "callback"])
def test_a_resume_with_another_configured_lr_uses_it(tmp_path, form):
    def run(module_cls, max_steps, ckpt_path=None):
        rec = LRRecorder()
        if form == "scheduler":
            trainer = fit(module_cls(schedule=KW), [rec], max_steps=max_steps, ckpt_path=ckpt_path, root=tmp_path)
        else:
            trainer = fit(module_cls(), [rec, WSDScheduler(**KW)], max_steps=max_steps, ckpt_path=ckpt_path,
                          root=tmp_path)
        return trainer, rec

    trainer, _ = run(Toy, 5)
    ckpt = tmp_path / "stable.ckpt"
    trainer.save_checkpoint(ckpt)
    _, same = run(Toy, 12, ckpt)
    assert same.at_step == [(s, [b * wsd_lr_factor(s, **KW) for b in BASE]) for s in range(5, 12)]
    _, lower = run(LowerToy, 12, ckpt)
    assert lower.at_step == [(s, [b * wsd_lr_factor(s, **KW) for b in LOWER]) for s in range(5, 12)]
    assert torch.load(ckpt, weights_only=True)["optimizer_states"][0]["param_groups"][0]["lr"] == BASE[0]
