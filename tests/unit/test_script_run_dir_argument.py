"""generate.py and spectrum.py given a run dir (or its checkpoints/) name the checkpoint file to give instead."""

from __future__ import annotations

import importlib.util
import json
import re
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


def test_a_run_dir_given_to_ckpt_path_or_init_from_names_the_file_to_give(tiny_cfg, tmp_path):
    """`python train.py ckpt_path=<run dir>` (and init_from=) said only "is a directory; give a checkpoint file in
    it"; it names the last.ckpt there (the scripts' load did), else the newest checkpoint file."""
    import os

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.schedules.workflows import check_init_from
    from lit_dtrain.train import resolve_ckpt_path

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for i, name in enumerate(["step000004-val5.1000.ckpt", "step000002-val5.3000.ckpt"]):
        (run / "checkpoints" / name).write_bytes(b"x")
        os.utime(run / "checkpoints" / name, (1000 - i, 1000 - i))  # step 4 written last
    newest = run / "checkpoints" / "step000004-val5.1000.ckpt"
    with pytest.raises(ConfigError) as e:
        check_init_from(tiny_cfg(f"init_from={run}"))
    assert str(e.value) == f"init_from={str(run)!r} is a directory, not a checkpoint file; give a file in it, " \
                           f"e.g. {str(newest)!r}"
    (run / "checkpoints" / "last.ckpt").write_bytes(b"x")
    last = run / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=re.escape(f"give a file in it, e.g. {str(last)!r}")):
        resolve_ckpt_path(tiny_cfg(f"ckpt_path={run}"))
