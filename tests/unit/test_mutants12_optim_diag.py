"""Exact results of ``OptimizerDiagnostics`` where single-point mutants passed test_mutants6_optim_diag.py,
test_grad_clip_diag.py, test_grad_clip_diag_combinations.py and the projects-of-one's-own tests (twelfth hand
mutation audit): the strict boundary of an eps-dominated element, and one warning per run for an optimizer without
Adam state, not one per diagnostic step."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import OptimizerDiagnostics
from lit_dtrain.callbacks.optimizer_diagnostics import eps_dominated_fraction
from tests.unit.test_mutants6_optim_diag import _Adamax


def test_an_element_whose_denominator_equals_eps_is_not_eps_dominated():
    """Dominated means ``sqrt(v_hat) < eps``, strictly. eps 0.5 and beta2 0 (no bias correction): v = 0.25 gives
    sqrt(v_hat) = eps exactly, not dominated; just below it is (all values exact in float32)."""
    v = torch.tensor([0.25, 0.2490234375, 0.5, 0.0])
    assert eps_dominated_fraction(v, step=3, beta2=0.0, eps=0.5) == (2, 4)
    # beta2 0.5 at step 1: v_hat = v / 0.5, so v = 0.125 is at the edge and 0.0625 below it
    assert eps_dominated_fraction(torch.tensor([0.125, 0.0625]), step=1, beta2=0.5, eps=0.5) == (1, 2)


def test_an_optimizer_without_adam_state_is_warned_about_once_per_run(tmp_path: Path) -> None:
    """Adamax over 3 diagnostic steps: one warning, not one a step."""
    diag = OptimizerDiagnostics(every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[diag], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Adamax(), train_dataloaders=DataLoader(torch.ones(6, 1), batch_size=2))
    assert trainer.global_step == 3 and set(diag.last) == {"optim/0/grad_rms", "optim/0/update_to_param_rms"}
    assert sum("Adamax holds no Adam" in str(w.message) for w in caught) == 1
