"""lit_dtrain.run_dirs.hydra_overrides: a run's overrides as Hydra and train.py write them (YAML)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import OmegaConf

from lit_dtrain.run_dirs import hydra_overrides

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "scripts" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def test_an_override_that_yaml_quotes_or_folds_keeps_its_text(tmp_path):
    """'+strategy.compressor={name: topk, ratio: 0.05}' is quoted in overrides.yaml (it holds ': '), and a long one
    is folded over lines: read line by line, the first kept its quotes (compare_runs labelled the run
    "compressor={name: topk, ratio: 0.05}'", a stray quote), the second was cut at its first line."""
    long = "data.sources.0.paths=[" + ", ".join(f"/corpus/shard_{i:03d}/*.txt" for i in range(12)) + "]"
    runs = {}
    for name, extra in [("topk", ["+strategy.compressor={name: topk, ratio: 0.05}", long]), ("int8", [])]:
        run = tmp_path / name
        (run / ".hydra").mkdir(parents=True)
        overrides = OmegaConf.create(["model=nano", "~strategy.compressor", *extra])
        OmegaConf.save(overrides, run / ".hydra" / "overrides.yaml")
        runs[name] = run
    assert "'" in (runs["topk"] / ".hydra" / "overrides.yaml").read_text()  # YAML did quote it
    assert hydra_overrides(runs["topk"]) == [
        "model=nano", "~strategy.compressor", "+strategy.compressor={name: topk, ratio: 0.05}", long]
    assert compare_runs.make_labels([runs["topk"], runs["int8"]])[0].startswith("compressor={name: topk, ratio: 0.05} ")
