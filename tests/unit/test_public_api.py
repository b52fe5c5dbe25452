"""The public import paths that README, docs/ and conf/ name exist, and each package's ``__all__`` lists them.

``lit_dtrain.callbacks`` and ``lit_dtrain.data.samplers`` resolve some names lazily (``__getattr__``), so a name
missing from ``__all__`` still imports by name but is missing from ``from ... import *`` and ``dir()``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "lit_dtrain.callbacks",
    "lit_dtrain.data",
    "lit_dtrain.data.samplers",
    "lit_dtrain.models",
    "lit_dtrain.optim",
    "lit_dtrain.schedules",
    "lit_dtrain.strategies",
]


def documented_imports() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``from lit_dtrain... import A, B`` in README.md and docs/*.md."""
    found = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for module, names in re.findall(r"from (lit_dtrain[\w.]*) import ((?:\w+,\s*)*\w+)", path.read_text()):
            found.update((module, name.strip()) for name in names.split(","))
    return found


def config_targets() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``_target_: lit_dtrain.<module>.<name>`` in conf/."""
    found = set()
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        for target in re.findall(r"_target_:\s*(lit_dtrain\.[\w.]+)", path.read_text()):
            found.add(tuple(target.rsplit(".", 1)))
    return found


def test_the_scan_finds_the_documented_names():
    """The scans see what the README and conf/ show (a broken regex would make the checks below vacuous)."""
    assert ("lit_dtrain.callbacks", "WSDScheduler") in documented_imports()
    assert ("lit_dtrain.strategies", "BlockQuantizer") in documented_imports()
    assert ("lit_dtrain.data.samplers", "FourierSampler") in config_targets()
    assert ("lit_dtrain.callbacks", "token_throughput_monitor") in config_targets()


@pytest.mark.parametrize("source", [documented_imports, config_targets])
def test_every_documented_or_configured_name_exists_and_is_in_all(source):
    for module_name, name in sorted(source()):
        module = importlib.import_module(module_name)
        assert getattr(module, name, None) is not None, f"{module_name}.{name} does not exist"
        exported = getattr(module, "__all__", None)
        if exported is not None:
            assert name in exported, f"{module_name}.{name} is public but missing from {module_name}.__all__"


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_accurate_and_star_import_and_dir_see_every_name(package):
    module = importlib.import_module(package)
    exported = module.__all__
    assert len(set(exported)) == len(exported), f"{package}.__all__ lists a name twice"
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    missing = [name for name in exported if name not in namespace]
    assert not missing, f"from {package} import * misses {missing}"
    assert set(exported) <= set(dir(module)), f"dir({package}) misses {sorted(set(exported) - set(dir(module)))}"


def _names_a_type_checker_sees(package: str) -> dict[str, str]:
    """``name -> module`` of each ``from <module> import name`` at the top of ``package``'s ``__init__.py``, those
    under ``if TYPE_CHECKING:`` too: what mypy and an IDE read (they never call the module's ``__getattr__``)."""
    import ast

    init = importlib.import_module(package).__file__
    seen: dict[str, str] = {}
    body = ast.parse(Path(init).read_text()).body
    for node in body + [inner for top in body if isinstance(top, ast.If) for inner in top.body]:
        if isinstance(node, ast.ImportFrom) and node.module:
            seen.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            seen[node.name] = package
    return seen


@pytest.mark.parametrize("package", ["lit_dtrain.callbacks", "lit_dtrain.data.samplers"])
def test_a_type_checker_sees_the_lazily_resolved_names(package):
    """The names these packages resolve in ``__getattr__`` were ``Any`` to a type checker (mypy's
    ``reveal_type(WSDScheduler)`` in a project of one's own: "Any"; an IDE offered no signature): each is imported
    under ``TYPE_CHECKING`` from the module that ``__getattr__`` takes it from."""
    module = importlib.import_module(package)
    seen = _names_a_type_checker_sees(package)
    unseen = [name for name in module.__all__ if name not in seen]
    assert not unseen, f"{package}: a type checker does not see {unseen}"
    for name in module.__all__:
        assert getattr(importlib.import_module(seen[name]), name) is getattr(module, name), name


def test_the_wheel_holds_py_typed(tmp_path):
    """``pip install .`` installed no ``py.typed``, so mypy in a project importing the callbacks stopped at the import:
    'module is installed, but missing library stubs or py.typed marker [import-untyped]'. The wheel built from the
    source (a copy, so no build/ or egg-info lands in the checkout) holds it beside the package."""
    import shutil
    import subprocess
    import sys
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1):  # 70.1+ builds wheels alone
        pytest.importorskip("wheel")
    project = tmp_path / "project"
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "wheels"), str(project)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheels").glob("lit_dtrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_dtrain/py.typed" in names and "lit_dtrain/callbacks/wsd.py" in names, sorted(names)[:20]
