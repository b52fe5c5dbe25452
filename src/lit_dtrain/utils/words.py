"""Counts in messages: ``counted(1, "step")`` is "1 step", ``counted(3, "step")`` "3 steps" (a warning said "the last 1
steps run at min_lr_factor"), and :func:`plural` picks the word alone, also a verb that agrees with the count."""

from __future__ import annotations


def plural(n: int, singular: str, plural_form: str | None = None) -> str:
    """``singular`` when ``n`` is 1, else ``plural_form`` (default: ``singular + "s"``): ``plural(n, "runs", "run")``
    for a verb whose subject is ``n`` things."""
    return singular if n == 1 else (plural_form or singular + "s")


def counted(n: int, noun: str, plural_form: str | None = None) -> str:
    """``n`` and the noun in the form that agrees with it: "1 step", "0 steps", "2 steps"."""
    return f"{n} {plural(n, noun, plural_form)}"
