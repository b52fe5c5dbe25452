"""Exact results of the pure checkpointing core (``callbacks/_checkpoint_policies.py``) where single-point mutants
passed test_selective_checkpointing*.py, test_checkpoint_budget.py, test_checkpoint_replay.py and
test_checkpoint_pickle.py (eleventh hand mutation audit)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.callbacks._checkpoint_policies import (
    BlockProfile,
    apply_checkpointing,
    find_blocks,
    plan_budget,
    set_plan,
    uniform_plan,
)
from lit_dtrain.utils.memory import measure_backward_flops
from tests.unit._selective_ckpt_helpers import grads, loss_fn, make_model


def test_selective_saves_the_ops_it_is_given_and_a_reapplied_list_replaces_the_old_one():
    """``save_ops=[]`` keeps no op's output, so ``selective`` recomputes every matmul, as ``full`` does; the default
    list keeps them all, so its backward recomputes none (matmul FLOPs as ``none``'s). A second
    ``apply_checkpointing`` on the same blocks takes the new list (the wrappers are reused: only mode and list
    change). The gradients are bitwise those of no checkpointing either way."""
    ids = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(1))
    model = make_model()
    ref = grads(model, ids)
    blocks = [b for _, b in find_blocks(model)]
    wrappers = apply_checkpointing(blocks, uniform_plan(4, "selective"), save_ops=[])
    flops = {"empty": measure_backward_flops(loss_fn(model, ids))}
    assert all(torch.equal(a, b) for a, b in zip(ref, grads(model, ids)))
    assert apply_checkpointing(blocks, uniform_plan(4, "selective")) == wrappers  # the default list, same wrappers
    flops["default"] = measure_backward_flops(loss_fn(model, ids))
    assert all(torch.equal(a, b) for a, b in zip(ref, grads(model, ids)))
    for mode in ("none", "full"):
        set_plan(wrappers, uniform_plan(4, mode))
        flops[mode] = measure_backward_flops(loss_fn(model, ids))
    assert flops["default"] == flops["none"] < flops["empty"] == flops["full"]


def test_a_block_runs_plainly_without_grad():
    """Validation and generation run under ``no_grad``: a checkpointed block then runs its own forward, counted
    nowhere (``calls`` and ``ran`` are the proof that checkpointing ran), with the plain block's output."""
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    model = make_model()
    with torch.no_grad():
        ref = model(ids)
    blocks = [b for _, b in find_blocks(model)]
    wrappers = apply_checkpointing(blocks, ["full", "selective", "full", "selective"])
    with torch.no_grad():
        assert torch.equal(model(ids), ref)
    assert [(w.calls, w.ran) for w in wrappers] == [(0, False)] * 4
    model(ids).sum().backward()
    assert [(w.calls, w.ran) for w in wrappers] == [(1, True)] * 4


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, scale=1.0, shift=0.0):
        return self.lin(x) * scale + shift


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_keywords_reach_the_block_by_name(mode):
    """A block called with one keyword (``layer(hidden_states=x)``) and with two of which the order matters: each
    reaches its own parameter, as without checkpointing (both are passed to ``checkpoint`` positionally)."""
    block, x = Affine(), torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    only = block(x=x)
    two = block(x, shift=3.0, scale=2.0)
    apply_checkpointing([block], [mode])
    assert torch.equal(block(x=x), only) and torch.equal(block(x, shift=3.0, scale=2.0), two)
    assert block.forward.calls == 2


def test_a_modulelist_inside_the_blocks_is_not_a_second_blocks_list():
    """``blocks`` is the ModuleList whose own name is ``blocks``: a mixture-of-experts block's ``experts`` list
    (path ``blocks.0.experts``) is not one, nor is a list named ``sub_blocks``."""

    class MoEBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
            self.sub_blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList([MoEBlock(), MoEBlock()])
    assert [(n, m) for n, m in find_blocks(root)] == [("blocks.0", root.blocks[0]), ("blocks.1", root.blocks[1])]


def test_set_plan_refuses_a_mode_it_does_not_know():
    """A mode that is not one of none/selective/full was taken and ran as ``full`` (anything but ``none`` and
    ``selective`` is recomputed whole): a typo in a plan switched nothing it named."""
    model = make_model()
    wrappers = apply_checkpointing([b for _, b in find_blocks(model)], uniform_plan(4, "none"))
    with pytest.raises(ValueError, match=r"checkpoint mode must be one of \('none', 'selective', 'full'\), got "
                                         r"'partial'"):
        set_plan(wrappers, ["none", "partial", "none", "none"])
    assert [w.mode for w in wrappers] == ["none"] * 4


def test_plan_budget_puts_full_before_selective():
    """Early blocks are recomputed last, when later blocks have freed theirs, so the family is ``full`` first, then
    ``selective``, then ``none``: at a budget of 21 the cheapest such plan holds 21 (1 + 5 + 5 + 10), where the same
    counts in the order selective, selective, full also hold 21 and cost the same."""
    prof = BlockProfile(retained={"none": 10.0, "selective": 5.0, "full": 1.0},
                        recompute={"none": 0.0, "selective": 1.0, "full": 4.0})
    assert plan_budget([prof] * 4, 0.0, 22.0) == (["full", "selective", "selective", "none"], 21.0)
    assert plan_budget([prof] * 4, 0.0, 17.0) == (["full", "full", "selective", "none"], 17.0)
