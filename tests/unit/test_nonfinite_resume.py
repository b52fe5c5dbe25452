"""A checkpoint of non-finite weights (written before AtomicCheckpointIO refused those saves, or by another tool) is
not resumed: resume=auto skips it with a warning naming it and takes the newest finite one, and an explicit ckpt_path
to it is a one-line CheckpointError naming the first bad tensor. Before, the run resumed the NaN weights and stopped
again at its first step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.errors import ConfigError
from lit_dtrain.train import resolve_ckpt_path


def _cfg(ckpt_dir: Path, **extra):
    return OmegaConf.create({"ckpt_path": None, "resume": "auto", "run_name": "r", **extra,
                             "paths": {"checkpoint_dir": str(ckpt_dir), "output_dir": str(ckpt_dir.parent)}})


def _save(path: Path, step: int, bad: bool = False) -> None:
    weights = {"model.a.weight": torch.ones(3), "model.b.weight": torch.tensor([1.0, float("nan") if bad else 2.0])}
    torch.save({"global_step": step, "state_dict": weights}, path)


def test_resume_auto_skips_a_checkpoint_of_nan_weights_for_the_newest_finite_one(tmp_path, caplog):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d / "step000002-val4.0000.ckpt", 2)
    _save(d / "step000004-val3.5000.ckpt", 4)
    _save(d / "last.ckpt", 6, bad=True)
    with caplog.at_level("WARNING", logger="lit_dtrain.train"):
        assert resolve_ckpt_path(_cfg(d)) == str(d / "step000004-val3.5000.ckpt")
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"skipped {d / 'last.ckpt'} (step 6): its weights are not finite (NaN/inf in 'model.b.weight')" in x
               for x in lines), lines
    assert any("last.ckpt (step 6) has non-finite weights (NaN/inf in 'model.b.weight'), skipped" in x
               for x in lines), lines


def test_resume_auto_with_only_nan_checkpoints_is_refused_naming_them(tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d / "last.ckpt", 6, bad=True)
    with pytest.raises(ConfigError, match=r"no checkpoint .* can be resumed \(checkpoint '.*last.ckpt' has non-finite "
                                          r"weights \(NaN/inf in 'model.b.weight'\)\); replace or remove it"):
        resolve_ckpt_path(_cfg(d))


def test_an_explicit_ckpt_path_of_nan_weights_is_one_line_naming_the_first_bad_tensor(tmp_path):
    other = tmp_path / "other.ckpt"
    _save(other, 6, bad=True)
    d = tmp_path / "run" / "checkpoints"
    for resume in (None, "auto"):  # resume=auto in a run dir without checkpoints reads ckpt_path
        with pytest.raises(CheckpointError) as e:
            resolve_ckpt_path(_cfg(d, ckpt_path=str(other), resume=resume))
        assert "\n" not in str(e.value)
        assert str(e.value).startswith(f"checkpoint '{other}' has non-finite weights (NaN/inf in 'model.b.weight'")
    _save(other, 6)
    assert resolve_ckpt_path(_cfg(d, ckpt_path=str(other), resume=None)) == str(other)


def test_init_from_a_checkpoint_of_nan_weights_is_refused_naming_the_first_bad_tensor(tmp_path):
    """init_from loaded NaN weights without a word: the run stopped at its first step (or trained NaN on)."""
    from lit_dtrain.models import build_llama
    from lit_dtrain.schedules.workflows import load_model_weights

    model = build_llama(vocab_size=257, block_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"][0] = float("inf")
    torch.save({"global_step": 3, "state_dict": state}, tmp_path / "nan.ckpt")
    with pytest.raises(ConfigError) as e:
        load_model_weights(model, tmp_path / "nan.ckpt")
    path = str(tmp_path / "nan.ckpt")
    assert str(e.value) == (f"init_from={path!r} has non-finite weights (NaN/inf in 'norm.weight', the first such "
                            "tensor): a diverged run saved it; give an earlier checkpoint")
