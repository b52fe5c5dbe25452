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
