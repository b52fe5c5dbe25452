"""LitLLM's checkpoints: the state dict of a compiled model, a checkpoint of another model shape, and a 64-true
checkpoint's float64 weights. (The module's logging and losses are in test_module.py.)"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.models import build_llama
from lit_dtrain.module import LitLLM
from tests.unit._module_helpers import tiny_lit, window_loader


def test_compiled_and_eager_modules_have_the_same_state_dict_keys() -> None:
    """``module.compile=true`` wrapped the model in an ``OptimizedModule``, so every key of its checkpoints gained an
    ``_orig_mod.`` segment: resuming one without compile (another machine, a debugging session), or a run started
    eagerly with compile, failed with 'Missing key(s) in state_dict'. The model is now compiled in place."""
    compiled, eager = tiny_lit(compile=True), tiny_lit()
    compiled.configure_model()
    assert compiled.model._compiled_call_impl is not None  # compiled (forward goes through torch.compile)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    eager.load_state_dict(compiled.state_dict())  # strict: every key matches
    compiled.load_state_dict(eager.state_dict())


def test_a_checkpoint_of_a_model_compiled_as_a_wrapper_loads_into_either_module() -> None:
    """Checkpoints written before the model was compiled in place hold ``model._orig_mod.*`` keys; they still load,
    and a LitLLM given a ``torch.compile`` wrapper by its caller loads either kind too."""
    source = tiny_lit()
    eager_state = source.state_dict()
    wrapped_state = {k.replace("model.", "model._orig_mod.", 1): v for k, v in eager_state.items()}
    wrapped = tiny_lit()
    wrapped.model = torch.compile(wrapped.model)
    for module in (tiny_lit(), tiny_lit(compile=True), wrapped):
        module.configure_model()
        for state in (eager_state, wrapped_state):
            checkpoint = {"state_dict": dict(state)}
            module.on_load_checkpoint(checkpoint)
            module.load_state_dict(checkpoint["state_dict"])  # strict
            got = {k.replace("_orig_mod.", ""): v for k, v in module.state_dict().items()}
            assert got.keys() == eager_state.keys()
            assert all(torch.equal(got[k], v) for k, v in eager_state.items())


def lit_of(**shape) -> LitLLM:
    config = dict(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_kv_head=2, d_model=16)
    return LitLLM(build_llama(**{**config, **shape}))


@pytest.mark.parametrize(
    "saved, configured, named",
    [
        ({}, {"n_head": 4, "n_kv_head": 4}, r"n_head=2, n_kv_head=2.*n_head=4, n_kv_head=4"),  # same weight shapes
        ({"tie_embeddings": False}, {"tie_embeddings": True}, r"tie_embeddings=False.*tie_embeddings=True"),
        ({}, {"d_model": 32}, r"d_model=16.*d_model=32"),  # was a wall of 'size mismatch' lines
    ],
)
def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_keys(saved, configured, named) -> None:
    """Resuming a checkpoint into a model of another shape: with heads regrouped (n_head and n_kv_head scaled
    together) or the embeddings tied, every tensor still fits, and the weights loaded silently into a model that
    computes something else. The checkpoint's ``model_config`` is now compared with the model's first."""
    source, target = lit_of(**saved), lit_of(**configured)
    checkpoint = {"state_dict": source.state_dict()}
    source.on_save_checkpoint(checkpoint)
    with pytest.raises(CheckpointError, match=rf"checkpoint.*{named}.*model\.\*"):
        target.on_load_checkpoint(checkpoint)


def test_a_checkpoint_with_another_block_size_or_rope_theta_still_loads() -> None:
    """Neither changes a weight's meaning or shape (RoPE tables are rebuilt from the config): context extension."""
    source, target = lit_of(), lit_of(block_size=64, rope_theta=500000.0)
    checkpoint = {"state_dict": source.state_dict()}
    source.on_save_checkpoint(checkpoint)
    target.on_load_checkpoint(checkpoint)
    target.load_state_dict(checkpoint["state_dict"])


def test_a_64_true_checkpoint_resumes_with_its_float64_weights(tmp_path: Path) -> None:
    """Lightning loads the weights before precision=64-true converts the module: they were copied into the fp32
    model (rounded) and the resumed run continued from fp32-rounded weights."""
    kw = dict(accelerator="cpu", precision="64-true", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    lit = tiny_lit()
    trainer = L.Trainer(max_steps=2, **kw)
    trainer.fit(lit, train_dataloaders=DataLoader(window_loader(4), batch_size=None))
    path = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(path)
    saved = {k: v.clone() for k, v in lit.model.state_dict().items()}
    assert all(v.dtype == torch.float64 for v in saved.values())
    assert any(not torch.equal(v, v.float().double()) for v in saved.values())  # not all fp32 values
    resumed = tiny_lit()
    L.Trainer(max_steps=2, **kw).fit(resumed, train_dataloaders=DataLoader(window_loader(4), batch_size=None),
                                         ckpt_path=path)  # restores only
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
