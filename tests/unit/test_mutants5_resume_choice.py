"""Gaps found by the fifth hand mutation audit of resume.py's roll-back check and resume=auto's choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.train import resolve_ckpt_path


def _cfg(ckpt_dir, ckpt_path, resume=None):
    return OmegaConf.create({"ckpt_path": str(ckpt_path), "resume": resume, "run_name": "r",
                             "paths": {"checkpoint_dir": str(ckpt_dir), "output_dir": str(Path(ckpt_dir).parent)}})


def _save(path: Path, step: int) -> None:
    torch.save({"global_step": step, "state_dict": {}}, path)


def test_a_step_file_at_last_ckpts_step_is_no_roll_back(tmp_path):
    """ckpt_path= the step file ModelCheckpoint wrote with last.ckpt (same step, same state) rolls nothing back:
    resume=auto would continue last.ckpt, the same step. Only strictly newer files are refused."""
    d = tmp_path / "r" / "checkpoints"
    d.mkdir(parents=True)
    _save(d / "step000004-val3.0000.ckpt", 4)
    _save(d / "step000008-val2.0000.ckpt", 8)
    _save(d / "last.ckpt", 8)
    assert resolve_ckpt_path(_cfg(d, d / "step000008-val2.0000.ckpt")) == str(d / "step000008-val2.0000.ckpt")
    with pytest.raises(ConfigError, match=r"back to step 4, but it holds newer checkpoints \(last.ckpt at step 8, "
                                          r"step000008-val2.0000.ckpt at step 8\)"):
        resolve_ckpt_path(_cfg(d, d / "step000004-val3.0000.ckpt"))


def test_a_roll_back_given_as_a_relative_path_is_refused_too(tmp_path, monkeypatch):
    """ckpt_path=r/checkpoints/<older step file> from the output root: the same file as its absolute path, so the
    same refusal. (Compared unresolved, the relative path would not be one of the run's own files: the roll-back
    would train, and a later resume=auto continue the abandoned newer steps.)"""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "r" / "checkpoints"
    d.mkdir(parents=True)
    _save(d / "step000004-val3.0000.ckpt", 4)
    _save(d / "last.ckpt", 8)
    for given in ("r/checkpoints/step000004-val3.0000.ckpt", "r/checkpoints/../checkpoints/step000004-val3.0000.ckpt"):
        with pytest.raises(ConfigError, match=r"back to step 4, but it holds newer checkpoints \(last.ckpt at step 8"):
            resolve_ckpt_path(_cfg(d, given))
        with pytest.raises(ConfigError, match=r"back to step 4"):  # with resume=auto too (a requeue-ready command)
            resolve_ckpt_path(_cfg(d, given, resume="auto"))
