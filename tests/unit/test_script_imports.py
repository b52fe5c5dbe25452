"""Every name a script in ``scripts/`` imports from lit_dtrain exists, including imports inside functions.

The benchmarks import lazily inside the functions that run the experiments, and CI never runs a full
benchmark, so a renamed or moved library function would only fail minutes into a benchmark run
(``bench_wsd.py --quick`` died at its first run on ``workflows.checkpoint_step`` after it moved).
"""

from __future__ import annotations

import ast
import importlib

from tests.conftest import ROOT


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
