"""Lightning's lines and Python warnings into the run's log file (Hydra's ``train.log``), not only the console.

Hydra's job logging gives the root logger a console and a file handler. Two kinds of lines a run prints never
reached the file: Lightning's loggers (``lightning.pytorch``, ``lightning.fabric``) have a console handler of their
own and do not propagate to the root, and ``warnings.warn`` (Lightning's ``rank_zero_warn`` included: 45 of
lit_dtrain's own call sites) goes to ``sys.stderr`` through ``warnings.showwarning``. A run's ``train.log`` held
neither "AdaptiveGradClip runs before Lightning's gradient_clip_val ..." nor Lightning's "Trainer(limit_val_batches=
...)" lines, which the console showed. :func:`console_lines_to_job_log` copies both into the root logger's file
handlers while ``train(cfg)`` runs, and leaves the console as it was (the same lines, printed once).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")
_WARNINGS = logging.getLogger("py.warnings")  # the logger name ``logging.captureWarnings`` uses


def file_handlers() -> list[logging.FileHandler]:
    """The root logger's file handlers: Hydra's job log (``train.log``), none outside a Hydra job."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


@contextlib.contextmanager
def console_lines_to_job_log() -> Iterator[None]:
    """Within the block, Lightning's log lines and every shown warning also go to the root logger's file handlers
    (see the module docstring). A no-op without one. On leaving, the handlers and ``warnings.showwarning`` are put
    back (a multirun's next job logs into its own file)."""
    files = file_handlers()
    if not files:
        yield
        return
    added = []
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in files:
            if not logger.propagate and handler not in logger.handlers:
                logger.addHandler(handler)
                added.append((logger, handler))
    shown = warnings.showwarning

    def show_and_log(message, category, filename, lineno, file=None, line=None) -> None:
        shown(message, category, filename, lineno, file, line)  # the console, as before
        text = warnings.formatwarning(message, category, filename, lineno, "").rstrip("\n")  # no source line
        record = _WARNINGS.makeRecord(_WARNINGS.name, logging.WARNING, filename, lineno, text, None, None)
        for handler in files:
            if record.levelno >= handler.level:
                handler.handle(record)

    warnings.showwarning = show_and_log
    try:
        yield
    finally:
        if warnings.showwarning is show_and_log:
            warnings.showwarning = shown
        for logger, handler in added:
            logger.removeHandler(handler)


def log_to_handlers(logger: logging.Logger, message: str, level: int = logging.INFO, traceback: bool = False,
                    files: bool = True, console: bool = False) -> None:
    """Log ``message`` at ``level`` (with the exception being handled, ``traceback``) to the root logger's file
    handlers (Hydra's job log) where ``files``, and to its other handlers (the console) where ``console``: a line the
    console already printed (the summary), or one only the job log should get (a failed job's error)."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, sys.exc_info() if traceback else None)
    for handler in logging.getLogger().handlers:
        to_file = isinstance(handler, logging.FileHandler)
        if (files if to_file else console) and record.levelno >= handler.level:
            handler.handle(record)


@contextlib.contextmanager
def warnings_reach_the_console() -> Iterator[None]:
    """Within the block, lit_dtrain's warnings and errors reach stderr even where the logging configuration drops
    them: Hydra's ``hydra/job_logging=disabled`` sets the root logger to ERROR and disables every logger that exists
    (lit_dtrain's, created at import), and a run without its checkpoint callbacks, or whose WSD schedule rounds to no
    decay, trained without a word. Such a configuration gets a stderr handler on the ``lit_dtrain`` logger at
    WARNING for the block; its INFO lines stay off. A no-op where warnings are shown already."""
    package = logging.getLogger("lit_dtrain")
    if package.isEnabledFor(logging.WARNING) and not package.disabled:
        yield
        return
    loggers = [package, *(logger for name, logger in logging.root.manager.loggerDict.items()
                          if name.startswith("lit_dtrain.") and isinstance(logger, logging.Logger))]
    saved = [(logger, logger.disabled, logger.level) for logger in loggers]
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    for logger in loggers:
        logger.disabled = False
    package.setLevel(logging.WARNING)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        for logger, disabled, level in saved:
            logger.disabled, logger.level = disabled, level


@contextlib.contextmanager
def no_log_records() -> Iterator[None]:
    """No ``logging`` record while it is held (``logging.disable``), the level set before put back after: a check that
    does once, before the seed, what the run does again later (and warns about there)."""
    previous = logging.root.manager.disable  # the level logging.disable() set: the stdlib has no getter for it
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)
