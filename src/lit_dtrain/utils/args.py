"""Argument checks shared by the Python API's constructors and functions and by the scripts' command lines: an error
names the argument; a script's bad input ends with a ``{"error": ...}`` JSON line (:func:`fail`)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import numbers
import os
import re
import signal
import sys
from fractions import Fraction
from pathlib import Path
from typing import NoReturn


def is_number(value, integer: bool = False) -> bool:
    """Whether ``value`` is a real number (an integer, with ``integer``) and not a flag: Python's numbers and
    numpy's (``np.int64(2)``, a value read from an array), but not ``True``, which Python counts as the integer 1
    (``seed=true`` trained as seed 1), nor numpy's ``np.True_``. The one test of every argument check that asks for
    a number."""
    return isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)


def is_flag(value) -> bool:
    """Whether ``value`` is a boolean: ``True``/``False``, or numpy's ``np.True_``/``np.False_`` (a value read from
    an array, taken as numpy numbers are where a number is asked; :func:`as_flag` gives Python's bool). A string
    is not: ``'false'`` and ``'no'`` are truthy."""
    numpy = sys.modules.get("numpy")  # a numpy bool exists only once numpy is imported
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def as_flag(value):
    """``value`` as Python's ``bool`` where it is a flag (:func:`is_flag`), else unchanged: no numpy bool reaches an
    object's state or a checkpoint."""
    return bool(value) if is_flag(value) else value


def type_name(value) -> str:
    """The name of ``value``'s type as an error shows it after the value: ``str`` for Python's own types, with its
    module for others (``numpy.bool``, ``numpy.str_``): numpy's bool is named ``bool`` too, so 'must be an integer,
    got np.True_ (bool)' read as if Python's bool were meant."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def is_whole_float(value) -> bool:
    """Whether ``value`` is a number but not an integer type, and exactly an integer (``1e3``, ``20.0``): what an
    integer setting takes as that integer (:func:`check_int`, the config checks)."""
    return is_number(value) and not isinstance(value, numbers.Integral) and math.isfinite(value) \
        and float(value).is_integer()


def check_int(name: str, value, minimum: int | None = 0) -> int:
    """``value`` as an ``int``: an integer, or a float that is exactly one (``1000.0``: ``1e3`` in YAML, a horizon
    computed as ``0.5 * steps``); ``ValueError`` naming ``name`` for anything else (``1000.5``, a bool, nan, inf, a
    string) and for a value below ``minimum`` (None: no minimum)."""
    if is_whole_float(value):
        value = int(value)
    if not is_number(value, integer=True):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def as_written(value: numbers.Real) -> Fraction:
    """The exact value of ``value`` as written in a config: its shortest decimal form (``0.07``, not the float
    ``0.07000000000000000666``), so that ``as_written(0.07) * 100`` is 7 where the float product is
    7.000000000000001."""
    try:
        return Fraction(str(value))
    except ValueError:  # not a decimal literal (a numpy scalar's repr): its exact binary value
        return Fraction(value)


def positive_int(text: str) -> int:
    """An ``argparse`` type: a whole number >= 1 (a count of steps, rounds, repeats), else argparse's error."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An ``argparse`` type: a whole number >= 0."""
    return _int_at_least(text, 0)


def window_int(text: str) -> int:
    """An ``argparse`` type: the tokens of a training window (``--block-size``), >= 2. A window of 1 token gives the
    model no context (each token predicts the next from itself alone: a bigram model, no attention across tokens),
    and a benchmark trained and timed that and exited 0."""
    return _int_at_least(text, 2, why="a window of 1 token trains the model without context")


def seed_int(text: str) -> int:
    """An ``argparse`` type: a seed in train.py's range ``[0, 2**32 - 1]`` (numpy's; ``config_checks``). A negative
    seed was a ``ConfigError`` traceback at a benchmark's first ``train.py`` run, or trained on without a word."""
    value = _int_at_least(text, 0)
    if value > 2**32 - 1:  # above 2**64 torch failed: 'Overflow when unpacking long long'
        raise argparse.ArgumentTypeError(f"must be <= {2**32 - 1} (the range of train.py's seed), got {value}")
    return value


def _int_at_least(text: str, minimum: int, why: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}{f' ({why})' if why else ''}, got {value}")
    return value


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite number > 0 (a learning rate), else argparse's error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def comma_list(item=str, choices=None):
    """An ``argparse`` type for ``--flag a,b,c``: the list of ``item(entry)``, at least one, each checked by ``item``
    (``positive_int``, ``positive_float``: its error is argparse's) and, with ``choices``, one of them. An empty
    entry (``''``, ``a,,b``), a repeated one and an unknown name are refused, naming the entry; they used to
    select nothing or fail with a KeyError after the earlier entries had run."""

    def parse(text: str) -> list:
        entries = [entry.strip() for entry in text.split(",")]
        if any(not entry for entry in entries):
            raise argparse.ArgumentTypeError(f"expected a comma list without empty entries, got {text!r}")
        values = []
        for entry in entries:
            try:
                values.append(item(entry))
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise argparse.ArgumentTypeError(f"{entry!r}: {e}") from None
        repeated = sorted({str(v) for i, v in enumerate(values) if v in values[:i]})
        if repeated:  # a variant run twice overwrote its first result
            raise argparse.ArgumentTypeError(f"{repeated} listed twice in {text!r}")
        unknown = [v for v in values if choices is not None and v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(choices)}")
        return values

    parse.__name__ = "comma list"  # argparse's "invalid <type> value" names it
    return parse


def read_json_file(path: str, flag: str, written_by: str):
    """The JSON value in the file ``path`` that ``flag`` names (a results file the script wrote earlier, written
    ``written_by`` it); ``ValueError`` naming the flag and the file when it cannot be read or is not JSON."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path!r} is not JSON (not UTF-8 text); give a file written by {written_by}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} {path!r} is not JSON ({e}); give a file written by {written_by}") from None


def _script_name() -> str:
    """The file name of the script that calls into this module (``spectrum.py``): that of the nearest module
    outside this one on the call stack, else ``sys.argv[0]``'s. The same whether the script runs as ``python
    scripts/spectrum.py`` or is loaded by a test, where ``sys.argv[0]`` is pytest's (``pytest: error: ...``)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    file = frame.f_globals.get("__file__") if frame is not None else None
    return os.path.basename(file or sys.argv[0]) or "script"


def report_error(message: str, prog: str | None = None) -> None:
    """Print a script's error: ``prog: error: message`` on stderr and ``{"error": message}`` as a JSON line on
    stdout. Every script in ``scripts/`` ends with a JSON line on success, so a caller that parses the last line reads
    an error too (a plain message there was a JSONDecodeError in the caller). Without ``prog``, the calling script's
    file name (:func:`_script_name`), as its :class:`ScriptArgumentParser` names it."""
    prog = prog or _script_name()
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.stderr.flush()
    print(json.dumps({"error": message}), flush=True)


def quiet_when_the_reader_goes(main):
    """Wrap a script's ``main`` so that a reader of its stdout that stops early (``generate.py ... | head -n 2``)
    ends it as ``cat`` ends: without a word, killed by SIGPIPE (status 141 in a shell). Python ignores SIGPIPE, so a
    write to the closed pipe raised ``BrokenPipeError`` and the script ended in its traceback, status 1 (and the
    flush at exit printed another 'Exception ignored' one). The Python docs' recipe (signal module, 'Note on
    SIGPIPE'), ending by the signal as ``cat`` does rather than with status 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()  # a pipe's last lines are written here
            return result
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit writes nowhere
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGPIPE)

    return wrapper


def fail(message: str, prog: str | None = None, code: int = 2) -> NoReturn:
    """End a script on bad input: :func:`report_error`, then exit with status ``code``."""
    report_error(message, prog)
    raise SystemExit(code)


def _typed(action: argparse.Action, default) -> str:
    """``default`` as one would type it on the command line (:meth:`ScriptArgumentParser.format_help`)."""
    if isinstance(default, str):
        return repr(default)
    if isinstance(default, (list, tuple)):
        several = action.nargs in ("+", "*") or isinstance(action.nargs, int)
        return (" " if several else ",").join(map(str, default))
    return str(default)


class ScriptArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors (a bad flag, a failed type, ``parser.error(...)``) end like
    :func:`fail`: the usage and ``prog: error: message`` on stderr, ``{"error": message}`` last on stdout, exit 2.
    ``prog`` defaults to the file name of the script that makes the parser (:func:`_script_name`), not
    ``sys.argv[0]``'s: they differ only where a test or another program loads the script."""

    def __init__(self, prog: str | None = None, *args, **kwargs) -> None:
        super().__init__(prog or _script_name(), *args, **kwargs)

    def format_help(self) -> str:
        """The help, with ``(default: X)`` after every option whose default is a value (not None or False) and
        whose help does not already say what its default is: ``--steps STEPS  steps per round`` left the reader
        to find the number in the source. A list default reads as it is typed (``stdlib mixture`` after an option
        of several values, ``a,b`` after a comma list), not as a Python list (``['stdlib', 'mixture']``)."""
        for action in self._actions:
            help_text, default = action.help or "", action.default
            if (not action.option_strings or default is None or default is False or default == argparse.SUPPRESS
                    or (isinstance(default, (str, list, tuple)) and not default)  # '' or []: nothing
                    or re.search(r"\(default\b|\bdefault:", help_text, re.IGNORECASE)):
                continue
            shown = _typed(action, default).replace("%", "%%")
            action.help = f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        fail(message, self.prog)
