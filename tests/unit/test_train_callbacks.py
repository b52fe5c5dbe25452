"""The callbacks ``train(cfg)`` adds, on their own (stub trainers, no fit): ``TrainClock``'s tokens of all ranks and
the figures it keeps through a start that trains no step, ``max_time``'s timer beside a ``Timer`` of one's own,
``LogStepSync`` before a final validation, and the fraction ``ValLimitCheck`` suggests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Timer
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.train_callbacks import LogStepSync, StepEndTimer, TrainClock, _fraction_for_one_batch, max_time_timer


def _trainer(global_step: int, world_size: int = 1, accumulating=lambda: False):
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=accumulating))
    return SimpleNamespace(global_step=global_step, world_size=world_size, fit_loop=loop,
                           callback_metrics={"train/loss": torch.tensor(9.0)})


def test_the_tokens_of_a_step_count_every_rank_once_it_steps() -> None:
    """Every rank trains a batch of one shape: a step of 2 micro-batches of 4 x 6 tokens on 2 ranks is 96 tokens,
    counted at its last micro-batch (a stop between the two leaves none counted)."""
    flags = iter([True, False, True])  # mid-step, the step's end, mid-step
    trainer = _trainer(0, world_size=2, accumulating=lambda: next(flags))
    clock = TrainClock()
    clock.on_train_start(trainer, None)
    batch = {"input_ids": torch.zeros(4, 6, dtype=torch.long)}
    clock.on_train_batch_end(trainer, None, None, batch, 0)
    assert clock.tokens == 0
    clock.on_train_batch_end(trainer, None, None, batch, 1)
    assert clock.tokens == 96
    clock.on_train_batch_end(trainer, None, None, batch, 2)
    assert clock.tokens == 96


def test_a_start_that_trains_no_step_checkpoints_the_figures_it_resumed_with() -> None:
    """A resume at max_steps only validates, and its last.ckpt is written again: it holds the figures of the fit that
    trained (its train_loss, seconds and tokens), not this start's (no step, 9.0 from a callback metric, 0 tokens), so
    a later start that only validates still reports them."""
    carried = {"train_loss": 2.5, "start_step": 0, "train_seconds": 0.5, "wall_seconds": 0.8, "tokens": 1280}
    clock = TrainClock()
    clock.load_state_dict(carried)
    clock.fit_started()
    clock.on_train_start(_trainer(6), None)
    assert clock.state_dict() == carried


def test_max_time_gets_a_step_end_timer_unless_the_callbacks_hold_a_timer_of_their_own() -> None:
    """Lightning ignores ``max_time`` beside a ``Timer`` callback; a second timer of ours would stop the run at the
    earlier of the two."""
    cfg = OmegaConf.create({"max_time": "00:00:01:00"})
    assert isinstance(max_time_timer(cfg, []), StepEndTimer)
    assert max_time_timer(cfg, [Timer(duration="00:01:00:00")]) is None
    assert max_time_timer(OmegaConf.create({"max_time": None}), []) is None
    assert max_time_timer(OmegaConf.create({"max_time": None}), [Timer()]) is None


def test_max_time_as_a_mapping_with_an_interpolation_is_resolved() -> None:
    """``+trainer.max_time={hours:${trainer.max_steps}}`` handed the text '${trainer.max_steps}' to timedelta:
    'TypeError: unsupported type for timedelta hours component: str' in Hydra's traceback."""
    cfg = OmegaConf.create({"max_steps": 2, "max_time": {"hours": "${max_steps}", "minutes": 30}})
    assert max_time_timer(cfg, [])._duration == 2.5 * 3600


def test_max_time_beside_a_measuring_timer_of_ones_own_is_refused() -> None:
    """Lightning drops ``max_time`` beside a ``Timer`` callback: a ``Timer()`` that only measures left the run with no
    time limit (``trainer.max_time=00:00:00:06`` trained on for 10 minutes), said only in an info line."""
    with pytest.raises(ConfigError, match=r"trainer.max_time='00:00:01:00' would be ignored: .* Timer of their own "
                                          r"without a duration"):
        max_time_timer(OmegaConf.create({"max_time": "00:00:01:00"}), [Timer()])


def test_the_final_validation_logs_at_global_step() -> None:
    """A resume from a checkpoint saved inside its last step (a stop signal's) only validates: Lightning's logging
    step is one behind global_step there, and the validation's point landed at N - 1, beside fit's."""
    loop = SimpleNamespace(_batches_that_stepped=3)
    trainer = SimpleNamespace(global_step=4, fit_loop=SimpleNamespace(epoch_loop=loop),
                              state=SimpleNamespace(fn="validate"))
    LogStepSync().on_validation_start(trainer, None)
    assert loop._batches_that_stepped == 4


def test_the_suggested_val_fraction_is_written_without_trailing_zeros() -> None:
    assert [_fraction_for_one_batch(n) for n in (1, 2, 3, 4, 1000)] == ["1", "0.5", "0.334", "0.25", "0.001"]
