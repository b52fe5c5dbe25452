"""Exact results of ``reopen_stopped_epoch`` (lit_dtrain.utils.loop) where single-point mutants passed
test_own_project_epoch_stops.py, test_max_time_step_end.py and test_step_end_timer_own_project.py: only the closed
form of a stopped epoch is rewritten; an epoch whose completed count is not that of a close, an epoch of no batch and
a checkpoint without the epoch loop's state dict are left as they are; and a ``StepEndTimer`` stop at an epoch's
last batch resumes bitwise too."""

from __future__ import annotations

import copy

import lightning as L
import pytest

from lit_dtrain.utils.loop import reopen_stopped_epoch


def _ckpt(epoch: tuple, batch: tuple, loop_state: dict | None = None) -> dict:
    as_dict = lambda v: dict(zip(("ready", "started", "processed", "completed"), v))  # noqa: E731
    fit = {"epoch_progress": {"total": as_dict(epoch), "current": as_dict(epoch)},
           "epoch_loop.batch_progress": {"total": as_dict(batch), "current": as_dict(batch)}}
    if loop_state is not None:
        fit["epoch_loop.state_dict"] = loop_state
    return {"loops": {"fit_loop": fit}}


def test_a_closed_epoch_at_its_last_close_is_reopened_at_its_stopping_batch():
    """Epoch 2 of 3 closed by the stop (processed 2, completed 1 or 2): the epoch runs on, its stopping batch is
    saved at its end (completed one less), and the loop's stepped-batch count one less."""
    for completed in (1, 2):
        ckpt = _ckpt((2, 2, 2, completed), (5, 5, 5, 5), {"_batches_that_stepped": 9})
        assert reopen_stopped_epoch(ckpt)
        fit = ckpt["loops"]["fit_loop"]
        for part in ("total", "current"):
            assert fit["epoch_progress"][part] == {"ready": 2, "started": 2, "processed": 1, "completed": 1}
            assert fit["epoch_loop.batch_progress"][part] == {"ready": 5, "started": 5, "processed": 5,
                                                               "completed": 4}
        assert fit["epoch_loop.state_dict"] == {"_batches_that_stepped": 8}


def test_other_forms_are_left_as_they_are():
    others = [
        _ckpt((2, 2, 2, 0), (5, 5, 5, 5), {"_batches_that_stepped": 9}),  # completed two behind: no close of ours
        _ckpt((1, 1, 1, 0), (0, 0, 0, 0), {"_batches_that_stepped": 0}),  # an epoch that ran no batch
        _ckpt((2, 2, 2, 1), (5, 5, 5, 5)),  # no epoch loop state: not Lightning 2.6's form
        _ckpt((2, 2, 2, 1), (5, 5, 5, 5), ["not", "a", "dict"]),
    ]
    for ckpt in others:
        before = copy.deepcopy(ckpt)
        assert not reopen_stopped_epoch(ckpt)
        assert ckpt == before


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_step_end_timer_stop_at_an_epochs_last_batch_resumes_into_the_next_epoch(tmp_path, monkeypatch):
    """Stopped at step 8, the last batch of epoch 2 of 3 (the test above stops mid-epoch, at step 6): the resume
    trains epoch 3's 4 steps and ends on the straight run's state."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import tests.unit.test_own_project_epoch_stops as stops
    from lit_dtrain.callbacks import StepEndTimer

    monkeypatch.setattr(stops, "STOP_AT", 8)
    straight, _ = stops._fit(tmp_path, "straight")
    ckpt = tmp_path / "stopped" / "last.ckpt"
    timer = StepEndTimer(duration="00:01:00:00")
    stopped, _ = stops._fit(tmp_path, "stopped", [timer, ModelCheckpoint(ckpt.parent, save_last=True)], "timer")
    assert stopped.global_step == 8
    resumed, second = stops._fit(tmp_path, "resumed", [StepEndTimer(duration="00:02:00:00")], ckpt_path=str(ckpt))
    assert (second.steps_run, resumed.global_step) == (4, 12)
    assert stops._equal(stops._state(resumed), stops._state(straight))


class _StopAt6(L.Callback):
    """A stop of one's own (``trainer.should_stop``) after step 6, mid-epoch, listed before the timer."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 6:
            trainer.should_stop = True


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_a_stop_the_step_end_timer_did_not_make_keeps_lightnings_rule(tmp_path):
    """A plain should_stop mid-epoch resumes into the next epoch (Lightning's rule, kept on purpose: docs), even
    with a StepEndTimer in the fit: it rewrites the checkpoint of its own stop only (10 steps in all, not 12)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import tests.unit.test_own_project_epoch_stops as stops
    from lit_dtrain.callbacks import StepEndTimer

    ckpt = tmp_path / "stopped" / "last.ckpt"
    callbacks = [_StopAt6(), StepEndTimer(duration="00:01:00:00"), ModelCheckpoint(ckpt.parent, save_last=True)]
    stopped, _ = stops._fit(tmp_path, "stopped", callbacks)
    assert stopped.global_step == 6
    resumed, second = stops._fit(tmp_path, "resumed", [StepEndTimer(duration="00:01:00:00")], ckpt_path=str(ckpt))
    assert (second.steps_run, resumed.global_step) == (4, 10)


def test_an_error_after_the_fit_does_not_count_as_training_time(tmp_path, monkeypatch):
    """A trainer.validate that raises 100 s after a fit of 3 steps (1 s each): the fit's training time stays 3 s, and
    a refit of the same Trainer to max_steps=5 trains its 2 steps (the error counted as training: 103 s, 0 steps)."""
    import warnings

    from lit_dtrain.callbacks import StepEndTimer
    from tests.unit.test_own_project_lifecycle import Clock, Regression, loader

    class FailsValidation(Regression):
        def validation_step(self, batch, batch_idx):
            raise RuntimeError("the user's validation error")

    clock, timer = Clock(monkeypatch), StepEndTimer(duration={"seconds": 10}, verbose=False)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[clock, timer], max_steps=3,
                        enable_checkpointing=False)
    module = FailsValidation()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=loader())
        assert timer.time_elapsed() == 3.0
        clock.now += 100.0
        with pytest.raises(RuntimeError, match="the user's validation error"):
            trainer.validate(module, dataloaders=loader())
        assert timer.time_elapsed() == 3.0
        trainer.fit_loop.epoch_loop.max_steps = 5
        trainer.fit(module, train_dataloaders=loader())
    assert trainer.global_step == 5 and timer.time_elapsed() == 5.0
