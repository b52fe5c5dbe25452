"""``SelectiveCheckpointing``'s ``module_pattern`` that names no block of lit_dtrain's model is refused with the config
checks, before the seed, in the callback's own words: it was refused in its ``setup``, inside fit, after the seed,
the corpus's tokenization and ``config_resolved.yaml``."""

from pathlib import Path

import pytest

from lit_dtrain.errors import ConfigError

SEEN = ("Modules seen: model, model.tok_embeddings, model.blocks, model.blocks.0, model.blocks.1, model.norm, "
        "model.lm_head, val_loss, val_loss_by_source, val_loss_by_source.0")


@pytest.mark.parametrize(("pattern", "line"), [
    ("model.layers.*", "callbacks.selective_ckpt: SelectiveCheckpointing: module_pattern 'model.layers.*' matched no "
                       f"module of LitLLM. {SEEN}. Its nn.ModuleLists, as patterns: model.blocks.* (2 x Block)"),
    ("model.blocks", "callbacks.selective_ckpt: SelectiveCheckpointing: module_pattern 'model.blocks' matched "
                     "model.blocks, which has no forward of its own (a container such as nn.ModuleList is never "
                     "called); match its children, e.g. 'model.blocks.*'"),
])
def test_a_module_pattern_naming_no_block_is_refused_before_the_seed(tiny_cfg, monkeypatch, pattern, line):
    import lightning as L

    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    cfg = tiny_cfg("callbacks=[default,selective_ckpt]", f"callbacks.selective_ckpt.module_pattern={pattern}")
    with pytest.raises(ConfigError) as refused:
        train(cfg)
    assert str(refused.value) == line
    assert not (Path(cfg.paths.output_dir) / "config_resolved.yaml").exists()


def test_a_module_pattern_naming_the_blocks_passes_the_check(tiny_cfg, monkeypatch):
    """The blocks matched on the meta-device model are the run's: the check passes and the run goes on to the seed."""
    import lightning as L

    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("passed the checks"))
    with pytest.raises(pytest.fail.Exception, match="passed the checks"):
        train(tiny_cfg("callbacks=[default,selective_ckpt]", "callbacks.selective_ckpt.module_pattern=model.blocks.*"))


def test_the_meta_build_runs_no_weight_init(tiny_cfg, monkeypatch):
    """The check needs the model's module names, not its weights: no ``torch.nn.init`` call reaches a tensor (on the
    meta device each still ran torch's Python reference of ``normal_``: the check took 476 ms for model=llama_125m,
    129 ms without them)."""
    import torch

    from lit_dtrain._blocks_check import check_selective_checkpointing_blocks

    drawn = []
    normal_ = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: drawn.append(tuple(t.shape)) or normal_(t, *a, **k))
    check_selective_checkpointing_blocks(tiny_cfg("callbacks=[default,selective_ckpt]"))
    assert drawn == []
