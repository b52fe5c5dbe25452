"""A plain optimizer's state (a DDP or single-device checkpoint) resumed under FSDP, each parameter's state its own.

A plain ``Optimizer.state_dict()`` numbers the parameters in the optimizer's order: its param groups one after
another (``LitLLM``'s decay group, then its no-decay group). Lightning's ``FSDPStrategy`` reads numbered states as
numbered in the *model's* order (``FSDP.rekey_optim_state_dict(..., PARAM_NAME, model)``, as its own full
checkpoints are written), so a DDP checkpoint resumed with ``strategy=fsdp`` gave 38 of the nano model's 47 parameters
another parameter's Adam moments: on 2 gloo ranks the first step's fused Adam read past a moment of the wrong size,
a segmentation fault (exit status 139); in tests/dist/test_fsdp_fit_then_validate.py 'The size of tensor a (48)
must match the size of tensor b (2048)'; where the sizes happen to match, the moments are wrong without a word.
Here the numbers are matched to parameters through the param groups, position by position, as
``Optimizer.load_state_dict`` itself matches them, and renumbered in the model's order before Lightning reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def in_model_order(state: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                   model: torch.nn.Module) -> dict[str, Any] | None:
    """``state`` (an ``Optimizer.state_dict()`` numbered in any order its param groups spell) renumbered in the order
    of ``model.parameters()``; None where it is numbered so already (a full checkpoint FSDP wrote), or where the groups
    do not match ``optimizer``'s (left to Lightning and torch, which say so)."""
    position = {p: i for i, p in enumerate(model.parameters())}
    saved_groups, groups = state.get("param_groups", []), optimizer.param_groups
    if len(saved_groups) != len(groups) or any(len(s["params"]) != len(g["params"])
                                               for s, g in zip(saved_groups, groups)):
        return None
    if any(p not in position for g in groups for p in g["params"]):
        return None
    renumber = {saved: position[p] for s, g in zip(saved_groups, groups) for saved, p in zip(s["params"], g["params"])}
    if all(old == new for old, new in renumber.items()):
        return None
    return {
        "state": {renumber[k]: v for k, v in state["state"].items()},
        "param_groups": [{**s, "params": [renumber[i] for i in s["params"]]} for s in saved_groups],
    }


def renumber_in_model_order(checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer],
                            model: torch.nn.Module) -> None:
    """Renumber, in place, each numbered optimizer state of ``checkpoint`` in the model's order
    (:func:`in_model_order`), before Lightning's FSDP strategy reads it as so numbered."""
    states = checkpoint.get("optimizer_states") or []
    for i, (state, optimizer) in enumerate(zip(states, optimizers)):
        if state.get("state") and isinstance(next(iter(state["state"])), int):
            renumbered = in_model_order(state, optimizer, model)
            if renumbered is not None:
                states[i] = {**state, **renumbered}
