"""Argument checks for the callbacks' constructors: an error names the class and the argument."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_arg(owner: str, name: str, value: Any, ok: Callable[[Any], bool], requirement: str) -> None:
    """``ValueError("<owner>: <name> must be <requirement>, got <value!r>")`` unless ``ok(value)``.

    A value that ``ok`` cannot convert or compare fails the same way: ``int("abc")`` and ``"abc" > 0`` say only
    "invalid literal for int() with base 10: 'abc'" and "'>' not supported between instances of 'str' and 'int'",
    naming neither the class nor the argument (a Hydra override ``callbacks.x.log_every_n_steps=abc``)."""
    try:
        good = ok(value)
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ValueError(f"{owner}: {name} must be {requirement}, got {value!r}")
