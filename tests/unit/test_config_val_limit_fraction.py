"""``trainer.limit_val_batches=1.0`` is Lightning's fraction 'all of them', accepted as 1 and 0.5 are."""

from __future__ import annotations

import pytest

from lit_dtrain.config_checks import check_validation_limit


@pytest.mark.parametrize("value", ["1.0", "0.5", "1", "3"])
def test_a_fraction_up_to_one_or_a_whole_number_of_batches_is_accepted(tiny_cfg, value):
    check_validation_limit(tiny_cfg(f"trainer.limit_val_batches={value}"))
