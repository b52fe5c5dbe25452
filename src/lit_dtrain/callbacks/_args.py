"""Argument checks for the callbacks' constructors: an error names the class and the argument."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from lit_dtrain.utils.args import is_number


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
    """The test of a count argument: a number (:func:`~lit_dtrain.utils.args.is_number`: Python's or numpy's, not a
    flag) that is a whole one (``2.0`` too) and at least ``minimum``; None too with ``none_ok``. A fraction is
    refused: ``int(2.5)`` made ``every_n_steps=2.5`` log every 2 steps, without a word; so is a flag, ``True`` (or
    ``np.True_``), which ``int()`` takes as 1; ``inf``/``nan``; and a string: ``every_k="3"`` was taken as 3 here
    while the same value in a config (``callbacks.selective_ckpt.every_k='3'``) was refused ('must be an integer,
    got '3' (str)'), and a number argument given as a string (``z_threshold="3.0"``) was refused here too. The one
    test of every count argument of the callbacks."""
    return lambda v: (none_ok and v is None) or (is_number(v) and int(v) >= minimum and int(v) == float(v))


def finite_number(ok: Callable[[Any], bool] = lambda v: True, none_ok: bool = False) -> Callable[[Any], bool]:
    """The test of a real-valued argument: a finite number (numpy's too) for which ``ok`` holds; None too with
    ``none_ok``. A flag is refused (``True > 0`` made ``z_threshold=True`` a threshold of 1.0), and so are a string
    (``"0.5" > 0`` failed in a bare comparison naming no argument), NaN (every comparison false: a range check written
    ``if v <= 0: raise`` let it through) and inf."""
    return lambda v: (none_ok and v is None) or (is_number(v) and math.isfinite(v) and ok(v))


def is_path(value) -> bool:
    """Whether ``value`` is a non-empty path (``str`` or ``os.PathLike``): a number is not (``open(5, "a")`` writes to
    file descriptor 5, and a falsy ``0`` or ``""`` was taken for "the default path")."""
    return isinstance(value, (str, os.PathLike)) and os.fspath(value) != ""
