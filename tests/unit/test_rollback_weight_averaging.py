"""A ``LossSpikeMonitor`` rollback beside Lightning's ``StochasticWeightAveraging`` in a user's own project: SWA's
average and its count of averaged models go back with the weights, in a fresh fit and after a resume. (The EMA of
``EMAWeightAveraging``: ``test_user_project_edges.py``.)"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.unit.test_preemption import Own


class SpikeAt(Own):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.spike = step

    def training_step(self, batch, batch_idx):
        loss = (self.net(batch["x"]) - batch["y"]).square().mean()
        return loss * 1000.0 if self.trainer.global_step == self.spike else loss


def _trainer(tmp_path: Path, callbacks, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks, **kwargs)


class SwaAfterEachStep(L.Callback):
    def __init__(self, swa: StochasticWeightAveraging) -> None:
        self.swa, self.seen = swa, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        count = None if self.swa.n_averaged is None else int(self.swa.n_averaged)
        self.seen[trainer.global_step] = ([p.detach().clone() for p in self.swa._average_model.parameters()], count)


@pytest.mark.parametrize("swa_epoch_start", [1, 2], ids=["swa_before_the_snapshot", "swa_after_the_snapshot"])
def test_a_rollback_restores_the_average_of_stochastic_weight_averaging(tmp_path: Path, swa_epoch_start: int) -> None:
    """Lightning's ``StochasticWeightAveraging`` averages the weights at each epoch's start (16 steps an epoch). The
    spike at step 17 rolls back to the snapshot after step 14, and SWA's average and count go back with the weights:
    they kept the weights after step 16, a discarded one (count 2 for 1, the average 0.23 off the snapshot's). SWA
    started at epoch 1, after the snapshot: its count is 0 again, so its next update starts the average afresh."""
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=swa_epoch_start)
    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=4, snapshot_every=2, snapshot_keep=3,
                               rollback_min_age=3, path=str(tmp_path / "spikes.jsonl"))
    seen = SwaAfterEachStep(swa)
    _trainer(tmp_path, [swa, monitor, seen], max_epochs=2).fit(SpikeAt(17))
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events][:1] == [(17, 14)]
    (at_snapshot, count_then), (at_spike, count_spike), (after, count_after) = (seen.seen[s] for s in (14, 17, 18))
    assert (count_then, count_spike, count_after) == ((1, 2, 1) if swa_epoch_start == 1 else (None, 1, 0))
    assert not all(torch.equal(p, q) for p, q in zip(at_snapshot, at_spike))  # the epoch-1 update moved it
    for p, q in zip(at_snapshot, after):
        assert torch.equal(p, q)


def test_a_rollback_after_a_resume_keeps_the_resumed_count_of_stochastic_weight_averaging(tmp_path: Path) -> None:
    """A fit resumed at step 20 (SWA from epoch 0: 2 models averaged) rolls back to its train-start snapshot at the
    spike at step 23. SWA's count was None there (it starts at its first epoch start, from the checkpoint's count): the
    rollback set it to 0, and SWA's next update replaced the resumed average by the weights of one step. It is the
    resumed count again, and the average the resumed one."""
    def monitor() -> LossSpikeMonitor:
        return LossSpikeMonitor(actions=["rollback"], warmup_steps=4, snapshot_every=100,
                                path=str(tmp_path / "spikes.jsonl"))

    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    first = _trainer(tmp_path, [swa, monitor()], max_steps=20)
    first.fit(SpikeAt(-1))
    first.save_checkpoint(tmp_path / "at20.ckpt")
    resumed_average = [p.detach().clone() for p in swa._average_model.parameters()]
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    seen, spikes = SwaAfterEachStep(swa), monitor()
    _trainer(tmp_path, [swa, spikes, seen], max_steps=26).fit(SpikeAt(23), ckpt_path=tmp_path / "at20.ckpt")
    assert [(e["step"], e["rolled_back_to"]) for e in spikes.events] == [(23, 20)]
    assert [seen.seen[s][1] for s in (23, 24, 26)] == [3, 2, 2]  # (3: SWA's update at the resumed epoch's start)
    for p, q in zip(resumed_average, seen.seen[24][0]):
        assert torch.equal(p, q)
