"""PreemptionCheckpoint saves after every other callback's ``on_train_batch_end`` of the step it acts on.

``LossSpikeMonitor`` finishes a dropped step there (undoes the step in the compressor's error-feedback residual,
excludes the batch's samples, counts the spike; ``rollback`` restores the snapshot). The preemption save used to
run first whenever it came first in the callback list, as ``callbacks=[default,loss_spike]`` puts it, so a
SIGTERM during a spike's step saved a checkpoint without any of that, and the resumed run applied the dropped
spike's gradient from the residual and trained on the excluded samples again.
"""

from __future__ import annotations

import os

import lightning as L

from lit_dtrain.callbacks import LossSpikeMonitor, PreemptionCheckpoint
from lit_dtrain.checkpoint import safe_torch_load
from lit_dtrain.strategies import CompressedDDPStrategy
from tests.conftest import free_port
from tests.toys import TinyRegression

SPIKE_STEP = 5


class _Tiny(TinyRegression):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        return loss * 1e4 if self.global_step == SPIKE_STEP else loss  # a finite spike


class _SigtermAt(L.Callback):
    def __init__(self, preemption: PreemptionCheckpoint) -> None:
        self.preemption, self.spike_indices = preemption, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == SPIKE_STEP:
            self.preemption.signalled = True  # what its SIGTERM handler records
            self.spike_indices = sorted(batch["index"].tolist())


def test_a_sigterm_during_a_dropped_spike_saves_the_finished_step(tmp_path, monkeypatch, no_group_left):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    preemption = PreemptionCheckpoint(str(tmp_path))
    monitor = LossSpikeMonitor(actions=["skip"], warmup_steps=2, z_threshold=None, rel_threshold=10.0,
                               path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=CompressedDDPStrategy(compressor={"name": "topk", "ratio": 0.5}),
                        callbacks=[preemption, monitor, sigterm := _SigtermAt(preemption)])
    try:
        trainer.fit(_Tiny())
    except SystemExit:
        pass
    assert trainer.global_step == SPIKE_STEP + 1 and preemption.saved_step == SPIKE_STEP + 1
    ckpt = safe_torch_load(os.path.join(tmp_path, "last.ckpt"))
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("LossSpikeMonitor"))
    assert state["num_spikes"] == 1
    assert sorted(state["excluded"].tolist()) == sigterm.spike_indices
    # the spike's gradient (loss x 1e4) was taken out of the top-k residual again: what is left is the residual
    # of the steps before, not a gradient thousands of times larger
    residuals = ckpt["lit_dtrain_comm"]["per_rank"][0]["compressor"]["residuals"]
    assert sum(float(r.abs().sum()) for r in residuals.values()) < 100.0
