"""What README.md and docs/*.md name exists: every metric name they quote is one lit_dtrain logs, and every test
they cite (``tests/...py::test_name``) is a test of that file.

Both drift silently when code moves: a renamed metric leaves the docs pointing readers at a curve that TensorBoard
never shows, and a test moved to another file leaves a reliability row whose evidence cannot be found. These are
grep-level checks against the source, not runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FAMILIES = r"(?:train|val|validate|spike|fourier|comm|grad_clip|optim)/"
# a metric name inside backticks: `train/loss`, `val/stdlib/loss`, `lr-AdamW/decay` (not part of a path or a URL)
METRIC = re.compile(rf"(?<![\w./-])({FAMILIES}[\w/<>*.+-]*[\w>*]|lr-[\w/<>*.+-]*[\w>*])")

# Names the docs quote that are put together from pieces, so no single source string holds them: the file that
# builds each one and the pieces it must contain.
COMPOSED = {
    # AdaptiveGradClip: f"{prefix}{k}" over its last-step dict, prefix "grad_clip/" (one optimizer)
    "grad_clip/norm": ("src/lit_dtrain/callbacks/adaptive_grad_clip.py", ['"grad_clip/"', '"norm"']),
    "grad_clip/clipped": ("src/lit_dtrain/callbacks/adaptive_grad_clip.py", ['"grad_clip/"', '"clipped"']),
    "grad_clip/threshold": ("src/lit_dtrain/callbacks/adaptive_grad_clip.py", ['"grad_clip/"', '"threshold"']),
    "grad_clip/clip_events": ("src/lit_dtrain/callbacks/adaptive_grad_clip.py", ['"grad_clip/"', "clip_events"]),
    # Lightning's ThroughputMonitor, which lit_dtrain's token_throughput_monitor configures (items are tokens)
    "train/device/items_per_sec": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "items"]),
    "train/time": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "time"]),  # its <stage>/time
    # Lightning's LearningRateMonitor: lr-<optimizer class>/<param group name>, LitLLM's groups "decay"/"no_decay"
    "lr-AdamW/decay": ("src/lit_dtrain/module_params.py", ['"name": "decay"']),
    "lr-AdamW/no_decay": ("src/lit_dtrain/module_params.py", ['"name": "no_decay"']),
}
# Names quoted as the wrong input of an error example (docs/reliability.md row 6k: `monitor=val/los`).
WRONG_ON_PURPOSE = {"val/los"}


def _metric_templates() -> list[re.Pattern]:
    """A full-match pattern for every string lit_dtrain's source could log as a metric name: each string constant
    that is not a docstring, and each f-string that starts with a metric family (its fields match one name
    segment)."""
    templates = []
    for path in (ROOT / "src" / "lit_dtrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                templates.append(re.escape(node.value))
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                head = node.values[0].value
                if re.match(rf"{FAMILIES}|lr-", head):
                    templates.append("".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"[\w.+-]+"
                                             for v in node.values))
    return [re.compile(t) for t in set(templates)]


def documented_metric_names() -> dict[str, list[str]]:
    """Concrete metric names quoted in backticks or given to ``compare_runs.py --metric/--maximize`` (also in code
    blocks), each with where it is quoted; family names with placeholders (``spike/*``, ``val/<name>/loss``) are
    left out."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            quoted = [n for code in re.findall(r"`([^`]+)`", line) for n in METRIC.findall(code)]
            quoted += re.findall(r"--(?:metric|maximize)[ =]+([\w/.+-]+)", line)
            for name in quoted:
                if not any(mark in name for mark in ("<", "*", "...")) and name != "METRIC":
                    found.setdefault(name, []).append(f"{doc.name}:{lineno}")
    return found


def test_every_metric_name_the_docs_quote_is_logged_by_the_source():
    names = documented_metric_names()
    expected = {"train/loss", "val/loss", "spike/count", "comm/bytes_per_step", "fourier/lr_mult", "lr-AdamW/decay"}
    assert expected <= set(names)  # the extractor really finds them
    templates = _metric_templates()
    unknown = {}
    for name, where in names.items():
        if name in WRONG_ON_PURPOSE or any(t.fullmatch(name) for t in templates):
            continue
        if name in COMPOSED:
            path, pieces = COMPOSED[name]
            text = (ROOT / path).read_text()
            if all(piece in text for piece in pieces):
                continue
        unknown[name] = where
    assert unknown == {}, f"metric names quoted in the docs that no source logs: {unknown}"


def test_the_metric_check_tells_a_logged_name_from_a_misspelt_one():
    templates = _metric_templates()
    assert any(t.fullmatch("val/stdlib/loss") for t in templates)  # f"val/{name}/loss"
    assert any(t.fullmatch("spike/loss_z") for t in templates)
    for wrong in ("val/los", "spike/loss_zz", "comm/bytes", "val/stdlib/los", "train/device/items_per_sec"):
        assert not any(t.fullmatch(wrong) for t in templates), wrong


def documented_tests() -> list[tuple[str, str, str]]:
    """(where, file, test) of every cited test: ``tests/x.py::test_a`` and the ``::test_b`` that follow it in the
    same backticked list, which name tests of the last file named before them."""
    cited = []
    for doc in DOCS:
        last = None
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for code in re.findall(r"`([^`]+)`", line):
                match = re.fullmatch(r"(tests/[\w/]+\.py)?(?:::(\w+)(?:\[[^\]]*\])?)?", code.strip())
                if not match or not any(match.groups()):
                    continue
                last = match.group(1) or last
                if match.group(2) and last:
                    cited.append((f"{doc.name}:{lineno}", last, match.group(2)))
                elif match.group(1):
                    cited.append((f"{doc.name}:{lineno}", last, ""))
    return cited


def test_every_test_the_docs_cite_exists_in_the_file_they_name():
    cited = documented_tests()
    assert len([c for c in cited if c[2]]) > 100  # the extractor really finds them
    missing = []
    for where, file, test in cited:
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{where}: {file} does not exist")
        elif test and not re.search(rf"^\s*(?:async )?def {test}\(", path.read_text(), re.M):
            missing.append(f"{where}: {file} has no test {test}")
    assert missing == []


def test_every_test_the_docs_name_without_a_file_exists():
    """A bare ``test_name`` (or ``test_name[param]``) in backticks, cited without its file, is a test somewhere under
    tests/."""
    defined = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined.update(re.findall(r"^\s*(?:async )?def (test_\w+)\(", path.read_text(), re.M))
    named = {}
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for code in re.findall(r"`([^`]+)`", line):
                match = re.fullmatch(r"(test_\w+)(?:\[[^\]]*\])?", code.strip())
                if match:
                    named.setdefault(match.group(1), f"{doc.name}:{lineno}")
    assert len(named) >= 5  # the extractor really finds them
    assert {name: where for name, where in named.items() if name not in defined} == {}
