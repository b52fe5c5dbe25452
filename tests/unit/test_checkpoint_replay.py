"""Eager recomputation must replay what forward saw besides its ops: dropout masks (also after a saved random op)
and the block's buffers; compiled checkpointing must keep the masks too."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe
from lit_dtrain.callbacks._checkpoint_policies import apply_checkpointing, every_k_plan, set_plan, uniform_plan
from lit_dtrain.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=257, block_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=64, dropout=0.2)
IDS = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(1))


def llama() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


def loss_fn(model):
    return lambda: F.cross_entropy(model(IDS[:, :-1]).flatten(0, 1), IDS[:, 1:].flatten())


def grads(model, forward) -> list[torch.Tensor]:
    """Gradients of two steps from one seed (the second step's masks come after the first's)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    for _ in range(2):
        forward().backward()
    return [p.grad.clone() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("policy", ["full", "every_k", "selective", "mixed", "budget"])
def test_dropout_gradients_equal_no_checkpointing(policy):
    model = llama()
    ref = grads(model, loss_fn(model))
    wrappers = apply_checkpointing(list(model.blocks), uniform_plan(3, "none"))
    if policy == "budget":
        plan, _ = budget_plan_from_probe(loss_fn(model), model, list(model.blocks), wrappers, 0.5)
        assert set(plan) - {"none"}, plan
    else:
        plan = {"every_k": every_k_plan(3, 2), "mixed": ["full", "selective", "none"]}.get(policy) or \
            uniform_plan(3, policy)
        set_plan(wrappers, plan)
    assert max_diff(grads(model, loss_fn(model)), ref) == 0.0  # same masks, same ops: bit for bit
    assert all(w.calls >= 2 for w, m in zip(wrappers, plan) if m != "none")


@functools.cache
def compiled_reference() -> list[torch.Tensor]:
    """Gradients of the compiled run without checkpointing, compiled once for every mode below (a compile costs
    more than the rest of such a test)."""
    torch._dynamo.reset()
    try:
        model = llama()
        return grads(model, loss_fn(torch.compile(model, backend="aot_eager")))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dropout_gradients_equal_no_checkpointing_compiled(mode):
    """Under torch.compile (aot_eager: dynamo + AOTAutograd's partitioner) the compiled run with checkpointing
    matches the compiled run without it (inductor was checked by hand: docs/activation_checkpointing.md)."""
    ref = compiled_reference()
    try:
        model = llama()
        apply_checkpointing(list(model.blocks), uniform_plan(3, mode))
        torch._dynamo.reset()
        assert max_diff(grads(model, loss_fn(torch.compile(model, backend="aot_eager"))), ref) <= 1e-6
    finally:
        torch._dynamo.reset()


def two_blocks(block: type[nn.Module], width: int):
    """``(model, forward)``: two blocks in a row and a closure giving the loss of one fixed input."""
    torch.manual_seed(0)
    model = nn.Sequential(block(), block())
    x = torch.randn(4, width)
    return model, lambda: model(x).square().sum()


class SavedRandomOpBlock(nn.Module):
    """A random op whose output ``selective`` saves, then dropout (recomputed): on a GPU, SDPA's flash/efficient
    kernel with ``dropout_p > 0`` (in the default save list) followed by the residual dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l1(x) * torch.bernoulli(torch.full((16,), 0.7))
        return F.dropout(self.l2(h).relu(), 0.3, training=True)


def test_a_saved_random_op_does_not_change_the_masks_recomputed_after_it():
    """The saved op is not run again in recomputation, so it drew nothing there and the dropout after it got another
    mask than forward applied: gradients off by 1.13 (max abs), silently."""
    model, forward = two_blocks(SavedRandomOpBlock, 16)
    ref = grads(model, forward)
    wrappers = apply_checkpointing(list(model), uniform_plan(2, "selective"), ["aten.addmm", "aten.bernoulli"])
    assert max_diff(grads(model, forward), ref) == 0.0
    assert [w.calls for w in wrappers] == [2, 2]


class CountingBlock(nn.Module):
    """Reads a buffer it updates in its forward (a step counter, a running normalizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.lin(x) * (self.n + 0)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_reads_the_buffers_forward_read(mode):
    """Recomputation ran on the buffers forward had already updated (n = 2 instead of 1 in the first step): gradients
    off by 7.6 (max abs), silently. The update still counts once."""
    model, forward = two_blocks(CountingBlock, 8)
    ref = grads(model, forward)
    assert [float(b.n) for b in model] == [2.0, 2.0]
    for b in model:
        b.n.zero_()
    wrappers = apply_checkpointing(list(model), uniform_plan(2, mode))
    assert max_diff(grads(model, forward), ref) == 0.0
    assert [float(b.n) for b in model] == [2.0, 2.0]  # one update per forward, none in recomputation
    assert [w.calls for w in wrappers] == [2, 2]


class GRUBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.GRU(8, 8, batch_first=True), nn.Linear(8, 8)])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x)[0])


def test_a_block_that_writes_into_a_saved_output_is_refused_in_its_first_forward() -> None:
    """nn.GRU on a CPU runs sigmoid_/tanh_/add_ on unsafe_split views of its addmm, whose output the selective policy
    saves; torch's version check does not see those writes, so backward read the changed values: gradients 17-26% off
    the uncheckpointed ones, without an error. The block's forward is refused now; the Linear block (no such write)
    and 'full' (no saved outputs) are exact."""
    from lit_dtrain.errors import ConfigError

    model, x = GRUBlocks(), torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(2))
    plain = grads(model, lambda: model(x).pow(2).sum())
    apply_checkpointing(list(model.blocks), ["selective", "selective"])
    with pytest.raises(ConfigError, match=r"in the forward of a GRU block, aten.add_.Tensor writes in place into the "
                                          r"output of aten.addmm.default, which the selective policy saves, .*"
                                          r"checkpoint the GRU blocks with policy='full'"):
        model(x)
    apply_checkpointing(list(model.blocks), ["full", "selective"])
    assert max_diff(grads(model, lambda: model(x).pow(2).sum()), plain) == 0.0


class SubclassWeightBlocks(nn.Module):
    """A Linear block whose weight is a wrapper tensor subclass (torch's TwoTensor: the form of DTensor's or a float8
    weight), then one that scales its Linear's output in place (``scale_in_place``)."""

    def __init__(self, scale_in_place: bool) -> None:
        from torch.testing._internal.two_tensor import TwoTensor

        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        weight = self.blocks[0].weight.detach()
        self.blocks[0].weight = nn.Parameter(TwoTensor(weight.clone(), weight.clone()))
        self.scale_in_place = scale_in_place

    def forward(self, x):
        h = self.blocks[0](x)
        if self.scale_in_place:
            h.mul_(2.0)
        return self.blocks[1](torch.relu(h))


def test_a_block_on_a_tensor_subclass_checkpoints_selectively_and_its_writes_are_checked() -> None:
    """The in-place check read a subclass's storage, which it has none of: a Lightning fit whose block had a TwoTensor
    weight (SelectiveCheckpointing(policy='selective')) failed in its first forward with 'Attempted to access the data
    pointer on an invalid python storage'. Its inner tensors' storages are read now: the gradients are exact, and a
    write into its saved addmm output is still refused."""
    from lit_dtrain.errors import ConfigError

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    model = SubclassWeightBlocks(scale_in_place=False)
    plain = grads(model, lambda: model(x).pow(2).sum())
    apply_checkpointing(list(model.blocks), ["selective", "selective"])
    assert max_diff(grads(model, lambda: model(x).pow(2).sum()), plain) == 0.0

    model = SubclassWeightBlocks(scale_in_place=True)
    apply_checkpointing([model], ["selective"])
    with pytest.raises(ConfigError, match=r"aten.mul_.Tensor writes in place into the output of aten.addmm.default"):
        model(x)


def test_a_block_on_a_subclass_that_does_not_flatten_checkpoints_selectively() -> None:
    """A wrapper subclass without ``__tensor_flatten__`` (torch's LoggingTensor, or one's own) has neither a storage
    nor inner tensors to read: a block with such a Linear weight failed its first forward under policy='selective'
    with 'Attempted to access the data pointer on an invalid python
    storage' still (full trained). Its storage is skipped by the in-place check: the gradients equal none's."""
    from torch.testing._internal.logging_tensor import LoggingTensor

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        model[0].weight = nn.Parameter(LoggingTensor(model[0].weight.detach().clone()))
        return model

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    model = build()
    model(x).pow(2).sum().backward()
    plain = [p.grad.elem if isinstance(p.grad, LoggingTensor) else p.grad for p in model.parameters()]
    model = build()
    apply_checkpointing([model], ["selective"])
    model(x).pow(2).sum().backward()
    checkpointed = [p.grad.elem if isinstance(p.grad, LoggingTensor) else p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))



@pytest.mark.parametrize("drawn", [False, True])
def test_the_rng_replay_runs_only_where_a_saved_random_op_drew(drawn, monkeypatch):
    """SDPA is a random op by its tag and ``selective`` saves it; with ``dropout_p=0`` (the ``nano`` default) it draws
    nothing, and the replay mode then only set each state to the one it had, at ~0.7 ms of CPU per block and step (a
    second Python mode over every recomputed op). It is entered only where a generator moved (a saved ``bernoulli``);
    gradients stay bit for bit those without checkpointing."""
    from lit_dtrain.callbacks import _checkpoint_replay

    entered = []
    real_enter = _checkpoint_replay._ReplayRngStates.__enter__
    monkeypatch.setattr(_checkpoint_replay._ReplayRngStates, "__enter__",
                        lambda self: entered.append(self) or real_enter(self))
    if drawn:
        model, forward = two_blocks(SavedRandomOpBlock, 16)
        blocks, save_ops = list(model), ["aten.addmm", "aten.bernoulli"]
    else:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**{**CFG.__dict__, "dropout": 0.0}))
        forward, blocks, save_ops = loss_fn(model), list(model.blocks), None
    ref = grads(model, forward)
    apply_checkpointing(blocks, uniform_plan(len(blocks), "selective"), save_ops)
    assert max_diff(grads(model, forward), ref) == 0.0
    assert len(entered) == (2 * len(blocks) if drawn else 0)  # each block at each of the two backwards
