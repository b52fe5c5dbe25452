"""Exact values of ``OptimizerDiagnostics`` (lit_dtrain.callbacks.optimizer_diagnostics) where single-point mutants
passed test_grad_clip_diag.py and test_grad_clip_diag_combinations.py, which bound grad_rms only by (0, 1)."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import OptimizerDiagnostics


class _PartlyUsed(L.LightningModule):
    """One group of a used weight (4 ones, gradient 2 each) and an unused one (12 ones, no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Parameter(torch.ones(4))
        self.unused = torch.nn.Parameter(torch.ones(12))

    def training_step(self, batch, batch_idx):
        return (self.used * 2.0).sum() + 0.0 * batch.sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_grad_rms_and_the_update_ratio_are_of_the_parameters_with_a_gradient(tmp_path: Path) -> None:
    """grad_rms is the gradient's RMS over the parameters backward reached (2.0; over the whole group, with the
    unused 12 counted as zeros, it read 1.0); Adam's first step moves each used element by lr, so the update is 0.01
    of the parameters' RMS (0.005 with the unused ones); no element is eps-dominated (v / (1 - beta2) = 4)."""
    diag = OptimizerDiagnostics(every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[diag], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(_PartlyUsed(), train_dataloaders=DataLoader(torch.ones(4, 1), batch_size=2))
    assert diag.last == {
        "optim/0/grad_rms": pytest.approx(2.0, rel=1e-6),
        "optim/0/update_to_param_rms": pytest.approx(0.01, rel=1e-6),
        "optim/0/eps_dominated_frac": 0.0,
    }


class _TwoGroups(_PartlyUsed):
    def configure_optimizers(self):
        return torch.optim.Adam([{"params": [self.used], "name": "used"}, {"params": [self.unused], "name": "idle"}],
                                lr=0.01)


class _Adamax(_PartlyUsed):
    def configure_optimizers(self):
        return torch.optim.Adamax(self.parameters(), lr=0.01)  # eps and betas, but exp_inf for exp_avg_sq


def _fit(module: L.LightningModule, tmp_path: Path) -> OptimizerDiagnostics:
    diag = OptimizerDiagnostics(every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[diag], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, train_dataloaders=DataLoader(torch.ones(4, 1), batch_size=2))
    return diag


def test_a_group_no_step_reached_has_no_eps_fraction_and_adamax_is_named_unsupported(tmp_path: Path) -> None:
    """A group none of whose parameters has Adam state measured nothing: no eps_dominated_frac (0.0 would say 'none
    dominated'). Adamax has eps and betas but no exp_avg_sq: it is named as unsupported, not read as unmeasured."""
    last = _fit(_TwoGroups(), tmp_path).last
    assert last["optim/used/eps_dominated_frac"] == 0.0 and "optim/idle/eps_dominated_frac" not in last
    with pytest.warns(UserWarning, match=r"OptimizerDiagnostics: Adamax holds no Adam 'exp_avg_sq'/'eps'"):
        last = _fit(_Adamax(), tmp_path).last
    assert set(last) == {"optim/0/grad_rms", "optim/0/update_to_param_rms"}


class _ByHand(_PartlyUsed):
    """Manual optimization whose backward is not Lightning's (``loss.backward()``): no grad_rms was measured."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = (self.used * 2.0).sum() + 0.0 * batch.sum()
        loss.backward()
        optimizer.step()


def test_a_step_whose_backward_lightning_did_not_run_has_an_unknown_grad_rms(tmp_path: Path) -> None:
    last = _fit(_ByHand(), tmp_path).last
    assert math.isnan(last["optim/0/grad_rms"])  # not 0.0, a gradient of zero
    assert last["optim/0/update_to_param_rms"] == pytest.approx(0.01, rel=1e-6)
