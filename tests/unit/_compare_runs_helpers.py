"""The compare_runs script loaded as a module, and the run writers shared by the test_compare_runs*.py files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "scripts" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_runs)


def write_run(run: Path, values: dict[int, float], overrides: list[str] | None = None, files: int = 1) -> Path:
    items = sorted(values.items())
    chunk = -(-len(items) // files)
    for i in range(files):  # a resumed run has several event files in one dir
        w = SummaryWriter(str(run / "tb"), filename_suffix=f".{i}")
        for step, v in items[i * chunk : (i + 1) * chunk]:
            w.add_scalar("val/loss", v, step)
            w.add_scalar("lr-AdamW/decay", 1e-3, step)
        w.close()
    if overrides:
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run
