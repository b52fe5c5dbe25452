"""Exact results of the optimizer factories (``optim/__init__.py``) and the model's parameter groups
(``module_params.py``) where single-point mutants passed test_module_optimizer.py, test_tensor_lr.py,
test_param_groups.py, test_predict.py and test_throughput.py (eighth hand mutation audit)."""

from __future__ import annotations

import torch

from lit_dtrain.optim import adamw


def test_fused_adamw_is_chosen_only_when_every_parameter_can_take_it():
    """``fused=None``: fused where every parameter is a floating CPU/CUDA tensor, else foreach. One parameter on
    another device (here ``meta``) is enough for foreach: a fused AdamW refuses it when built."""
    cpu = torch.nn.Parameter(torch.zeros(2))
    assert adamw([cpu]).defaults["fused"] is True
    mixed = adamw([cpu, torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert mixed.defaults["foreach"] is True and not mixed.defaults["fused"]


def test_a_weight_decay_of_zero_given_to_param_groups_is_the_decay_groups():
    """``param_groups(model, weight_decay=0.0)``: the matrices' group holds 0.0, which the optimizer keeps over its
    own default (AdamW's 0.1 here); a falsy 0.0 read as 'not given' trained the matrices with 0.1."""
    from lit_dtrain.module_params import param_groups

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    groups = adamw(param_groups(model, weight_decay=0.0), weight_decay=0.1).param_groups
    assert [(g["name"], g["weight_decay"], len(g["params"])) for g in groups] == [("decay", 0.0, 1),
                                                                                   ("no_decay", 0.0, 2)]
    groups = adamw(param_groups(model), weight_decay=0.1).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
