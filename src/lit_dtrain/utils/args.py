"""Argument checks shared by the Python API's constructors and functions: an error names the argument."""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value, minimum: int | None = 0) -> int:
    """``value`` as an ``int``: an integer, or a float that is exactly one (``1000.0``: ``1e3`` in YAML, a horizon
    computed as ``0.5 * steps``); ``ValueError`` naming ``name`` for anything else (``1000.5``, a bool, nan, inf, a
    string) and for a value below ``minimum`` (None: no minimum)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        if math.isfinite(value) and float(value).is_integer():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def positive_int(text: str) -> int:
    """An ``argparse`` type: a whole number >= 1 (a count of steps, rounds, repeats), else argparse's error."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An ``argparse`` type: a whole number >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value
