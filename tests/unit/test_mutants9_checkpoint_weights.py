"""Exact results of ``schedules/_checkpoint_weights.py`` where single-point mutants passed
test_checkpoint_loaded_as_saved.py, test_checkpoint_shapes.py, test_nonfinite_resume.py, test_resume_choice.py and
test_script_checkpoint_errors.py (ninth hand mutation audit): a compiled run's checkpoint (``_orig_mod.`` keys) and a
compiled model to load into, the ``model.`` prefix taken at the start of a key only, and the scripts' model in eval
mode (generate.py and spectrum.py measure it; dropout left on would change every number)."""

from __future__ import annotations

import dataclasses

import torch

from lit_dtrain.models import build_llama
from lit_dtrain.schedules.workflows import load_model_weights, model_from_checkpoint

SHAPE = dict(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=16, dropout=0.1)


def _saved(path, prefix="model.", extra=None, **shape):
    model = build_llama(**{**SHAPE, **shape})
    state = {f"{prefix}{k}": v.clone() for k, v in model.state_dict().items()}
    torch.save({"state_dict": {**state, **(extra or {})}, "global_step": 3,
                "model_config": dataclasses.asdict(model.config)}, path)
    return model


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_compiled_runs_checkpoint_loads_its_weights_in_eval_mode(tmp_path):
    """LitLLM with ``module.compile=true`` saves ``model._orig_mod.<name>``: the scripts' model holds those weights,
    and is in eval mode (its dropout off: two forwards give one result)."""
    saved = _saved(tmp_path / "c.ckpt", prefix="model._orig_mod.")
    model, ckpt = model_from_checkpoint(tmp_path / "c.ckpt")
    assert _same(model, saved) and ckpt["global_step"] == 3
    assert not model.training and not any(m.training for m in model.modules())
    x = torch.randint(0, 257, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_only_keys_that_start_with_the_prefix_are_model_weights(tmp_path):
    """A LitLLM of one's own with another submodule whose name holds ``model.`` (``teacher_model.``): its tensors
    are not the model's (taken, ``del.<name>`` failed the load)."""
    saved = _saved(tmp_path / "t.ckpt", extra={"teacher_model.w": torch.ones(2)})
    model, _ = model_from_checkpoint(tmp_path / "t.ckpt")
    assert _same(model, saved)
    fresh = build_llama(**SHAPE)
    assert len(load_model_weights(fresh, tmp_path / "t.ckpt")) == len(saved.state_dict()) and _same(fresh, saved)


def test_init_from_loads_into_a_compiled_model(tmp_path):
    """``init_from`` with ``module.compile=true``: the model handed over is torch.compile's wrapper, whose own
    state_dict keys carry ``_orig_mod.``; the weights go into the model inside it."""
    saved = _saved(tmp_path / "w.ckpt")
    inner = build_llama(**SHAPE)
    compiled = torch.compile(inner)  # (compiled lazily, at its first call: none here)
    names = load_model_weights(compiled, tmp_path / "w.ckpt")
    assert names == sorted(saved.state_dict()) and _same(inner, saved)


def test_init_from_is_skipped_only_where_resume_auto_finds_the_runs_own_checkpoints(tmp_path):
    """``resume=auto`` with checkpoints in the run's dir continues them (``init_from`` not read); checkpoints there
    without ``resume=auto`` (another ``resume``, or none) leave ``init_from`` to load, as does ``resume=auto`` in an
    empty dir."""
    from omegaconf import OmegaConf

    from lit_dtrain.schedules.workflows import check_init_from

    _saved(tmp_path / "w.ckpt")
    full, empty = tmp_path / "full", tmp_path / "empty"
    full.mkdir()
    empty.mkdir()
    (full / "last.ckpt").write_bytes(b"x")

    def loads(resume, directory) -> bool:
        return check_init_from(OmegaConf.create({"init_from": str(tmp_path / "w.ckpt"), "ckpt_path": None,
                                                 "resume": resume, "paths": {"checkpoint_dir": str(directory)}}))

    assert not loads("auto", full)
    assert loads(None, full) and loads("never", full) and loads("auto", empty)


def test_init_from_refuses_weights_whose_heads_the_model_config_groups_otherwise(tmp_path):
    """Saved with 2 heads of 8 and loaded into 4 heads of 4 (``d_model`` 16, every shape the same): the weights
    would load without a word and mean other heads, so ``init_from`` names the keys to set, as a resume does."""
    import pytest

    from lit_dtrain.errors import ConfigError

    _saved(tmp_path / "h.ckpt", n_kv_head=2)
    other = build_llama(**{**SHAPE, "n_head": 4, "n_kv_head": 4})
    with pytest.raises(ConfigError, match=r"^init_from: checkpoint .* it holds a model with n_head=2, n_kv_head=2, "
                       r"this model has n_head=4, n_kv_head=4.*set model\.n_head=2 model\.n_kv_head=2"):
        load_model_weights(other, tmp_path / "h.ckpt")
