"""The model-shape check of a checkpoint: ``model.*`` keys that give its weights another meaning.

``train()`` runs it first thing on a resume (:func:`check_the_resumed_model`), :class:`~lit_dtrain.module.LitLLM`
again as it loads the checkpoint, ``init_from`` (:mod:`lit_dtrain.schedules.workflows`) on the
weights it loads. Importable from :mod:`lit_dtrain.module` too.
"""

from __future__ import annotations

import dataclasses

from lit_dtrain.checkpoint import CheckpointError

# LlamaConfig keys that decide what the weights mean. A change of n_head and n_kv_head together (heads regrouped)
# or of tie_embeddings keeps every tensor's shape, so load_state_dict alone took such a checkpoint silently.
# block_size and rope_theta are free to change (context extension): the RoPE tables are rebuilt from the config.
WEIGHT_CONFIG_KEYS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "mlp_hidden", "tie_embeddings")


def check_model_config(checkpoint: dict, config, path=None) -> None:
    """:class:`CheckpointError` naming the keys when the checkpoint's ``model_config`` (stored by
    :meth:`LitLLM.on_save_checkpoint`) gives the weights another meaning than ``config`` (a model's dataclass
    config). Nothing to compare (no ``model_config``, a model without a dataclass config): no error."""
    saved = checkpoint.get("model_config") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict) or not dataclasses.is_dataclass(config):
        return
    differ = [k for k in WEIGHT_CONFIG_KEYS if k in saved and saved[k] != getattr(config, k, saved[k])]
    if not differ:
        return
    theirs = ", ".join(f"{k}={saved[k]}" for k in differ)
    ours = ", ".join(f"{k}={getattr(config, k)}" for k in differ)
    overrides = " ".join(f"model.{k}={saved[k]}" for k in differ)
    raise CheckpointError(
        f"checkpoint{f' {str(path)!r}' if path else ''} does not fit the configured model: it holds a model with "
        f"{theirs}, this model has {ours}. model.* must be the shape of the run that wrote it: set {overrides}"
    )


def check_weights_load_as_saved(state_dict, module, path=None) -> None:
    """:class:`CheckpointError` naming the key where a resume's ``state_dict`` would load into ``module`` (the
    LightningModule) as other numbers than it holds: an integer weight or disagreeing tied entries
    (:func:`~lit_dtrain.checkpoint.weights_loaded_otherwise`)."""
    from lit_dtrain.checkpoint import weights_loaded_otherwise

    why = weights_loaded_otherwise(state_dict, module) if isinstance(state_dict, dict) else None
    if why:
        raise CheckpointError(f"checkpoint{f' {str(path)!r}' if path else ''}: {why}")


def check_the_resumed_model(model_cfg, ckpt_path) -> None:
    """:func:`check_model_config` of a resume's checkpoint against ``model_cfg`` (``cfg.model``), built on the meta
    device (no storage), before anything else reads the checkpoint: a checkpoint of model=small resumed with
    model=nano gave the resume's LR warning ('its LR for step 2 is [0, 0] ... jumps up') before the model-mismatch
    error, which is the only thing wrong."""
    import torch
    from hydra.utils import instantiate

    from lit_dtrain.checkpoint import safe_torch_load

    try:
        with torch.device("meta"):
            model = instantiate(model_cfg)
    except Exception:  # a model that cannot be built without storage, or a bad config: the real build raises it
        return
    check_model_config(safe_torch_load(ckpt_path, mmap=True), getattr(model, "config", None), ckpt_path)
