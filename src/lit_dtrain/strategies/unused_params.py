"""Which parameters no rank used in the latest backward, under ``find_unused_parameters=True``.

``CompressedDDPStrategy`` puts back the error-feedback residual of such a parameter after the step (DDP discards what
the comm hook sent for it; see ``Compressor.keep_residuals``). It told them by ``.grad is None``, which holds only when
the optimizer's ``zero_grad`` sets gradients to None (torch's default). An optimizer zeroed in place
(``zero_grad(set_to_none=False)``, in a ``LightningModule.optimizer_zero_grad`` or a loop of one's own) keeps a
tensor of zeros there, which DDP leaves untouched for an unused parameter: its residual drained (a 2-rank sign-codec
fit: L1 6.07 -> 2.97 over a step in which the parameter was unused), and what was sent of it was lost. DDP's reducer
knows: its used map, all-reduced over the ranks at the end of each synchronized backward (and summed over the
``no_sync`` micro-batches before it), counts each parameter's uses. torch exposes it as the private
``Reducer._get_local_used_map`` (torch 2.13); without it the ``.grad is None`` rule is used alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor, nn


def reducer_parameter_ids(ddp_model: nn.parallel.DistributedDataParallel) -> list[int]:
    """``id()`` of the parameters of DDP's reducer, in its order. Call it at the wrap: it is torch's
    ``DistributedDataParallel._build_params_for_reducer`` (trainable, not ignored, a shared parameter once), replicated
    because that method also reassigns the model's buffers."""
    ignore = getattr(ddp_model, "parameters_to_ignore", set())
    ids: list[int] = []
    for module_name, module in ddp_model.module.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{param_name}" not in ignore and id(p) not in ids:
                ids.append(id(p))
    return ids


def globally_unused(ddp_model: nn.parallel.DistributedDataParallel, reducer_ids: Sequence[int],
                    named: Sequence[tuple[str, Tensor]], names: Mapping[int, str]) -> list[str]:
    """The names (``names``: ``id(p) -> name``) of the parameters of ``named`` that no rank used in the latest
    synchronized backward: ``.grad`` None, or a use count of 0 in the reducer's used map."""
    unused = {id(p) for _, p in named if p.grad is None}
    used_map = getattr(getattr(ddp_model, "reducer", None), "_get_local_used_map", None)
    counts = used_map() if used_map is not None else None
    if counts is not None and counts.numel() == len(reducer_ids):
        unused |= {i for i, count in zip(reducer_ids, counts.tolist()) if count == 0}
    return [names[id(p)] for _, p in named if id(p) in unused and id(p) in names]


# Lightning's advice for DDP's unused-parameter error (DDPStrategy.on_exception), which would replace this strategy
_PLAIN_DDP_ADVICE = "either by setting the string value `strategy='ddp_find_unused_parameters_true'`"


def advise_the_strategys_flag(exception: BaseException, strategy: str, config: str = "",
                              drops: str = "which compresses nothing") -> None:
    """Name ``strategy``'s own ``find_unused_parameters=True`` in Lightning's advice for DDP's unused-parameter error:
    its ``strategy='ddp_find_unused_parameters_true'`` is Lightning's plain ``DDPStrategy``, which would silently
    replace this one (the compressed one: no codec, no ``comm/bytes_per_step``; ``make_ddp``'s: no epoch-length
    check). ``config``: the train.py config group, ``drops``: what the plain one loses."""
    exception.args = tuple(arg.split(_PLAIN_DDP_ADVICE)[0] + (
        f"by passing this strategy's own flag, `{strategy}(..., find_unused_parameters=True)` (in train.py's config "
        f"{config}'+strategy.find_unused_parameters=true'); `strategy='ddp_find_unused_parameters_true'` would replace "
        f"it with Lightning's plain DDPStrategy, {drops}.") if isinstance(arg, str) and _PLAIN_DDP_ADVICE in arg
        else arg for arg in exception.args)
