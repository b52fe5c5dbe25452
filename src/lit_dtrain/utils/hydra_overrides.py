"""Which command-line override Hydra was applying when composing failed."""

from __future__ import annotations

import traceback


def failed_override(error: BaseException) -> str | None:
    """The override (as typed, ``'~data.sources.1'``) that Hydra was applying when it raised ``error``, else None.
    Hydra's error names none: several ``~<key>.<digits>`` overrides can stand on one command line, a dict key of
    digits (``+foo.1=a '~foo.1'``) deleted fine beside a list item it could not, and scanning the arguments named the
    dict's. Read from the frame of Hydra's loop over the overrides (hydra 1.3 private: its local ``override``)."""
    line = getattr(_override_loop_locals(error).get("override"), "input_line", None)
    return line if isinstance(line, str) else None


def config_being_overridden(error: BaseException):
    """The config Hydra was applying the command-line overrides to when it raised ``error`` (the overrides before the
    failed one applied), else None. Read from the same frame as :func:`failed_override` (hydra 1.3 private: its
    local ``cfg``)."""
    return _override_loop_locals(error).get("cfg")


def _override_loop_locals(error: BaseException) -> dict:
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "_apply_overrides_to_config":
            return frame.f_locals
    return {}
