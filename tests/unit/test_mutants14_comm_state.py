"""``lit_dtrain.strategies._comm_state`` where the fourteenth hand mutation audit's single-point mutants passed its
tests: a state kept around a sync is given only while the module is still in the fit that kept it."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.strategies._comm_state import _kept_state, gather_comm_state, kept_for_a_resume
from tests.unit.test_mutants13_comm_state import _strategy_at, _sync


def test_a_module_out_of_its_fit_gathers_its_parameters_of_now():
    """A sync kept at step 6, then the module leaves the trainer (``_trainer`` None, as a module detached after its
    fit, saved by hand): no kept state is given, and the state gathered holds the parameters of now (without the
    trainer check, AttributeError on ``None.global_step``)."""
    strategy = _strategy_at(6)
    with kept_for_a_resume(strategy, 6):
        _sync(strategy)
    assert _kept_state(strategy) is not None
    strategy.lightning_module._trainer = None
    assert _kept_state(strategy) is None
    state = gather_comm_state(strategy)
    assert state["local_update"]["steps_since_sync"] == 0
    assert torch.equal(state["per_rank"][0]["params"]["weight"], strategy.lightning_module.weight)


def test_a_per_step_codec_keeps_no_parameters_or_optimizer_states_of_its_own():
    """Without a local-update rule every rank holds the same parameters, which Lightning's ``state_dict`` saves:
    the comm state holds no copy of them, nor of the optimizer states (without the rule check: both, per rank)."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(compressor="int8")
    module = torch.nn.Linear(3, 2)
    strategy._lightning_module, strategy.optimizers = module, [torch.optim.SGD(module.parameters(), lr=0.1)]
    (mine,) = gather_comm_state(strategy)["per_rank"]
    assert "params" not in mine and "optimizer_states" not in mine
    assert mine["compressor"]["name"] == "int8"


def test_a_state_of_another_version_is_refused_by_its_key():
    from lit_dtrain.strategies._comm_state import apply_comm_state

    state = {**gather_comm_state(_strategy_at(6)), "version": 2}
    with pytest.raises(ValueError, match=r"^lit_dtrain_comm: unsupported version 2$"):
        apply_comm_state(_strategy_at(0), state)
