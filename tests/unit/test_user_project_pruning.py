"""Lightning's ``ModelPruning`` beside lit_dtrain's callbacks in a project of one's own: its first prune renames
each pruned ``weight`` to ``weight_orig`` beside a ``weight_mask`` buffer (the same ``Parameter`` object, so the
optimizer keeps it) and computes ``weight`` in a forward pre-hook."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelPruning

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.unit.test_preemption import Own
from tests.unit.test_user_project_edges import WeightsAfterEachStep, assert_dropped_at_17


class SpikeAt17(Own):
    def training_step(self, batch, batch_idx):
        loss = (self.net(batch["x"]) - batch["y"]).square().mean()
        return loss * 1000.0 if self.trainer.global_step == 17 else loss


def test_a_rollback_past_a_pruning_drops_the_step_and_says_why(tmp_path: Path) -> None:
    """Epochs of 16 steps; the snapshots (after steps 12 and 16, taken at batch end) hold the unpruned state dict, and
    ModelPruning prunes at epoch 0's end. The rollback at step 17 failed mid-training in torch's ``load_state_dict``
    ('Missing key(s) in state_dict: "net.0.weight_orig", ... Unexpected key(s) ... "net.0.weight"'). Now the step is
    dropped as a skip, with a warning, and ``rolled_back_to`` is None."""
    monitor = LossSpikeMonitor(actions=["log", "rollback"], warmup_steps=4, snapshot_every=4, snapshot_keep=2,
                               path=str(tmp_path / "spikes.jsonl"))
    weights = WeightsAfterEachStep()
    trainer = L.Trainer(accelerator="cpu", max_steps=20, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[ModelPruning("l1_unstructured", amount=0.5, verbose=0), monitor, weights])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SpikeAt17())
    assert_dropped_at_17(monitor, caught, weights)
