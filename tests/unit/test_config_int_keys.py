"""Config checks over a node with integer keys (``'+callbacks.gas.scheduling={0:2}'``): OmegaConf keeps them as
integers, and the walk over every ``_target_`` node looked them up as text."""

import pytest
from omegaconf import OmegaConf

from lit_dtrain.config_checks import check_config
from lit_dtrain.config_keys import check_target_arguments
from lit_dtrain.errors import ConfigError

GAS = "lightning.pytorch.callbacks.GradientAccumulationScheduler"


def test_a_node_with_integer_keys_is_walked():
    """It was OmegaConf's "Key '0' is not in struct" traceback (full_key: callbacks.gas.scheduling.0)."""
    cfg = OmegaConf.create({"callbacks": {"gas": {"_target_": GAS, "scheduling": {0: 2, 3: 4}}}})
    OmegaConf.set_struct(cfg, True)
    check_target_arguments(cfg)
    assert OmegaConf.to_container(cfg.callbacks.gas.scheduling) == {0: 2, 3: 4}


@pytest.mark.parametrize("scheduling, value", [("{0:2}", "2"), ("{0:1,2:4}", "<micro-batches>")])
def test_lightnings_accumulation_scheduler_in_the_config_is_refused(tiny_cfg, scheduling, value):
    """``scheduling={0: 2}`` with ``val_check_interval=3`` validated 4 times in 6 steps, in the middle of
    accumulations: train.py reads ``trainer.accumulate_grad_batches``."""
    cfg = tiny_cfg(f"+callbacks.gas._target_={GAS}", f"+callbacks.gas.scheduling={scheduling}")
    with pytest.raises(ConfigError, match=r"^callbacks.gas is Lightning's GradientAccumulationScheduler, .* set "
                                          rf"trainer.accumulate_grad_batches={value}, one accumulation for the run$"):
        check_config(cfg)
