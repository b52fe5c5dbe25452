"""A checkpoint whose weights fit the model in shape but would load as other numbers than it holds: an integer entry
for a floating-point weight (``load_state_dict`` casts it) or tied entries that disagree (both are copied into one
tensor, the last wins). Both loaded silently (a hand-edited int64 ``wq.weight`` truncated; ``lm_head.weight`` read as
the embedding, so generate.py printed 20 spaces); each is one line naming the key, whichever way the file is given
(scripts/generate.py, init_from, ckpt_path)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError, weights_loaded_otherwise
from lit_dtrain.errors import ConfigError
from lit_dtrain.models import build_llama
from lit_dtrain.schedules.workflows import load_model_weights, model_from_checkpoint

SHAPE = dict(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=16)
INT = r"'blocks\.0\.attn\.wq\.weight' is int64 in the checkpoint, a floating-point weight in the model"
TIED = r"'tok_embeddings\.weight' and 'lm_head\.weight' are one tied tensor in the model \(tie_embeddings\) but differ"


def _checkpoint(path: Path, edit=None, **shape) -> Path:
    """A LitLLM-like checkpoint (``model.``-prefixed weights and ``model_config``), its weights passed to ``edit``."""
    model = build_llama(**{**SHAPE, **shape})
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if edit is not None:
        edit(weights)
    torch.save({"state_dict": {f"model.{k}": v for k, v in weights.items()}, "global_step": 3,
                "model_config": dataclasses.asdict(model.config)}, path)
    return path


def _to_int(weights):
    weights["blocks.0.attn.wq.weight"] = (weights["blocks.0.attn.wq.weight"] * 1000).long()


def _untie(weights):
    weights["lm_head.weight"] = torch.randn_like(weights["lm_head.weight"])


def test_weights_that_load_as_saved_pass_and_others_are_named():
    model = build_llama(**SHAPE)
    weights = dict(model.state_dict())
    assert "lm_head.weight" in weights and weights_loaded_otherwise(weights, model) is None
    half = {k: v.to(torch.bfloat16) for k, v in weights.items()}  # a bf16-true run's: a cast between float dtypes
    assert weights_loaded_otherwise(half, model) is None
    _to_int(weights)
    assert weights_loaded_otherwise(weights, model).startswith(INT.replace("\\", ""))
    untied = dict(model.state_dict())
    _untie(untied)
    assert weights_loaded_otherwise(untied, model).startswith(TIED.replace("\\", ""))
    assert weights_loaded_otherwise(untied, build_llama(**SHAPE, tie_embeddings=False)) is None  # two tensors there


@pytest.mark.parametrize(("edit", "why"), [(_to_int, INT), (_untie, TIED)])
def test_generate_and_init_from_refuse_weights_that_would_load_otherwise(tmp_path, edit, why):
    path = _checkpoint(tmp_path / "edited.ckpt", edit)
    with pytest.raises(CheckpointError, match=rf"edited\.ckpt': the weights do not match its model_config: {why}"):
        model_from_checkpoint(path)
    model = build_llama(**SHAPE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=rf"^init_from='.*edited\.ckpt': {why}") as info:
        load_model_weights(model, path)
    assert "\n" not in str(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing loaded
    fits = _checkpoint(tmp_path / "fits.ckpt")
    assert torch.equal(model_from_checkpoint(fits)[0].lm_head.weight, torch.load(fits)["state_dict"]
                       ["model.tok_embeddings.weight"])


def test_a_resume_from_a_checkpoint_with_an_integer_weight_is_refused(tiny_cfg, tmp_path):
    from lit_dtrain.train import train

    common = ("sample.max_new_tokens=0", "trainer.val_check_interval=2")
    _, objs = train(tiny_cfg(*common, "trainer.max_steps=2", run="src"))
    ckpt = torch.load(Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    key = "model.blocks.1.mlp.w2.weight"
    ckpt["state_dict"][key] = ckpt["state_dict"][key].to(torch.int64)
    path = tmp_path / "int.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError, match=rf"^checkpoint '.*int\.ckpt': '{key}' is int64 in the checkpoint, a "
                                              "floating-point weight in the model"):
        train(tiny_cfg(*common, "trainer.max_steps=4", f"ckpt_path={path}", run="resumed"))
