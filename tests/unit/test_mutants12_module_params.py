"""Tests that pin ``lit_dtrain.module_params`` where hand mutants passed its tests: the optimizer's log line of its
param groups (the ", ..." after 8 kinds, the full sizes under a sharding strategy), a resume's check of changed betas
(a list against the checkpoint's tuple is no change, nor is a fused choice reported), and ``model.config`` values that
are no positive integer."""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import torch
from torch import nn

from lit_dtrain.models import build_llama
from lit_dtrain.module_params import (
    build_optimizer,
    describe_param_groups,
    estimate_train_flops,
    remember_parameter_shapes,
    restore_configured_settings,
)
from tests.unit.test_flops_estimate import B, D, T, TinyGPT, V  # the tied head, with a config of one's own


class Matrices(nn.Module):
    """``n`` bias-free linears named ``l0``, ``l1``, ...: ``n`` kinds of tensor in the decay group."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.add_module(f"l{i}", nn.Linear(2, 2, bias=False))


@pytest.mark.parametrize("n", [8, 9])
def test_the_log_line_lists_eight_kinds_and_marks_only_more(n: int) -> None:
    """Up to 8 kinds are listed whole; ", ..." only says that more were left out (a 9th)."""
    model = Matrices(n)
    optimizer = torch.optim.SGD([{"params": list(model.parameters()), "name": "decay", "weight_decay": 0.1}], lr=0.1)
    kinds = sorted(f"l{i}.weight" for i in range(n))
    shown = ", ".join(kinds[:8]) + (", ..." if n == 9 else "")
    assert describe_param_groups(optimizer, model) == (
        f"optimizer SGD, param groups: decay: {n} tensors, {4 * n:,} parameters, weight_decay 0.1 ({shown})")


def test_the_log_line_counts_full_sizes_when_a_sharding_strategy_flattened_the_parameters() -> None:
    """Under FSDP (``use_orig_params=True``) each parameter is a 1-D view of this rank's shard: the line gives the
    model's sizes, the ones ``remember_parameter_shapes`` recorded (simulated by halving each parameter's data)."""
    model = build_llama(vocab_size=257, block_size=16, n_layer=2, n_head=2, n_kv_head=2, d_model=16)
    remember_parameter_shapes(model)
    want = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.data = p.data.flatten()[: max(1, p.numel() // 2)]
    optimizer = torch.optim.SGD([{"params": list(model.parameters()), "name": "all"}], lr=0.1)
    assert f"all: 20 tensors, {want:,} parameters" in describe_param_groups(optimizer, model)


def test_a_resume_with_the_same_betas_as_a_list_logs_no_change(caplog) -> None:
    """A group's ``betas`` restored as the list ``[0.9, 0.95]`` where the optimizer was built with the tuple
    ``(0.9, 0.95)``: the same betas, no line; other betas are one line, and the configured ones are set."""
    model = nn.Linear(4, 4)
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, betas=[0.9, 0.95], foreach=True)
    optimizer = build_optimizer(factory, model, None, "32-true")
    for group in optimizer.param_groups:
        group["betas"] = [0.9, 0.95]  # as the checkpoint's state restored it
    with caplog.at_level(logging.INFO, logger="lit_dtrain.module_params"):
        restore_configured_settings(optimizer)
    assert caplog.messages == []
    for group in optimizer.param_groups:
        group["betas"] = (0.8, 0.9)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.module_params"):
        restore_configured_settings(optimizer)
    assert len(caplog.messages) == 1 and "betas=(0.9, 0.95) in group 'decay'" in caplog.messages[0]
    assert [g["betas"] for g in optimizer.param_groups] == [(0.9, 0.95), (0.9, 0.95)]


def config(**values):
    return dataclasses.make_dataclass("C", [(k, type(v), v) for k, v in values.items()])()


SIX_N = 6.0 * (V * D + D * D + D) * B * T  # the tied table once, the body's weight and bias


@pytest.mark.parametrize("values", [
    {"n_layer": 0, "num_hidden_layers": 3, "d_model": D},  # a zero is no depth: the next name's is
    {"n_layer": 3, "n_head": 0, "head_dim": 8, "d_model": D},  # no query heads: the width is d_model's
    {"n_layer": True, "num_hidden_layers": 3, "d_model": D},  # a bool is no depth
    {"n_layer": 3, "d_model": True, "n_embd": D},  # nor a width
])
def test_a_config_value_that_is_no_positive_integer_is_passed_over(values) -> None:
    """``_config_value`` takes the first name that is a positive int: 3 layers of width D, 6 L d T per token."""
    assert estimate_train_flops(TinyGPT(True, config(**values)), B, T) == SIX_N + 6.0 * 3 * D * T * B * T


def test_a_config_without_positive_sizes_gets_six_n_alone() -> None:
    assert estimate_train_flops(TinyGPT(True, config(n_layer=0, d_model=D)), B, T) == SIX_N
    assert estimate_train_flops(TinyGPT(True, config(n_layer=False, d_model=D)), B, T) == SIX_N


def test_a_resume_that_changes_only_the_fused_choice_sets_it_without_a_line(caplog) -> None:
    """A checkpoint of a foreach AdamW (built under a mixed precision with clipping) resumed where the automatic
    choice is fused (32-true): ``fused``/``foreach`` are set to the build's, but only the configured settings a user
    gives (weight_decay, betas, eps) are reported as changed."""
    from lit_dtrain.optim import adamw

    optimizer = build_optimizer(functools.partial(adamw, lr=1e-3), nn.Linear(4, 4), 1.0, "32-true")
    built = [(g["fused"], g["foreach"]) for g in optimizer.param_groups]
    assert built == [(True, None), (True, None)]
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = None, True  # the checkpoint's
    with caplog.at_level(logging.INFO, logger="lit_dtrain.module_params"):
        restore_configured_settings(optimizer)
    assert caplog.messages == []
    assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == built
