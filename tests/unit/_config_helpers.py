"""Helpers shared by the test_configs_*.py files (and test_checkpoint_name_metric.py)."""

import logging

from tests.conftest import compose_cfg


def start_warnings(check, tmp_path, caplog):
    """``warnings_for(*overrides)``: the warnings ``check`` logs for the composed config (not TINY's overrides: they
    switch off callbacks.progress_bar)."""

    caplog.set_level(logging.WARNING, logger="lit_dtrain.config_checks")

    def warnings_for(*overrides):
        caplog.clear()
        check(compose_cfg(list(overrides), tmp_path / "run", tiny=False))
        return [r.getMessage() for r in caplog.records]

    return warnings_for
