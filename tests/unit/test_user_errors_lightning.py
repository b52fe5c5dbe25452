"""A Lightning class's own argument check inside Hydra's ``instantiate`` is a bad input: one line, as a ValueError is
(``lit_dtrain.sweeps.user_error``)."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.sweeps import user_error


def test_a_lightning_misconfiguration_in_a_callbacks_arguments_is_one_line(tmp_path):
    """python train.py callbacks.model_checkpoint.save_top_k=-2 ended in Hydra's 'Error executing job ... Error in
    call to target ...: MisconfigurationException('Invalid value for save_top_k=-2. Must be >= -1') full_key: ...'.
    lit_dtrain's own ModelCheckpoint now refuses -2 itself (a ValueError); Lightning's class keeps its own check."""
    cfg = OmegaConf.create({"callbacks": {"model_checkpoint": {
        "_target_": "lightning.pytorch.callbacks.ModelCheckpoint", "dirpath": str(tmp_path), "save_top_k": -2}}})
    with pytest.raises(Exception) as raised:
        instantiate(cfg.callbacks.model_checkpoint)
    error = user_error(raised.value)
    assert isinstance(error, ConfigError)
    assert str(error) == "callbacks.model_checkpoint: Invalid value for save_top_k=-2. Must be >= -1"
