"""``trainer.limit_val_batches=1.0`` is Lightning's fraction 'all of them', accepted as 1 and 0.5 are; a whole float
above 1 is that many batches."""

from __future__ import annotations

import pytest

from lit_dtrain.config_checks import check_validation_limit


@pytest.mark.parametrize(("value", "reaches_lightning"), [("1.0", 1.0), ("0.5", 0.5), ("1", 1), ("3", 3), ("2.0", 2)])
def test_a_fraction_up_to_one_or_a_whole_number_of_batches_is_accepted(tiny_cfg, value, reaches_lightning):
    # accepted, and kept as Lightning reads it: 1.0 stays the float 'all' (as the int 1 it is one batch: 4 -> 1 of
    # the default run's 4 validation batches), 2.0 becomes the int 2
    cfg = tiny_cfg(f"trainer.limit_val_batches={value}")
    check_validation_limit(cfg)
    got = cfg.trainer.limit_val_batches
    assert got == reaches_lightning and type(got) is type(reaches_lightning)
