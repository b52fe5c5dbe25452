"""Which command-line override Hydra was applying when composing failed."""

from __future__ import annotations

import traceback


def failed_override(error: BaseException) -> str | None:
    """The override (as typed, ``'~data.sources.1'``) that Hydra was applying when it raised ``error``, else None.
    Hydra's error names none: several ``~<key>.<digits>`` overrides can stand on one command line, a dict key of
    digits (``+foo.1=a '~foo.1'``) deleted fine beside a list item it could not, and scanning the arguments named the
    dict's. Read from the frame of Hydra's loop over the overrides (hydra 1.3 private: its local ``override``)."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "_apply_overrides_to_config":
            line = getattr(frame.f_locals.get("override"), "input_line", None)
            return line if isinstance(line, str) else None
    return None
