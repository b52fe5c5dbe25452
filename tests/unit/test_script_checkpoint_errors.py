import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["generate", "spectrum"])
def test_scripts_name_a_missing_or_unreadable_checkpoint_without_a_traceback(tmp_path, script):
    spec = importlib.util.spec_from_file_location(f"_{script}_ckpt_err", ROOT / "scripts" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit, match="nope.ckpt.*does not exist"):
        mod.load_model(str(tmp_path / "nope.ckpt"))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="garbage.ckpt"):
        mod.load_model(str(garbage))
