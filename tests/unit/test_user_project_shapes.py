"""lit_dtrain's callbacks beside shapes of a user's own Lightning project that the other user-project tests do not
build: an LR scheduler the module keeps and steps itself (built in ``configure_optimizers``, not returned). It is
refused before it trains, naming what is wrong and the fix (before: the two schedules mixed without a word)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_dtrain.callbacks import WSDScheduler
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
