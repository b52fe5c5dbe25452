"""The parameters of the model that :class:`~lit_dtrain.module.LitLLM` trains: their shapes, recorded before a
sharding strategy wraps the model; their AdamW weight-decay groups; the optimizer built from those groups; and the
training FLOPs their sizes imply."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim import Optimizer

from lit_dtrain.optim import adamw
from lit_dtrain.utils.args import is_number, is_whole_float
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger(__name__)
_SHAPE_ATTR = "_lit_dtrain_shape"


def remember_parameter_shapes(model: nn.Module) -> None:
    """Tag each parameter with its shape, for :func:`param_groups` and :func:`estimate_train_flops`. Call it before a
    sharding strategy wraps the model: Lightning's FSDPStrategy (``use_orig_params=True``) keeps the parameter objects
    but leaves each as a 1-D view of this rank's shard on 2 or more ranks, and by then ``p.dim()`` and ``p.numel()``
    no longer tell a matrix from a norm weight, nor the model's size."""
    for p in model.parameters():
        setattr(p, _SHAPE_ATTR, tuple(p.shape))


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return getattr(p, _SHAPE_ATTR, tuple(p.shape))


def param_groups(model: nn.Module, weight_decay: float | None = None) -> list[dict]:
    """Two AdamW groups: matrices decay; norms, biases and embeddings (and tied heads) do not. A parameter's
    dimensions are those :func:`remember_parameter_shapes` recorded, if it was called (``LitLLM`` does)."""
    no_decay_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            no_decay_ids.add(id(module.weight))
    decay, no_decay = [], []
    for _name, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if not p.requires_grad:
            continue
        (no_decay if len(_shape(p)) < 2 or id(p) in no_decay_ids else decay).append(p)
    decay_group = {"params": decay, "name": "decay"}
    if weight_decay is not None:
        decay_group["weight_decay"] = weight_decay
    return [decay_group, {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(factory: Callable, model: nn.Module, gradient_clip_val: float | None, precision: str) -> Optimizer:
    """``factory(param_groups(model))``, the optimizer ``LitLLM`` trains with under these Trainer settings.

    A fused optimizer unscales its grads inside ``step()``, so Lightning refuses to clip them under a mixed
    precision (``MixedPrecision.clip_gradients``, bf16 included). When ``fused`` was left automatic
    (:func:`lit_dtrain.optim.adamw` with ``fused=None``) the foreach AdamW is built instead; an explicit
    ``fused=True`` is refused. ``scripts/bench_step.py``'s plain loop builds its optimizer here too.
    """
    optimizer = factory(param_groups(model))
    if getattr(optimizer, "_step_supports_amp_scaling", False) and gradient_clip_val and "mixed" in str(precision):
        ours = getattr(factory, "func", None) is adamw
        if ours and factory.keywords.get("fused") is None:
            optimizer = factory(param_groups(model), fused=False)  # fused was automatic: use foreach
        elif ours:
            raise ValueError(
                f"optimizer.fused=true cannot be combined with trainer.gradient_clip_val={gradient_clip_val} under "
                f"precision={precision}: a fused optimizer unscales its grads inside step(), so they cannot be "
                "clipped. Set optimizer.fused=null (or false), or trainer.gradient_clip_val=null")
        else:  # another factory: its own settings made a fused optimizer ('optimizer.fused' may not exist)
            raise ValueError(
                f"the optimizer built by optimizer._target_ ({type(optimizer).__name__}) unscales its grads inside "
                f"step() (a fused implementation), which cannot be combined with trainer.gradient_clip_val="
                f"{gradient_clip_val} under precision={precision}: they cannot be clipped. Build a non-fused one, or "
                "set trainer.gradient_clip_val=null")
    log_once(log, logging.INFO, "%s", describe_param_groups(optimizer, model))
    setattr(optimizer, _CONFIGURED_ATTR, [{k: g[k] for k in CONFIGURED_KEYS if k in g} for g in optimizer.param_groups])
    return optimizer


# param-group settings that come from the config (and build_optimizer's fused/foreach choice), not from a schedule
CONFIGURED_KEYS = ("weight_decay", "betas", "eps", "fused", "foreach")
_CONFIGURED_ATTR = "_lit_dtrain_configured"


def restore_configured_settings(optimizer: Optimizer) -> None:
    """Give each param group of an optimizer :func:`build_optimizer` made the :data:`CONFIGURED_KEYS` values it was
    built with, after a resume restored the checkpoint's: ``optimizer.load_state_dict`` keeps every group setting
    but the parameters, so ``ckpt_path=... optimizer.weight_decay=0.01`` (or other ``betas``, ``eps``) trained on with
    the checkpoint's 0.1 without a word, and a 32-true checkpoint's fused AdamW stayed fused under a mixed precision
    with clipping. The LR is the schedule's (``StepLambdaLR`` keeps the configured peaks). A value the checkpoint had
    otherwise is logged."""
    configured = getattr(optimizer, _CONFIGURED_ATTR, None)
    if configured is None or len(configured) != len(optimizer.param_groups):
        return
    changed = []
    for i, (group, settings) in enumerate(zip(optimizer.param_groups, configured)):
        for key, value in settings.items():
            if key in group and _as_tuple(group[key]) != _as_tuple(value) and key in ("weight_decay", "betas", "eps"):
                changed.append(f"{key}={_as_tuple(value)} in group {group.get('name', i)!r} (the checkpoint's: "
                               f"{_as_tuple(group[key])})")
            group[key] = value
    if changed:
        log_once(log, logging.INFO, "resuming with the configured optimizer settings: %s", "; ".join(changed))


def _as_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def describe_param_groups(optimizer: Optimizer, model: nn.Module) -> str:
    """One line: per param group its name, tensors, parameters (full sizes, :func:`remember_parameter_shapes`) and
    weight decay; the optimizer logs it when built, so that what an ``optimizer.weight_decay`` applies to is seen."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        params = group["params"]
        kinds = sorted({".".join(names.get(id(p), "?").split(".")[-2:]) for p in params})  # attn_norm.weight, ...
        shown = ", ".join(kinds[:8]) + (", ..." if len(kinds) > 8 else "")
        groups.append(f"{group.get('name', i)}: {len(params)} tensors, {sum(math.prod(_shape(p)) for p in params):,} "
                      f"parameters, weight_decay {group.get('weight_decay')} ({shown})")
    return f"optimizer {type(optimizer).__name__}, param groups: " + "; ".join(groups)


def estimate_train_flops(model: nn.Module, batch_size: int, seq_len: int) -> float:
    """Forward+backward FLOPs of one batch: 6 * params * tokens plus causal attention scores.

    The PaLM-appendix estimate with the attention term halved for the causal mask (PaLM's ``12 L d T`` per token
    counts the full T x T scores; nanoGPT's ``estimate_mfu`` and torchtitan count those too, so their MFU of the same
    run reads higher by ``6 L d T / (6 N + 6 L d T)``). An ``nn.Embedding``'s table is excluded (a lookup), unless it
    is tied to the LM head: its weight is also another module's parameter (or ``config.tie_embeddings`` says so).
    The attention term needs the depth and width from ``model.config``: ``n_layer`` (or ``num_hidden_layers``) and
    ``d_model`` (or nanoGPT's ``n_embd``, Hugging Face's ``hidden_size``), or, where the config gives ``head_dim``,
    the query heads' width ``n_head`` (``num_attention_heads``) x ``head_dim`` (Qwen3-0.6B: 16 x 128 = 2048 for a
    ``hidden_size`` of 1024; read as the width, the term was half of what ran); a model without them gets ``6 N`` alone.
    Parameter sizes are the full ones (:func:`remember_parameter_shapes`), not a shard's: every rank computes the
    whole model. The forward pass alone (a validation batch) is a third of it: 2 FLOPs per parameter and token,
    backward 4.
    """
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    n_params = sum(math.prod(_shape(p)) for p in model.parameters())
    tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}  # a shared one once
    n_params -= sum(math.prod(_shape(w)) for w in tables.values() if not _tied(model, w, config))
    tokens = batch_size * seq_len
    flops = 6.0 * n_params * tokens
    n_layer = _config_value(config, "n_layer", "num_hidden_layers")
    width = _config_value(config, "d_model", "n_embd", "hidden_size")
    heads, head_dim = _config_value(config, "n_head", "num_attention_heads"), _config_value(config, "head_dim")
    if heads is not None and head_dim is not None:  # the query heads' width, which QK^T and AV run at
        width = heads * head_dim
    if n_layer is not None and width is not None:
        flops += 6.0 * n_layer * width * seq_len * tokens  # QK^T and AV, fwd+bwd, causal half
    return flops


def _tied(model: nn.Module, weight: nn.Parameter, config) -> bool:
    """Whether an embedding's ``weight`` is also a parameter of a module that is no embedding (a tied LM head, which
    multiplies it; another embedding sharing it only looks rows up). A user's model that tied its head without a
    ``config.tie_embeddings`` had the head's FLOPs left out (GPT-2 small's 38.6M of 124M parameters)."""
    if getattr(config, "tie_embeddings", False):
        return True
    return any(any(p is weight for p in m.parameters(recurse=False))
               for m in model.modules() if not isinstance(m, nn.Embedding))


def _config_value(config, *names: str) -> int | None:
    """The first of ``names`` that ``config`` has as a positive integer (a nanoGPT ``GPTConfig`` names the width
    ``n_embd``: reading ``config.d_model`` raised ``AttributeError`` at a fit's first training batch), numpy's or a
    float that is exactly one as the config checks take them (``128.0`` from a JSON or YAML file, ``np.int64(128)``
    were passed over, and the estimate lost its attention term: 11.7 GFLOP for the nano's 13.8 of an 8 x 256 batch)."""
    for name in names:
        value = getattr(config, name, None)
        if (is_number(value, integer=True) or is_whole_float(value)) and value > 0:
            return int(value)
    return None
