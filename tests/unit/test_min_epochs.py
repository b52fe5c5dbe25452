"""``min_epochs`` with LMDataModule's endless step stream: a bound that cannot be met is one error, before training.

Lightning lets no stop end a fit before ``min_epochs`` epochs, and an epoch of this stream never ends: ``min_epochs=1``
with ``max_time`` 10 s trained past 51 s, to ``max_steps``."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.config_checks import check_config
from lit_dtrain.data._fit_end import check_the_fit_ends
from lit_dtrain.errors import ConfigError


@pytest.mark.parametrize(("override", "match"), [
    ("+trainer.min_epochs=3 +trainer.max_epochs=1", r"^trainer.min_epochs=3 exceeds trainer.max_epochs=1: .*raise "
                                                    r"trainer.max_epochs$"),
    ("+trainer.min_epochs=1", r"^trainer.min_epochs=1 can never be met: .* use trainer.min_steps=N"),
    ("+trainer.min_epochs=3 +trainer.limit_train_batches=4 trainer.max_steps=6",
     r"^trainer.min_epochs=3 of 4 batches each is 12 optimizer steps, past trainer.max_steps=6"),
    ("+trainer.min_epochs=2 +trainer.limit_train_batches=4 trainer.accumulate_grad_batches=3 trainer.max_steps=3",
     r"is 4 optimizer steps, past trainer.max_steps=3"),  # ceil(4 / 3) = 2 steps an epoch
    # whole floats are read as the ints they are (they passed: the check ran before the Trainer's keys were ints)
    ("+trainer.min_epochs=2.0 +trainer.max_epochs=1", r"^trainer.min_epochs=2 exceeds trainer.max_epochs=1: "),
    ("+trainer.min_epochs=1.0", r"^trainer.min_epochs=1 can never be met: "),
    ("+trainer.min_epochs=1 +trainer.limit_train_batches=1.0", r"^trainer.min_epochs=1 can never be met: "),  # all
])
def test_a_min_epochs_that_cannot_be_met_is_refused(override, match, tiny_cfg) -> None:
    with pytest.raises(ConfigError, match=match):
        check_config(tiny_cfg(*override.split(" ")))


@pytest.mark.parametrize("override", [
    "+trainer.min_epochs=0",
    "+trainer.min_epochs=null +trainer.max_epochs=1",
    "+trainer.min_epochs=2 +trainer.limit_train_batches=3 trainer.max_steps=6",
    "+trainer.min_epochs=2 +trainer.max_epochs=2 +trainer.overfit_batches=2 trainer.max_steps=4",
    "+trainer.min_steps=6 trainer.max_steps=6",
    # a whole float above 1 is that many batches, as Lightning reads it (refused as the endless stream)
    "+trainer.min_epochs=1 +trainer.limit_train_batches=2.0 trainer.max_steps=4",
    "+trainer.min_epochs=1 +trainer.overfit_batches=2.0 trainer.max_steps=4",
])
def test_a_min_epochs_that_can_be_met_passes(override, tiny_cfg) -> None:
    check_config(tiny_cfg(*override.split(" ")))


def trainer(tmp_path: Path, **kw) -> L.Trainer:
    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     default_root_dir=str(tmp_path),
                     **kw)


def test_a_users_trainer_with_min_epochs_on_the_endless_stream_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^min_epochs=1 can never be met: .* use min_steps=N"):
        check_the_fit_ends(trainer(tmp_path, max_steps=20, max_time="00:00:00:10", min_epochs=1))
    with pytest.raises(ConfigError, match=r"^min_epochs=3 exceeds max_epochs=2"):
        check_the_fit_ends(trainer(tmp_path, max_epochs=2, min_epochs=3, limit_train_batches=4))
    check_the_fit_ends(trainer(tmp_path, max_steps=20, min_epochs=2, limit_train_batches=4))  # epochs of 4 batches
    check_the_fit_ends(trainer(tmp_path, max_steps=20, min_steps=10))


class StopAtOnce(L.Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = True  # as EarlyStopping or max_time would


def test_min_steps_holds_a_stop_back_until_its_step_and_no_longer(tmp_path: Path) -> None:
    """Lightning sets min_epochs=1 where only min_steps is given: on the endless stream '+trainer.min_steps=2' with
    max_time 10 s trained past it to max_steps (and the min_epochs check refused it). The stop now waits for
    min_steps only."""
    from lit_dtrain.models import build_llama
    from lit_dtrain.module import LitLLM
    from tests.unit.test_predict import data

    module = LitLLM(build_llama(vocab_size=257, d_model=32, n_layer=1, n_head=2, block_size=16),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    t = trainer(tmp_path, max_steps=20, min_steps=3, callbacks=[StopAtOnce()], limit_val_batches=0,
                enable_model_summary=False)
    t.fit(module, datamodule=data(tmp_path))
    assert t.global_step == 3


@pytest.mark.parametrize(("min_steps", "limit", "stopped_at"), [
    (3, 100, 3),  # an epoch of 100 batches, past max_steps=20: refused as 'min_epochs=1 of 100 batches each ...'
    (0, None, 1),  # min_steps=0 gets Lightning's min_epochs=1 too: refused as 'min_epochs=1 can never be met'
])
def test_the_min_epochs_lightning_adds_to_min_steps_is_not_refused(tmp_path: Path, min_steps, limit, stopped_at):
    """The min_epochs=1 Lightning sets beside any min_steps (0 included) was refused where an epoch outlasts
    max_steps, naming a min_epochs the user never gave; the stop waits for min_steps only."""
    from lit_dtrain.models import build_llama
    from lit_dtrain.module import LitLLM
    from tests.unit.test_predict import data

    module = LitLLM(build_llama(vocab_size=257, d_model=32, n_layer=1, n_head=2, block_size=16),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    t = trainer(tmp_path, max_steps=20, min_steps=min_steps, callbacks=[StopAtOnce()], limit_val_batches=0,
                enable_model_summary=False, **({} if limit is None else {"limit_train_batches": limit}))
    t.fit(module, datamodule=data(tmp_path))
    assert t.global_step == stopped_at
