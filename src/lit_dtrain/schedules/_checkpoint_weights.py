"""Model weights out of a checkpoint: ``init_from``'s check and load, and the model ``scripts/generate.py`` and
``scripts/spectrum.py`` rebuild from a file alone. Importable from :mod:`lit_dtrain.schedules.workflows` too."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from lit_dtrain.checkpoint import (
    CheckpointError,
    checkpoint_files,
    misfit_advice,
    not_a_file_reason,
    safe_torch_load,
    state_dict_mismatch,
    weights_loaded_otherwise,
)
from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.schedules.workflows")  # the workflows' logger: one name to filter


def check_init_from(cfg: DictConfig) -> bool:
    """Reject ``init_from`` combined with ``ckpt_path`` (a full resume) or a missing file; returns whether the weights
    are to be loaded. Not when ``resume=auto`` finds this run's own checkpoints: the run continues from them, and the
    ``init_from`` file, no longer read, may be gone (a requeued job whose source checkpoint was cleaned up failed)."""
    path = cfg.get("init_from")
    if not path:
        return False
    if cfg.get("ckpt_path"):
        raise ConfigError(
            f"init_from={str(path)!r} and ckpt_path={str(cfg.ckpt_path)!r} are both set: set either init_from (weights "
            "only: fresh optimizer, schedule and step) or ckpt_path (a full resume)"
        )
    if cfg.get("resume") == "auto" and checkpoint_files(Path(str(cfg.paths.checkpoint_dir))):
        log_once(log, logging.INFO, "init_from: not read, resume=auto continues this run's own checkpoints")
        return False
    target = Path(str(path)).expanduser()
    if not target.is_file():
        raise ConfigError(f"init_from={str(path)!r} {not_a_file_reason(target)}")
    _check_before_the_build(cfg.get("model"), path)
    return True


def _check_before_the_build(model_cfg, path) -> None:
    """:func:`_checked_weights` against ``model_cfg`` built on the meta device (no storage): a truncated, empty or
    foreign ``init_from`` file, or one of another shape, was refused only after the seed, the datamodule (a corpus's
    tokenization) and the model's build. A model that cannot be built without storage is left to the real build."""
    from hydra.utils import instantiate

    try:
        with torch.device("meta"):
            model = instantiate(model_cfg)
    except Exception:  # a bad model config: check_config named it; a model of one's own: the real build checks
        return
    if isinstance(model, torch.nn.Module):
        _checked_weights(getattr(model, "_orig_mod", model), path, mmap=True)


def checkpoint_weights(ckpt, path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The model weights of a loaded :class:`~lit_dtrain.module.LitLLM` checkpoint: its ``state_dict`` entries under
    ``prefix`` (LitLLM keeps the model at ``self.model``) with a ``torch.compile`` ``_orig_mod.`` segment dropped.
    :class:`~lit_dtrain.checkpoint.CheckpointError` naming ``path`` when there are none."""
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{str(path)!r} has no 'state_dict'; is it a Lightning checkpoint of lit_dtrain's LitLLM?"
        )
    weights = {k[len(prefix):].replace("_orig_mod.", ""): v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise CheckpointError(f"{str(path)!r} has no weights under {prefix!r}; keys: {sorted(state)[:5]}")
    return weights


def model_from_checkpoint(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """``(model in eval mode, checkpoint dict)``: the model built from the checkpoint's ``model_config`` with all of
    its weights loaded strictly (a checkpoint without them must not give a random init), all finite.
    :class:`~lit_dtrain.checkpoint.CheckpointError` naming the file for a missing, damaged or foreign one."""
    from lit_dtrain.models import build_llama

    ckpt = safe_torch_load(Path(str(path)).expanduser())
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_config"), dict):
        raise CheckpointError(f"{str(path)!r} has no 'model_config'; was it written by lit_dtrain's LitLLM?")
    weights = checkpoint_weights(ckpt, path)
    try:  # a model_config of another version (an unknown key) or a damaged one: one line, not a traceback
        with torch.device("meta"):  # shapes only: a model_config edited to d_model=4096 allocated 5.3 GB in 69 s first
            shapes = build_llama(**ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r}: its model_config does not build a model: {e}") from e
    mismatch = state_dict_mismatch(weights, shapes.state_dict()) or weights_loaded_otherwise(weights, shapes)
    if mismatch:
        raise CheckpointError(f"{str(path)!r}: the weights do not match its model_config: {mismatch}")
    model = build_llama(**ckpt["model_config"])
    model.load_state_dict(weights)
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:  # a diverged run's: generate.py drew from NaN logits; spectrum.py plotted NaN losses and exited 0
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} (step {ckpt.get('global_step')}) has non-finite weights "
                              f"({bad[0]}{more}): the run diverged; use an earlier checkpoint of it")
    return model.eval(), ckpt


def load_model_weights(model: torch.nn.Module, path: str | Path, prefix: str = "model.") -> list[str]:
    """Load only the model weights (:func:`checkpoint_weights`) of a Lightning checkpoint of
    :class:`~lit_dtrain.module.LitLLM` into ``model``, strictly; returns the loaded keys. The optimizer, scheduler,
    step and data position of the checkpoint are ignored. A checkpoint whose ``model_config`` gives the weights
    another meaning (heads regrouped: n_head and n_kv_head changed together keep every shape) is refused, as a
    resume refuses it."""
    target = getattr(model, "_orig_mod", model)
    weights = _checked_weights(target, path, prefix)
    target.load_state_dict(weights, strict=True)
    log_once(log, logging.INFO, "init_from: loaded %d weight tensors from %s (optimizer, step and data start fresh)",
             len(weights), path)
    return sorted(weights)


def _checked_weights(target: torch.nn.Module, path: str | Path, prefix: str = "model.", mmap: bool = False) -> dict:
    """The weights :func:`load_model_weights` loads into ``target``, after every check of them (a damaged or foreign
    file, non-finite weights, another shape or meaning); ``target`` may be on the meta device (the check before the
    seed, :func:`check_init_from`), read ``mmap``-ed then."""
    from lit_dtrain.module import check_model_config  # lit_dtrain.module imports lit_dtrain.schedules

    try:
        ckpt = safe_torch_load(Path(str(path)).expanduser(), mmap=mmap)
        weights = checkpoint_weights(ckpt, path, prefix)
        check_model_config(ckpt, getattr(target, "config", None), path)
    except CheckpointError as e:
        raise ConfigError(f"init_from: {e}") from e
    bad = next((k for k, t in weights.items() if t.is_floating_point() and not t.isfinite().all()), None)
    if bad is not None:  # the run started from NaN weights: it stopped at its first step, or trained NaN on
        raise ConfigError(f"init_from={str(path)!r} has non-finite weights (NaN/inf in {bad!r}, the first such "
                          "tensor): a diverged run saved it; give an earlier checkpoint")
    mismatch = state_dict_mismatch(weights, target.state_dict())
    if mismatch:
        raise ConfigError(
            f"init_from={str(path)!r} does not fit the configured model ({misfit_advice(ckpt, target)}): {mismatch}"
        )
    otherwise = weights_loaded_otherwise(weights, target)
    if otherwise:
        raise ConfigError(f"init_from={str(path)!r}: {otherwise}")
    return weights
