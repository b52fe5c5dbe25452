"""``report_divergence`` where only the validation loss is not finite (finite weights: an overflow in the validation
forward): the run diverged, and its final checkpoint, which holds those finite weights, stays the one named."""

from __future__ import annotations

import logging

import lightning as L
import torch

from lit_dtrain.divergence import report_divergence


class _Finite(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


def test_finite_weights_with_a_nan_val_loss_are_a_divergence(tmp_path, caplog):
    last = str(tmp_path / "last.ckpt")
    metrics = {"val_loss": float("nan"), "checkpoint": last}
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        report_divergence(metrics, _Finite(), None, tmp_path)
    assert metrics["diverged"] is True and metrics["first_nonfinite_step"] is None and metrics["checkpoint"] == last
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("the run DIVERGED: the final weights are finite, but val_loss is nan: the final "
                           f"checkpoint is {last}"), line
    healthy = {"val_loss": 2.5, "checkpoint": last}
    report_divergence(healthy, _Finite(), None, tmp_path)
    assert healthy["diverged"] is False
