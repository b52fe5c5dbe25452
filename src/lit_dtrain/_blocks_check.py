"""``callbacks.<name>.module_pattern`` of lit_dtrain's ``SelectiveCheckpointing`` that names no block of the model,
with the config checks: ``'callbacks=[default,selective_ckpt]' callbacks.selective_ckpt.module_pattern=model.layers.*``
was refused in the callback's ``setup``, inside fit, after 'Seed set to 1337', the corpus's tokenization and
``config_resolved.yaml``. lit_dtrain's own model is built on the meta device (no memory, no file; the seed is set
after) inside a ``LitLLM`` as the run's, and the callback's own ``find_blocks`` runs on it; a model or datamodule of
one's own is left to the callback (its ``__init__`` may do anything, and its module names are its own)."""

from __future__ import annotations

from omegaconf import DictConfig

from lit_dtrain.errors import ConfigError


def _is(target, obj) -> bool:
    """Whether the ``_target_`` ``target`` names ``obj`` (either of its spellings)."""
    from hydra._internal.utils import _locate

    try:
        return _locate(str(target)) is obj
    except Exception:  # noqa: BLE001 - not importable: refused with the config checks
        return False


def check_selective_checkpointing_blocks(cfg: DictConfig) -> None:
    """A ``ConfigError`` naming ``callbacks.<name>`` where its ``SelectiveCheckpointing`` finds no block to checkpoint
    in lit_dtrain's model (``build_llama``) inside the run's ``LitLLM`` (whose modules are ``model.*`` and one
    validation metric per ``data.sources`` entry), with the callback's own words (the modules seen)."""
    import torch
    from hydra.utils import instantiate
    from lightning.fabric.utilities.init import _EmptyInit

    from lit_dtrain.callbacks import SelectiveCheckpointing
    from lit_dtrain.callbacks._checkpoint_policies import find_blocks
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.models import build_llama
    from lit_dtrain.module import LitLLM

    nodes = {name: node for name, node in (cfg.get("callbacks") or {}).items()
             if isinstance(node, DictConfig) and _is(node.get("_target_"), SelectiveCheckpointing)}
    data, model = cfg.get("data"), cfg.get("model")
    if not nodes or not isinstance(model, DictConfig) or not _is(model.get("_target_"), build_llama) or \
            not isinstance(data, DictConfig) or not _is(data.get("_target_"), LMDataModule):
        return
    # _EmptyInit (Fabric.init_module(empty_init=True)'s): no torch.nn.init call, which on the meta device still ran
    # torch's Python reference of normal_ per weight: the check took 476 ms for model=llama_125m, 129 ms without
    with torch.device("meta"), _EmptyInit(enabled=True):
        root = LitLLM(instantiate(model), val_names=[f"val{i}" for i in range(len(data.get("sources") or ()))])
    for name, node in nodes.items():
        try:
            find_blocks(root, node.get("module_pattern"))
        except ValueError as e:  # (BlocksNotFound, ConfigError: a container matched) as the callback's setup words it
            raise ConfigError(f"callbacks.{name}: {SelectiveCheckpointing.__name__}: {e}") from None
