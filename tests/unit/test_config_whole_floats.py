"""A whole float given for an integer key (``data.block_size=1.0``, ``trainer.max_steps=1e3``) is read as that
integer, and a refusal of it says the value as given: the checks after the conversion read the integer, so
``data.block_size=1.0`` was refused as ``data.block_size=1`` and ``decay_branch.steps=0.0`` as 'got 0'."""

import pytest

from lit_dtrain._config_values import as_given, as_integer, forget_given_values
from lit_dtrain.sweeps import user_error
from lit_dtrain.train import train


def _refusal(cfg) -> str:
    """The line train.py prints for ``train(cfg)``'s refusal (``error: <it>``)."""
    with pytest.raises(Exception) as e:
        train(cfg)
    error = user_error(e.value)
    assert error is not None, e.value
    return str(error)


@pytest.mark.parametrize("override, line", [
    ("data.block_size=1.0", "data.block_size=1: a window of 1 token trains the model without context; give >= 2 "
                            "(data.block_size was given as 1.0, read as the integer 1)"),
    ("trainer.accumulate_grad_batches=0.0", "trainer.accumulate_grad_batches must be a positive integer, got 0 ("
     "trainer.accumulate_grad_batches was given as 0.0, read as the integer 0)"),
    # refused by LMDataModule as Hydra builds it: the constructor's own words, behind the node's key
    ("data.batch_size=0.0", "data: data.batch_size must be >= 1, got 0 (data.batch_size was given as 0.0, read as the "
                            "integer 0)"),
    # a callback's argument, converted by its annotation (int), refused by the class in its own words
    ("callbacks.loss_spike.warmup_steps=-1.0", "callbacks.loss_spike: LossSpikeMonitor: warmup_steps must be an "
     "integer >= 2, got -1 (callbacks.loss_spike.warmup_steps was given as -1.0, read as the integer -1)"),
])
def test_a_refused_whole_float_is_said_as_given(tiny_cfg, override, line):
    cfg = tiny_cfg("callbacks=[default,loss_spike]", override) if "loss_spike" in override else tiny_cfg(override)
    assert _refusal(cfg) == line


def test_a_whole_float_of_another_key_adds_nothing(tiny_cfg):
    """Only the keys a line quotes: ``trainer.max_steps=4.0`` beside a refused ``data.block_size=1``."""
    line = _refusal(tiny_cfg("trainer.max_steps=4.0", "data.block_size=1"))
    assert line == "data.block_size=1: a window of 1 token trains the model without context; give >= 2"


def test_a_later_start_does_not_say_an_earlier_starts_value(tiny_cfg):
    """Each start has its own record (a sweep's jobs run in one process): job 1's ``trainer.max_steps=0.0``, then
    job 2's ``trainer.max_steps=0``."""
    assert _refusal(tiny_cfg("trainer.max_steps=0.0")).endswith("(trainer.max_steps was given as 0.0, read as the "
                                                                "integer 0)")
    assert _refusal(tiny_cfg("trainer.max_steps=0")) == "trainer.max_steps must be a positive step budget, got 0"


def test_a_key_is_named_whole_or_by_its_node_and_its_own_name():
    forget_given_values()
    assert as_integer("model.n_layer", 0.0) == 0
    assert as_given("model: LlamaConfig.n_layer must be positive, got 0") == \
        "model: LlamaConfig.n_layer must be positive, got 0 (model.n_layer was given as 0.0, read as the integer 0)"
    assert as_given("LlamaConfig.n_layer must be positive, got 0", "model").endswith("as the integer 0)")
    for other in ("model.n_layers=0", "model: n_head must divide d_model", "model_n_layer must be positive"):
        assert as_given(other) == other
    forget_given_values()
    assert as_given("model: LlamaConfig.n_layer must be positive, got 0").endswith("got 0")


def test_a_warmup_past_the_run_is_refused_as_a_whole_float_too(tiny_cfg):
    """``scheduler=constant scheduler.warmup_steps=5.0 trainer.max_steps=2`` trained 2 steps of warmup, exit 0, where
    ``warmup_steps=5`` was refused: the check took only an ``int``."""
    line = _refusal(tiny_cfg("scheduler=constant", "scheduler.warmup_steps=5.0", "trainer.max_steps=2"))
    assert line == "scheduler.warmup_steps=5.0 exceeds trainer.max_steps=2: the LR would never reach optimizer.lr"
