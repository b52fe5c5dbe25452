"""``WSDScheduler`` beside an LR that a project of one's own sets by hand.

Under manual optimization a ``training_step`` that set ``group["lr"]`` before ``opt.step()`` (a warmup of its own)
won every update: the updates used its LRs (0.125 .. 0.5) while ``OncePerStepLRMonitor`` logged WSD's (0.005 .. 0),
and WSD's schedule never applied, without a word. Lightning's own warmup recipe in ``optimizer_step`` (the LR set
after the step) never applied instead: WSD set it again at the batch's end. Both are refused now, at the first update
or the first batch's end, with an error that names the param group, its LR and WSD's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_dtrain.callbacks import WSDScheduler
from tests.unit._user_project_helpers import MIXED, UpdateLRs, UserModule, fit


class HandWarmupManual(UserModule):
    """Manual optimization with a hand warmup set before each update."""

    def training_step(self, batch, batch_idx):
        for group in self.optimizers().param_groups:
            group["lr"] = 0.5 * min(1.0, (self.global_step + 1) / 4)
        return super().training_step(batch, batch_idx)


class LightningWarmupRecipe(UserModule):
    """The warmup of Lightning's ``LightningModule.optimizer_step`` docstring: the LR set after the step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = 0.5 * min(1.0, (self.trainer.global_step + 1) / 4)


def wsd() -> WSDScheduler:
    return WSDScheduler(total_steps=8, warmup_steps=2, decay_steps=4)


def test_an_lr_set_by_hand_before_a_manual_update_is_refused_before_that_update(tmp_path: Path) -> None:
    module, record = HandWarmupManual(manual=True), UpdateLRs()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(RuntimeError) as err:
        fit(tmp_path, [wsd(), record], module)
    assert "param group 0 of optimizer 0 holds lr=0.125 at its update, not the 0.005 WSDScheduler set" in str(err.value)
    assert record.used[0] == []  # (UpdateLRs' pre-hook comes after WSD's: the update never ran)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.parametrize("trainer_kwargs", [{}, MIXED], ids=["fp32", "bf16_accumulate2"])
def test_lightnings_warmup_recipe_in_optimizer_step_is_refused_at_the_first_steps_end(tmp_path, trainer_kwargs):
    record = UpdateLRs()
    with pytest.raises(RuntimeError, match=r"holds lr=0\.125 at the batch's end, not the 0\.005 WSDScheduler set"):
        fit(tmp_path, [wsd(), record], LightningWarmupRecipe(), **trainer_kwargs)
    assert record.used[0] == [0.005]  # the first update took WSD's LR; the hand LR set after it is refused


def test_an_lr_the_callbacks_scale_for_one_step_is_not_taken_for_one_set_by_hand(tmp_path: Path) -> None:
    """A scaling inside the step (the FourierSampler's stage multiplier, LossSpikeMonitor's lr_cooldown) is WSD's LR
    times a factor, taken back after the update: not refused, in either order of the callbacks."""
    from tests.unit.test_user_project_lr import HalveLRInsideStep

    for order in (1, -1):
        schedule, record = wsd(), UpdateLRs()
        fit(tmp_path, [*[schedule, HalveLRInsideStep()][::order], record], UserModule(manual=True), max_steps=8)
        assert record.used[0] == pytest.approx([0.5 * 1e-2 * schedule.lr_factor(k) for k in range(8)])
