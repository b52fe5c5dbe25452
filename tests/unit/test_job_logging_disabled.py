"""``hydra/job_logging=disabled`` (root at ERROR, every existing logger disabled): lit_dtrain's warnings still reach
stderr while a run trains (``lit_dtrain.utils.job_log.warnings_reach_the_console``)."""

from __future__ import annotations

import logging
import logging.config

from lit_dtrain.utils.job_log import warnings_reach_the_console


def test_warnings_reach_stderr_under_disabled_job_logging(capsys):
    """A run whose callbacks=[loss_spike] dropped every checkpoint printed no warning under
    hydra/job_logging=disabled; its warning is shown now, its info lines stay off, and the logging is put back."""
    child = logging.getLogger("lit_dtrain.config_checks")
    everyone = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    saved = [(lg, lg.disabled, lg.level, list(lg.handlers)) for lg in everyone]
    try:
        # Hydra's hydra/job_logging/disabled.yaml
        logging.config.dictConfig({"version": 1, "root": {"level": "ERROR"}, "disable_existing_loggers": True})
        assert not child.isEnabledFor(logging.WARNING)
        with warnings_reach_the_console():
            child.warning("callbacks=[loss_spike] replaces the default callbacks")
            child.info("an info line")
        child.warning("after the block")
        assert child.disabled and logging.getLogger("lit_dtrain").level == logging.NOTSET
    finally:
        for lg, disabled, level, handlers in saved:
            lg.disabled, lg.level, lg.handlers[:] = disabled, level, handlers
    err = capsys.readouterr().err
    assert "[lit_dtrain.config_checks][WARNING] - callbacks=[loss_spike] replaces the default callbacks" in err
    assert "an info line" not in err and "after the block" not in err


def test_shown_warnings_are_left_alone():
    package = logging.getLogger("lit_dtrain")
    handlers = list(package.handlers)
    with warnings_reach_the_console():
        assert package.handlers == handlers
