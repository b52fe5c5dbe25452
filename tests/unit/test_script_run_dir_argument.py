"""generate.py and spectrum.py given a run dir (or its checkpoints/) name the checkpoint file to give instead."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["generate", "spectrum"])
@pytest.mark.parametrize("given", ["run", "run/checkpoints"])
def test_a_run_dir_names_its_last_checkpoint(tmp_path, capsys, script, given):
    """`generate.py outputs/runs/exp1` (the run dir, where the README's command gives its checkpoints/last.ckpt) said
    only 'is a directory, not a checkpoint file'; it now names the file to give."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    spec = importlib.util.spec_from_file_location(f"_{script}_run_dir", ROOT / "scripts" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit):
        mod.load_model(str(tmp_path / given))
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error == (f"checkpoint {str(tmp_path / given)!r} is a directory, not a checkpoint file; give a file in "
                     f"it, e.g. {str(tmp_path / 'run' / 'checkpoints' / 'last.ckpt')!r}")
