"""Argument checks for the callbacks' constructors: an error names the class and the argument."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lit_dtrain.utils.args import is_flag


def check_arg(owner: str, name: str, value: Any, ok: Callable[[Any], bool], requirement: str) -> None:
    """``ValueError("<owner>: <name> must be <requirement>, got <value!r>")`` unless ``ok(value)``.

    A value that ``ok`` cannot convert or compare fails the same way: ``int("abc")`` and ``"abc" > 0`` say only
    "invalid literal for int() with base 10: 'abc'" and "'>' not supported between instances of 'str' and 'int'",
    naming neither the class nor the argument (a Hydra override ``callbacks.x.log_every_n_steps=abc``); ``int(inf)``
    raised OverflowError ("cannot convert float infinity to integer") from a count's check."""
    try:
        good = ok(value)
    except (TypeError, ValueError, OverflowError):
        good = False
    if not good:
        raise ValueError(f"{owner}: {name} must be {requirement}, got {value!r}")


def whole_at_least(minimum: int, none_ok: bool = False) -> Callable[[Any], bool]:
    """The test of a count argument: an integer (or a value ``int()`` takes exactly: ``2.0``, ``np.int64(2)``,
    ``"2"``) that is at least ``minimum``; None too with ``none_ok``. A fraction is refused: ``int(2.5)`` made
    ``every_n_steps=2.5`` log every 2 steps, without a word; so is a flag, ``True`` (or ``np.True_``), which
    ``int()`` takes as 1; and ``inf``/``nan``. The one test of every count argument of the callbacks."""
    return lambda v: (none_ok and v is None) or (not is_flag(v) and int(v) >= minimum and int(v) == float(v))
