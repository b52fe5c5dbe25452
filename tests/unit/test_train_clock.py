"""``TrainClock``, the summary's clock and token count, on its own: the tokens of all ranks at each optimizer step's
end, and the figures of the fit that trained kept through a start that trains no step."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lit_dtrain.train_callbacks import TrainClock


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
