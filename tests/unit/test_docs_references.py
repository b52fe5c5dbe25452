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
FAMILIES = r"(?:train|val|validate|spike|fourier|comm|grad_clip|optim|data/share)/"
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
    "train/batches": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "batches"]),
    "train/samples": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "samples"]),
    "train/lengths": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "lengths"]),
    "validate/samples": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "samples"]),  # <stage>/
    # ... and, on several ranks, its all-rank rates beside the per-device ones
    **{f"train/{k}_per_sec": ("src/lit_dtrain/callbacks/throughput.py", ["ThroughputMonitor", "world"])
       for k in ("items", "samples", "batches", "flops")},
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


def undocumented_tags(tags) -> list[str]:
    """The logged TensorBoard tags that no doc names: quoted whole in backticks (`epoch`), or by a quoted family
    with a ``/`` in it, where ``<...>`` stands for one name segment and ``*`` or ``...`` for the rest
    (`optim/<group>/grad_rms`, `train/device/*`, `lr-*`)."""
    quoted = {code for doc in DOCS for code in re.findall(r"`([^`\n]+)`", doc.read_text())}
    patterns = []
    for code in quoted:
        if "/" in code or code.startswith("lr-"):
            parts = re.split(r"(<[^>]+>|\*|\.\.\.)", code)
            patterns.append(re.compile("".join(
                r"[\w.+-]+" if p.startswith("<") else ".*" if p in ("*", "...") else re.escape(p) for p in parts)))
    return sorted(t for t in tags if t not in quoted and not any(p.fullmatch(t) for p in patterns))


# Every tag a default run with callbacks=[default,loss_spike,adaptive_grad_clip,optimizer_diagnostics] wrote to
# TensorBoard (read with EventAccumulator: its scalars, and its text tags by the names add_text was given, the
# end-of-run sample and a spike's event), and the all-rank throughput tags Lightning adds on 2 ranks.
RUN_TAGS = [
    "epoch", "grad_clip/clip_events", "grad_clip/clipped", "grad_clip/norm", "grad_clip/threshold",
    "lr-AdamW/decay", "lr-AdamW/no_decay", "memory/peak_rss_mib", "memory/rss_mib",
    "optim/decay/eps_dominated_frac", "optim/decay/grad_rms",
    "optim/decay/update_to_param_rms", "optim/no_decay/eps_dominated_frac", "optim/no_decay/grad_rms",
    "optim/no_decay/update_to_param_rms", "sample", "spike/count", "spike/events", "spike/loss_z", "train/batches",
    "train/device/batches_per_sec", "train/device/flops_per_sec", "train/device/items_per_sec",
    "train/device/samples_per_sec", "train/items_per_sec", "train/samples_per_sec", "train/batches_per_sec",
    "train/flops_per_sec", "validate/items_per_sec", "train/grad_norm", "train/lengths", "train/loss",
    "train/samples", "train/time",
    "train/tokens", "val/loss", "val/ppl", "validate/batches", "validate/device/batches_per_sec",
    "validate/device/flops_per_sec", "validate/device/items_per_sec", "validate/device/samples_per_sec",
    "validate/lengths", "validate/samples", "validate/time",
]


def test_every_tag_a_run_logs_is_named_in_the_docs():
    """The end-of-run sample went to TensorBoard's Text tab as `sample` with no doc saying so."""
    assert undocumented_tags(RUN_TAGS) == []
    assert undocumented_tags(["data/share/stdlib", "data/share/licenses"]) == []  # a mixture's (test_drawn_shares.py)
    # MemoryMonitor's on CUDA (tests/unit/test_memory_monitor.py)
    assert undocumented_tags(["memory/cuda_allocated_mib", "memory/cuda_peak_allocated_mib",
                              "memory/cuda_reserved_mib"]) == []
    assert undocumented_tags(["trian/loss", "lr_AdamW/decay", "my_tag"]) == ["lr_AdamW/decay", "my_tag", "trian/loss"]


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


def _config_keys() -> set[str]:
    """Every dotted key path the config files define (``data.sources.0.paths``, ``strategy.compressor.ratio``): a
    file of group ``a/b`` puts its keys under ``a.b`` or, as a nested option (``strategy=ddp_compressed/topk``),
    under ``a``; ``conf/train.yaml`` and ``# @package _global_`` files at the root."""
    import yaml

    def walk(node, prefix: str, out: set[str]) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            walk(value, path, out)

    keys: set[str] = set()
    for path in (ROOT / "conf").rglob("*.yaml"):
        rel = path.relative_to(ROOT / "conf")
        text = path.read_text()
        node = yaml.safe_load(text) or {}
        node = {k: v for k, v in node.items() if k != "defaults"}
        dirs = rel.parts[:-1]
        global_package = not dirs or "@package _global_" in text
        for prefix in [""] if global_package else [".".join(dirs[:i]) for i in range(1, len(dirs) + 1)]:
            walk(node, prefix, keys)
    return keys


# Dotted names the docs quote that start like a config key but are Python attributes, module paths or files.
NOT_CONFIG_KEYS = {
    "model.blocks", "model.layers", "model.tok_embeddings.weight", "model.transformer.encoder",
    "optimizer.step", "strategy.reduce", "data.pkl",
    "trainer.callback_metrics", "trainer.datamodule", "trainer.datamodule.sampler", "trainer.fit", "trainer.validate",
    "trainer.fit_loop.max_epochs",  # a Trainer attribute set before a second fit (callbacks_in_your_project.md)
    "trainer.estimated_stepping_batches", "trainer.global_step", "trainer.should_stop", "trainer.save_checkpoint",
    "callbacks.fault._target_", "callbacks.fault.step",  # added with '+' by the fault tests (docs/reliability.md)
    "trainer.overfit_batches", "trainer.enable_checkpointing",  # Lightning arguments the trainer config does not
    # list: added with '+' (6o)
    "trainer.min_steps",  # a Lightning argument the trainer config does not list: added with '+' (6g)
    "trainer.min_epochs", "trainer.max_epochs", "trainer.limit_train_batches",  # the same (6g)
    "strategy.broadcast_buffers",  # a DDP argument the strategy presets do not list: added with '+' (compressed_ddp)
}
WRONG_KEYS_ON_PURPOSE = {"optimizer.lrr", "sample.promt", "strategy.nme", "strategy.compresion",  # 6a: refused
                         # running.md: keys the config lacks, and what their one-line error says to do
                         "trainer.detect_anomaly", "callbacks.model_checkpoint.every_n_train_step",
                         "callbacks.model_checkpoint.every_n_train_steps", "callbacks.loss_spike.z",
                         "data.sources.name", "data.sources.5.name"}  # a list's key that is no index of it


def documented_config_keys(roots: set[str]) -> dict[str, list[str]]:
    """Config keys quoted in backticks in the prose and the code blocks (``module.check_finite=false``,
    ``data.max_val_windows``), each with where it is quoted; a key is a dotted name whose first part is a
    top-level config key (Hydra's own ``hydra.*`` left out)."""
    key = re.compile(rf"[+~]?((?:{'|'.join(sorted(roots - {'hydra'}))})(?:\.\w+)+)(?:=\S*)?")
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for code in re.findall(r"`([^`]+)`", line):
                if "(" in code:
                    continue  # a Python call (``warn_if_comm_state_dropped(checkpoint, trainer.strategy)``)
                for token in code.split():
                    match = key.fullmatch(token.strip("'\""))
                    if match:
                        found.setdefault(match.group(1), []).append(f"{doc.name}:{lineno}")
    return found


def test_every_config_key_the_docs_quote_exists():
    """The overrides in ``python train.py`` commands are composed by test_readme_commands.py; config keys quoted in
    prose were checked by hand only, so a renamed key left the docs telling readers to set one that Hydra refuses."""
    keys = _config_keys()
    assert {"data.max_val_windows", "strategy.compressor.ratio", "data.sampler.lag", "callbacks.loss_spike.actions",
            "data.sources.0.paths", "module.check_finite", "trainer.val_check_interval"} <= keys
    quoted = documented_config_keys({k.split(".")[0] for k in keys})
    assert len(quoted) > 60  # the extractor really finds them
    unknown = {k: where for k, where in quoted.items()
               if k not in keys and k not in NOT_CONFIG_KEYS | WRONG_KEYS_ON_PURPOSE}
    assert unknown == {}, f"config keys quoted in the docs that no config file defines: {unknown}"
    assert not (NOT_CONFIG_KEYS | WRONG_KEYS_ON_PURPOSE) & keys  # an exception that became a real key
