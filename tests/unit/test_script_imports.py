"""Every name a script in ``scripts/`` imports from lit_dtrain exists, including imports inside functions; every
flag of a script has a help line.

The benchmarks import lazily inside the functions that run the experiments, and CI never runs a full
benchmark, so a renamed or moved library function would only fail minutes into a benchmark run
(``bench_wsd.py --quick`` died at its first run on ``workflows.checkpoint_step`` after it moved).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys

import pytest

from tests.conftest import ROOT, load_script


def lit_dtrain_imports(path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from lit_dtrain... import name`` anywhere in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "lit_dtrain":
            out += [(node.lineno, node.module, alias.name) for alias in node.names if alias.name != "*"]
    return out


def resolves(module: str, name: str) -> bool:
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return True
    try:  # a submodule: ``from lit_dtrain.data import samplers``
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


def test_every_lit_dtrain_import_of_the_scripts_resolves():
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    imports = [(script.name, *imp) for script in scripts for imp in lit_dtrain_imports(script)]
    assert len(imports) > len(scripts)  # the scan sees the scripts' imports
    missing = [f"{s}:{line}: from {mod} import {name}" for s, line, mod, name in imports if not resolves(mod, name)]
    assert missing == []


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser a script's ``main`` built."""


def script_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The ``ArgumentParser`` that ``scripts/<name>.py``'s ``main`` builds, taken where it starts parsing."""

    def caught(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    main = load_script(name).main
    with pytest.raises(_Parsed) as e:
        main(*([[]] if inspect.signature(main).parameters else []))
    return e.value.args[0]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "scripts").glob("[!_]*.py")))
def test_every_script_flag_has_a_help_line(name, monkeypatch):
    """``--help`` describes every argument: 25 flags (``bench_fourier.py --corpora``, ``--eval-every``, ``--lr``,
    ``spectrum.py --num-bands``, ``--bandwidth-fraction``, every ``--seed``, ...) showed their name alone."""
    parser = script_parser(name, monkeypatch)
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    assert shown  # the parser was caught
    assert [a.option_strings or a.dest for a in shown if not (a.help or "").strip()] == []
