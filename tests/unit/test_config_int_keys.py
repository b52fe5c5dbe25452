"""Config checks over a node with integer keys (``'+callbacks.gas.scheduling={0:2}'``): OmegaConf keeps them as
integers, and the walk over every ``_target_`` node looked them up as text."""

from omegaconf import OmegaConf

from lit_dtrain.config_keys import check_target_arguments

GAS = "lightning.pytorch.callbacks.GradientAccumulationScheduler"


def test_a_node_with_integer_keys_is_walked():
    """It was OmegaConf's "Key '0' is not in struct" traceback (full_key: callbacks.gas.scheduling.0)."""
    cfg = OmegaConf.create({"callbacks": {"gas": {"_target_": GAS, "scheduling": {0: 2, 3: 4}}}})
    OmegaConf.set_struct(cfg, True)
    check_target_arguments(cfg)
    assert OmegaConf.to_container(cfg.callbacks.gas.scheduling) == {0: 2, 3: 4}
