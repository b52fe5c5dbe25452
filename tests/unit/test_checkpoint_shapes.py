"""A checkpoint of another model shape: one line naming the first mismatched key and both shapes, whichever way it
is given (ckpt_path, init_from, scripts/generate.py). torch's load_state_dict error lists every tensor on a line of
its own (48 lines for nano at another width), and the messages cut it at 600-800 characters, mid-line."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError, state_dict_mismatch
from lit_dtrain.errors import ConfigError
from lit_dtrain.models import build_llama
from lit_dtrain.schedules.workflows import load_model_weights
from tests.conftest import load_script
from tests.unit.test_script_checkpoint_errors import script_error

SHAPE = dict(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_kv_head=1)
FIRST = r"'tok_embeddings.weight' is \[257, 32\] in the checkpoint, \[257, 16\] in the model \(\d+ of \d+ tensors"


def _checkpoint(path: Path, d_model: int = 32, n_layer: int = 2, model_config: dict | None = None) -> Path:
    """A LitLLM-like checkpoint of a model of width ``d_model``; ``model_config`` stored as given (None: none)."""
    model = build_llama(**{**SHAPE, "n_layer": n_layer}, d_model=d_model)
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 3}
    if model_config is not None:
        ckpt["model_config"] = model_config
    torch.save(ckpt, path)
    return path


def _one_line(message: str) -> str:
    assert "\n" not in message and "size mismatch for" not in message and len(message) < 400, message
    return message


def test_state_dict_mismatch_names_the_first_key_in_the_models_order():
    model = build_llama(**SHAPE, d_model=16).state_dict()
    assert state_dict_mismatch(dict(model), model) is None
    wide = build_llama(**SHAPE, d_model=32).state_dict()
    assert state_dict_mismatch(wide, model).startswith("'tok_embeddings.weight' is [257, 32]")
    deeper = build_llama(**{**SHAPE, "n_layer": 3}, d_model=16).state_dict()
    assert state_dict_mismatch(deeper, model).startswith("9 of the checkpoint's tensors are not in the model, the "
                                                         "first 'blocks.2.")
    assert state_dict_mismatch(model, deeper).startswith("9 of the model's tensors are not in the checkpoint, the "
                                                         "first 'blocks.2.")


def test_generate_names_the_first_tensor_that_does_not_fit_its_model_config(tmp_path, capsys):
    """generate.py builds the model from the checkpoint's model_config: weights of another width were 'the weights
    do not match its model_config: Error(s) in loading state_dict for Llama: ...' cut at 600 characters."""
    config = dataclasses.asdict(build_llama(**SHAPE, d_model=16).config)
    path = _checkpoint(tmp_path / "edited.ckpt", d_model=32, model_config=config)
    with script_error(capsys, rf"edited\.ckpt.*the weights do not match its model_config: {FIRST}"):
        load_script("generate").load_model(str(path))
    with pytest.raises(CheckpointError, match=FIRST):
        from lit_dtrain.schedules.workflows import model_from_checkpoint

        model_from_checkpoint(path)


def test_a_model_config_edited_to_another_size_is_refused_before_the_model_is_allocated(tmp_path, monkeypatch):
    """model_from_checkpoint (generate.py, spectrum.py) compared shapes with a model it had built in full: a
    model_config edited to d_model=4096 and many layers took 69 s and 5.3 GB before the same refusal. The shapes are
    now read off a model on the meta device; a real model is only built for weights that fit it."""
    import lit_dtrain.models as models
    from lit_dtrain.schedules.workflows import model_from_checkpoint

    built = []
    real_build = models.build_llama
    monkeypatch.setattr(models, "build_llama", lambda **kw: built.append(real_build(**kw)) or built[-1])
    config = dataclasses.asdict(build_llama(**SHAPE, d_model=16).config)
    path = _checkpoint(tmp_path / "edited.ckpt", d_model=16, model_config={**config, "d_model": 64, "n_layer": 6})
    with pytest.raises(CheckpointError, match=r"the weights do not match its model_config: 'tok_embeddings.weight'"):
        model_from_checkpoint(path)
    assert [next(m.parameters()).device.type for m in built] == ["meta"]
    built.clear()
    model, _ = model_from_checkpoint(_checkpoint(tmp_path / "fits.ckpt", d_model=16, model_config=config))
    assert [next(m.parameters()).device.type for m in built] == ["meta", "cpu"] and model is built[-1]
    assert torch.equal(model.tok_embeddings.weight, torch.load(tmp_path / "fits.ckpt")["state_dict"]
                       ["model.tok_embeddings.weight"])


def test_init_from_without_model_config_names_the_first_tensor_that_does_not_fit(tmp_path):
    """A checkpoint without model_config (nothing to compare the config with) of another width or depth."""
    model = build_llama(**SHAPE, d_model=16)
    wide = _checkpoint(tmp_path / "wide.ckpt", d_model=32)
    fit = "does not fit the configured model"
    with pytest.raises(ConfigError, match=rf"init_from='.*wide\.ckpt' {fit} .*{FIRST}") as e:
        load_model_weights(model, wide)
    _one_line(str(e.value))
    deep = _checkpoint(tmp_path / "deep.ckpt", d_model=16, n_layer=3)
    extra = r"9 of the checkpoint's tensors are not in the model, the first 'blocks\.2\."
    with pytest.raises(ConfigError, match=rf"deep\.ckpt' .*{extra}") as e:
        load_model_weights(model, deep)
    _one_line(str(e.value))


def test_resume_from_a_checkpoint_of_another_width_without_model_config_is_one_line(tiny_cfg, tmp_path):
    from lit_dtrain.train import train

    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2",
                             "model.d_model=64", run="wide"))
    ckpt = torch.load(Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    del ckpt["model_config"]  # a checkpoint of an older lit_dtrain: Lightning's strict load is what refuses it
    path = tmp_path / "no_config.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError) as info:
        train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=4", f"ckpt_path={path}", run="narrow"))
    message = _one_line(str(info.value))
    assert message.startswith(f"checkpoint {str(path)!r} does not fit the configured model"), message
    assert "'model.tok_embeddings.weight' is [257, 64] in the checkpoint, [257, " in message, message
    assert "(set model.* to the shape of the run that wrote it)" in message, message


def test_resume_from_a_checkpoint_of_another_model_says_that_alone(tiny_cfg, caplog):
    """model=small's 2-step checkpoint resumed with model=nano warned 'its LR for step 2 is [0, 0] ... jumps up
    without a re-warmup' (the resume's LR check read the file first) before the model-mismatch error, the one thing
    wrong: the model is checked first, on the meta device, and the LR check never runs."""
    from lit_dtrain.train import train

    common = ("sample.max_new_tokens=0", "trainer.val_check_interval=2")
    _, objs = train(tiny_cfg(*common, "trainer.max_steps=2", "model.d_model=64", run="wide"))
    path = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointError) as info:
        train(tiny_cfg(*common, "trainer.max_steps=4", f"ckpt_path={path}", run="narrow"))
    assert _one_line(str(info.value)).startswith(f"checkpoint {str(path)!r} does not fit the configured model: it "
                                                 "holds a model with d_model=64"), info.value
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("lit_dtrain.schedules")]


def test_a_checkpoint_of_this_shape_with_other_tensor_names_does_not_advise_model_overrides(tiny_cfg, tmp_path):
    """A checkpoint whose model_config is the configured shape but whose tensor names are another model code's (a
    tensor renamed): the error told the user to 'set model.* to the shape of the run that wrote it', which it
    already was; now it says other model code wrote it (resume and init_from alike)."""
    from lit_dtrain.train import train

    common = ("sample.max_new_tokens=0", "trainer.val_check_interval=2")
    _, objs = train(tiny_cfg(*common, "trainer.max_steps=2", run="src"))
    ckpt = torch.load(Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    weights = ckpt["state_dict"]
    weights["model.blocks.0.attention_norm.weight"] = weights.pop("model.blocks.0.attn_norm.weight")
    path = tmp_path / "renamed.ckpt"
    torch.save(ckpt, path)
    code = r"\(its model_config is this shape, so another version of the model code wrote it: load it with that code\)"
    with pytest.raises(CheckpointError, match=rf"^checkpoint '.*renamed\.ckpt' does not fit the configured model "
                                              rf"{code}.*: 1 of the model's tensors are not in the checkpoint, the "
                                              r"first 'model\.blocks\.0\.attn_norm\.weight'") as info:
        train(tiny_cfg(*common, "trainer.max_steps=4", f"ckpt_path={path}", run="resumed"))
    assert "set model.*" not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=rf"^init_from='.*renamed\.ckpt' does not fit the configured model {code}"):
        load_model_weights(objs["model"], path)
