"""lit_dtrain's callbacks beside shapes of a user's own Lightning project that the other user-project tests do not
build: an LR scheduler the module keeps and steps itself (built in ``configure_optimizers``, not returned), a
module whose ``training_step`` calls its model itself, with no ``forward`` of its own (both refused before they
train, naming what is wrong and the fix; before: the two schedules mixed without a word, torch's
``NotImplementedError`` that named no fix), two backward passes through checkpointed blocks in one manual step, and
two optimizers that step at different rates under ``WSDScheduler``."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.callbacks import SelectiveCheckpointing, WSDScheduler
from lit_dtrain.errors import ConfigError
from tests.unit._user_project_helpers import UserModule, fit, regression_data


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


class TwoLosses(L.LightningModule):
    """Manual optimization with two losses through the same blocks (a GAN's or a multi-task step): two backward
    passes, the first with ``retain_graph=True``. ``norm``: each block holds a BatchNorm (buffers)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8) if norm else torch.nn.Identity(),
                                torch.nn.Tanh())
            for _ in range(2)
        )
        self.heads = torch.nn.Linear(8, 2)
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = x + block(x)
        out = self.heads(x)
        self.manual_backward(F.mse_loss(out[:, :1], y), retain_graph=True)
        self.manual_backward(F.mse_loss(out[:, 1:], -y))
        self.grads.append([p.grad.clone() for p in self.parameters()])
        opt = self.optimizers()
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)


@pytest.mark.parametrize("norm", [False, True], ids=["no_buffers", "batchnorm"])
def test_two_backward_passes_through_checkpointed_blocks(tmp_path: Path, norm: bool) -> None:
    """``full`` recomputes a block at each backward, so its gradients and BatchNorm statistics equal those without
    checkpointing (a block with buffers failed at the second backward with ``AttributeError: '_GeneratorContextManager'
    object has no attribute 'args'``); ``selective`` cannot (torch's selective checkpointing allows one backward) and
    says so, naming policy='full' (it failed with the same AttributeError)."""
    plain = TwoLosses(norm)
    fit(tmp_path / "none", [], plain, max_steps=3)
    full = TwoLosses(norm)
    fit(tmp_path / "full", [SelectiveCheckpointing(policy="full")], full, max_steps=3)
    for step_plain, step_full in zip(plain.grads, full.grads, strict=True):
        for g, h in zip(step_plain, step_full, strict=True):
            assert torch.equal(g, h)
    for b, c in zip(plain.buffers(), full.buffers(), strict=True):
        assert torch.equal(b, c)
    with pytest.raises(ConfigError, match=r"a second backward through a Sequential block checkpointed with the "
                       r"selective policy .*checkpoint these blocks with policy='full'"):
        fit(tmp_path / "selective", [SelectiveCheckpointing(policy="selective")], TwoLosses(norm), max_steps=3)


class HalfRate(UserModule):
    """Two optimizers under manual optimization, the second stepped every other batch (a GAN's 2:1 updates)."""

    def __init__(self) -> None:
        super().__init__(manual=True, two=True)

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        first, second = self.optimizers()
        self.manual_backward(F.mse_loss(self(x), y))
        first.step()
        if batch_idx % 2 == 1:
            second.step()
        first.zero_grad()
        second.zero_grad()


def test_wsd_says_which_optimizer_took_fewer_updates_than_its_schedule(tmp_path: Path) -> None:
    """16 batches: the first optimizer takes 16 updates and decays to 0, the second 8 and ends at the peak LR; it went
    without a word (only a fit whose optimizers all fell short was told)."""
    wsd = WSDScheduler(total_steps=16, warmup_steps=2, decay_steps=4)
    with pytest.warns(UserWarning, match=r"not every optimizer took total_steps=16 in this fit \(optimizer 1: 8 "
                      r"updates, its last at 1 of the peak LR; the decay is updates 12..15\)"):
        trainer = fit(tmp_path, [wsd], HalfRate(), max_steps=24)
    assert wsd.updates == [16, 8]
    assert [o.param_groups[0]["lr"] for o in trainer.optimizers] == [0.0, 1e-2]


def test_a_second_fit_of_the_same_trainer_keeps_each_optimizers_updates(tmp_path: Path) -> None:
    """After a first fit of 24 optimizer steps the optimizers took 16 and 8 updates; a second ``trainer.fit`` of the
    same Trainer (``max_steps`` raised) goes on from those counts. It took them from ``global_step`` as if both had
    stepped every batch, [12, 12]: the first optimizer's LR jumped from 0 back to the peak, the second's skipped 4
    updates of its schedule, silently."""
    wsd = WSDScheduler(total_steps=16, warmup_steps=2, decay_steps=4)
    module = HalfRate()
    trainer = fit(tmp_path, [wsd], module, max_steps=24)
    assert wsd.updates == [16, 8]
    seen: list[list[float]] = []

    class FirstLRs(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append([o.param_groups[0]["lr"] for o in trainer.optimizers])

    trainer.callbacks.append(FirstLRs())
    trainer.fit_loop.epoch_loop.max_steps = 27  # 2 more batches: 3 more optimizer steps
    trainer.fit(module, regression_data())
    assert seen[0] == [0.0, 1e-2]  # the first optimizer past its schedule's end, the second at update 8 of 16
    assert wsd.updates == [18, 9]
