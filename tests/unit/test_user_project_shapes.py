"""lit_dtrain's callbacks beside shapes of a user's own Lightning project that the other user-project tests do not
build: an LR scheduler the module keeps and steps itself (built in ``configure_optimizers``, not returned), and a
module whose ``training_step`` calls its model itself, with no ``forward`` of its own. Each is refused before it
trains, naming what is wrong and the fix (before: the two schedules mixed without a word; torch's
``NotImplementedError`` that named no fix)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.callbacks import SelectiveCheckpointing, WSDScheduler
from lit_dtrain.errors import ConfigError
from tests.unit.test_callbacks_in_foreign_projects import UserModule, fit


class OwnScheduler(UserModule):
    """Builds a ``StepLR`` in ``configure_optimizers`` and steps it itself after each update (manual optimization),
    or at each batch end (automatic), without returning it to Lightning."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), 1e-2)
        self.own_scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        return opt

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if not self.automatic_optimization:
            self.own_scheduler.step()
        return out

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.automatic_optimization:
            self.own_scheduler.step()


@pytest.mark.parametrize("manual", [True, False], ids=["manual", "automatic"])
def test_wsd_refuses_an_lr_scheduler_the_module_steps_itself(tmp_path: Path, manual: bool) -> None:
    """Under manual optimization the LRs of 8 steps were 0.01, 0.01, 0.005, 0.01, 0.005, 0.01, ...: each of the two
    schedules undid the other's, silently; under automatic optimization the module's StepLR did nothing."""
    module = OwnScheduler(manual=manual)
    with pytest.raises(RuntimeError, match=r"WSDScheduler sets the LR itself, but an LR scheduler was built on "
                       r"optimizer\(s\) \[0\] of OwnScheduler .*did not return it.*remove that LR scheduler"):
        fit(tmp_path, [WSDScheduler(total_steps=8, decay_steps=2)], module)
    assert module.steps_run == 0


class NoForward(UserModule):
    """nanoGPT-style use: ``self.net`` is the model, ``training_step`` calls it; no ``forward`` on the module."""

    forward = L.LightningModule.forward  # none of its own

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        return F.mse_loss(self.net(x), y)


def test_selective_checkpointing_budget_names_a_module_without_forward(tmp_path: Path) -> None:
    """The budget probe calls the module on ``example_input_array``; without a ``forward`` it failed in setup with
    torch's ``NotImplementedError: Module [NoForward] is missing the required "forward" function``."""
    module = NoForward()
    with pytest.raises(ConfigError, match=r"policy='budget'\) measures a probe pass by calling NoForward\(<probe "
                       r"input>\), but NoForward defines no forward .*def forward\(self, idx\)"):
        fit(tmp_path, [SelectiveCheckpointing(policy="budget", module_pattern="net.*")], module)
    assert module.steps_run == 0
    # the other policies need no probe: the same module trains with them
    fit(tmp_path / "full", [SelectiveCheckpointing(policy="full", module_pattern="net.*")], NoForward(), max_steps=2)
