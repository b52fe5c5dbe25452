"""Stops mid-epoch of a fit under ``max_epochs`` in a project of one's own (3 epochs of 4 batches on ``LMDataModule``,
which draws its batches by step and so resumes anywhere), resumed with ``ckpt_path=``: a fit stopped at step 6 must
train the 6 steps left and end on the straight run's weights and optimizer state, bitwise. Lightning closes the epoch
at ``trainer.should_stop``, so a checkpoint written after a timer's stop resumed into the next epoch: 4 steps, 10 in all
(``StepEndTimer`` now writes such a stop as mid-epoch). ``PreemptionCheckpoint`` saves at the stopping batch's end,
mid-epoch already."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, Timer

from tests.unit._user_project_helpers import UserLM, _equal

STOP_AT = 6  # of 12: the second batch of epoch 1


class _Counting(UserLM):
    def __init__(self, stop=None) -> None:
        super().__init__()
        self.stop = stop

    def training_step(self, batch, batch_idx):
        if self.stop is not None and self.trainer.global_step + 1 == STOP_AT:
            stop, self.stop = self.stop, None
            if stop == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:  # the timer's time is used up during this step (a slow batch)
                next(c for c in self.trainer.callbacks if isinstance(c, Timer))._offset = 3600  # its duration, 1 h
        return super().training_step(batch, batch_idx)


def _data(tmp_path: Path) -> L.LightningDataModule:
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.datamodule import LMDataModule

    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(100)))
    return LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], block_size=8,
                        batch_size=2, val_fraction=0.1, cache_dir=str(tmp_path / "cache"), progress=False)


def _fit(tmp_path: Path, run: str, callbacks=(), stop=None, ckpt_path=None) -> tuple[L.Trainer, _Counting]:
    trainer = L.Trainer(max_epochs=3, limit_train_batches=4, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / run,
                        callbacks=list(callbacks))
    module = _Counting(stop)
    try:
        trainer.fit(module, datamodule=_data(tmp_path), ckpt_path=ckpt_path)
    except SystemExit:  # PreemptionCheckpoint's stop (Lightning's SIGTERMException)
        assert stop == "sigterm"
    return trainer, module


def _state(trainer: L.Trainer) -> tuple[dict, dict]:
    return trainer.lightning_module.state_dict(), trainer.optimizers[0].state_dict()


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.parametrize("stop", ["timer", "sigterm"])
def test_a_stop_mid_epoch_resumes_the_rest_of_that_epoch(tmp_path: Path, stop: str) -> None:
    from lit_dtrain.callbacks import PreemptionCheckpoint, StepEndTimer

    straight, _ = _fit(tmp_path, "straight")
    assert straight.global_step == 12
    ckpt = tmp_path / "stopped" / "last.ckpt"
    stopper = StepEndTimer(duration="00:01:00:00") if stop == "timer" else PreemptionCheckpoint(str(ckpt.parent))
    stopped, first = _fit(tmp_path, "stopped", [stopper, ModelCheckpoint(ckpt.parent, save_last=True)], stop)
    assert first.steps_run == stopped.global_step == STOP_AT
    more_time = StepEndTimer(duration="00:02:00:00")  # (the stopped fit used 1 h)
    resumed, second = _fit(tmp_path, "resumed", [more_time], ckpt_path=str(ckpt))
    assert (second.steps_run, resumed.global_step) == (12 - STOP_AT, 12)  # timer before: 4 steps, ending at 10
    assert _equal(_state(resumed), _state(straight))


def test_only_a_closed_epoch_after_a_batch_end_is_reopened() -> None:
    from lit_dtrain.utils.loop import reopen_stopped_epoch

    def ckpt(epoch: tuple, batch: tuple) -> dict:
        as_dict = lambda v: dict(zip(("ready", "started", "processed", "completed"), v))  # noqa: E731
        return {"loops": {"fit_loop": {
            "epoch_progress": {"total": as_dict(epoch), "current": as_dict(epoch)},
            "epoch_loop.batch_progress": {"total": as_dict(batch), "current": as_dict(batch)},
            "epoch_loop.state_dict": {"_batches_that_stepped": 6}}}}

    closed = ckpt((2, 2, 2, 1), (2, 2, 2, 2))  # written at the stopped epoch's end
    assert reopen_stopped_epoch(closed)
    fit = closed["loops"]["fit_loop"]
    assert fit["epoch_progress"]["total"] == {"ready": 2, "started": 2, "processed": 1, "completed": 1}
    assert fit["epoch_loop.batch_progress"]["current"]["completed"] == 1
    assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 5
    for other in (ckpt((2, 2, 1, 1), (2, 2, 2, 2)), ckpt((2, 2, 2, 1), (2, 2, 2, 1)), {}):  # mid-epoch; no loops
        assert not reopen_stopped_epoch(other)
