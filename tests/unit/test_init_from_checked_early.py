"""``init_from``'s file is checked before the seed (:func:`check_init_from`), not after the datamodule and the model
are built: a truncated, empty, foreign or non-finite file, or one of another model shape, was refused only once
``train()`` had tokenized the corpus and built the model (``Seed set to 1337`` printed first)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.models import build_llama
from lit_dtrain.schedules.workflows import check_init_from

SHAPE = dict(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=16)


def _saved(path, **shape):
    model = build_llama(**{**SHAPE, **shape})
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 3, "model_config": dataclasses.asdict(model.config)}, path)
    return path


def _check(path, model=None):
    model = {"_target_": "lit_dtrain.models.build_llama", **SHAPE} if model is None else model
    return check_init_from(OmegaConf.create({"init_from": str(path), "ckpt_path": None, "resume": None,
                                             "paths": {"checkpoint_dir": "/nonexistent"}, "model": model}))


def test_a_sound_file_of_the_configured_shape_passes(tmp_path):
    assert _check(_saved(tmp_path / "w.ckpt")) is True


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[: len(b) // 2], r"^init_from: checkpoint .*t\.ckpt' is truncated"),
    (lambda b: b"", r"^init_from: checkpoint .*t\.ckpt' is empty \(0 bytes\)"),
    (lambda b: b"hello\n", r"^init_from: checkpoint .*t\.ckpt' is not a torch checkpoint: it is text"),
])
def test_a_damaged_file_is_refused_before_the_build(tmp_path, damage, match):
    good = _saved(tmp_path / "w.ckpt").read_bytes()
    (tmp_path / "t.ckpt").write_bytes(damage(good))
    with pytest.raises(ConfigError, match=match):
        _check(tmp_path / "t.ckpt")


def test_a_file_without_model_weights_is_refused(tmp_path):
    torch.save({"a": 1}, tmp_path / "d.ckpt")
    with pytest.raises(ConfigError, match=r"^init_from: '.*d\.ckpt' has no 'state_dict'"):
        _check(tmp_path / "d.ckpt")


def test_non_finite_weights_are_refused(tmp_path):
    path = _saved(tmp_path / "n.ckpt")
    ckpt = torch.load(path)
    ckpt["state_dict"]["model.tok_embeddings.weight"][0, 0] = float("nan")
    torch.save(ckpt, path)
    with pytest.raises(ConfigError, match=r"has non-finite weights \(NaN/inf in 'tok_embeddings.weight'"):
        _check(path)


def test_another_model_shape_is_refused_naming_the_keys(tmp_path):
    path = _saved(tmp_path / "s.ckpt", d_model=32)
    with pytest.raises(ConfigError, match=r"^init_from: checkpoint .* it holds a model with d_model=32, .*"
                       r"this model has d_model=16.*set model\.d_model=32"):
        _check(path)


def test_a_model_that_does_not_build_is_left_to_the_real_build(tmp_path):
    """A model config that fails on the meta device (here: an unknown key) is named by the model's own build."""
    bad = {"_target_": "lit_dtrain.models.build_llama", **SHAPE, "no_such_key": 1}
    assert _check(_saved(tmp_path / "w.ckpt"), model=bad) is True
