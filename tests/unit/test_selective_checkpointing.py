"""SelectiveCheckpointing: gradient parity, memory and FLOPs actually change, block discovery, Lightning use.
(In a Trainer: test_selective_checkpointing_trainer.py; buffers, the budget probe's precision, blocks that never
run, compiled and shared blocks: test_selective_checkpointing_probes.py.)"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos import Transformer

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe
from lit_dtrain.callbacks._checkpoint_policies import (
    BlockProfile,
    apply_checkpointing,
    estimate_peak,
    every_k_plan,
    find_blocks,
    plan_budget,
    remove_checkpointing,
    resolve_ops,
    set_plan,
    uniform_plan,
)
from lit_dtrain.module import LitLLM
from lit_dtrain.utils.memory import measure_activation_memory, measure_backward_flops
from tests.unit._selective_ckpt_helpers import grads, loss_fn, make_model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 257, (2, 49), generator=torch.Generator().manual_seed(1))



# ---- gradient parity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["full", "every_k", "selective", "budget"])
def test_gradients_match_no_checkpointing(policy, ids):
    model = make_model()
    ref = grads(model, ids)
    blocks = [b for _, b in find_blocks(model)]
    wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"))
    if policy == "budget":
        plan, report = budget_plan_from_probe(loss_fn(model, ids), model, blocks, wrappers, 0.5)
        assert set(plan) - {"none"}, plan  # the budget forced some checkpointing
    else:
        plan = every_k_plan(len(blocks), 2) if policy == "every_k" else uniform_plan(len(blocks), policy)
        set_plan(wrappers, plan)
    got = grads(model, ids)
    diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
    assert diff <= 1e-6, (policy, diff)
    checkpointed = [w.calls for w, m in zip(wrappers, plan) if m != "none"]
    assert checkpointed and all(c >= 1 for c in checkpointed)  # the checkpointed path really ran


def test_every_k_counts_like_torchtitan():
    assert every_k_plan(5, 2) == ["none", "full", "none", "full", "none"]
    assert every_k_plan(3, 1) == ["full"] * 3
    with pytest.raises(ValueError, match="every_k"):
        every_k_plan(3, 0)


# ---- memory and FLOPs ----------------------------------------------------------------------------------------
def test_activation_memory_and_backward_flops_order(ids):
    model = make_model()
    blocks = [b for _, b in find_blocks(model)]
    wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"))
    act, flops, flops_mm = {}, {}, {}
    for mode in ("none", "selective", "full"):
        set_plan(wrappers, uniform_plan(len(blocks), mode))
        act[mode] = measure_activation_memory(lambda: loss_fn(model, ids)().backward(), model, blocks)
        model.zero_grad(set_to_none=True)
        flops[mode] = measure_backward_flops(loss_fn(model, ids), count_pointwise=True)
        flops_mm[mode] = measure_backward_flops(loss_fn(model, ids))
        model.zero_grad(set_to_none=True)
    # selective keeps part of the blocks' activations, full keeps only their inputs
    assert act["full"].peak_act < 0.5 * act["none"].peak_act
    assert act["full"].peak_act < act["selective"].peak_act < 0.8 * act["none"].peak_act
    for i in range(len(blocks)):
        assert act["full"].retained[i] < act["selective"].retained[i] < act["none"].retained[i]
    assert flops["none"] < flops["selective"] < flops["full"]
    # matmul-class FLOPs (FlopCounterMode's own registry): selective recomputes no matmul
    assert flops_mm["none"] == flops_mm["selective"] < flops_mm["full"]


def test_budget_plan_fits_and_uses_the_budget(ids):
    model = make_model()
    blocks = [b for _, b in find_blocks(model)]
    wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"))
    before = [p.detach().clone() for p in model.parameters()]
    plan, report = budget_plan_from_probe(loss_fn(model, ids), model, blocks, wrappers, 0.6)
    assert report["fits"] and report["measured_ratio"] <= 0.6
    assert report["measured_ratio"] > report["full_ratio"]  # did not just checkpoint everything
    assert [w.mode for w in wrappers] == plan
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no trace
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_budget_probe_seeds_only_the_generators_it_restores(ids, monkeypatch):
    """The probe reseeds before each measured pass inside ``fork_rng``, which restores the CPU generator and the
    probed parameters' CUDA generators. It reseeded with ``torch.manual_seed``, which also reseeds every CUDA
    device's generator (and MPS/XPU's), none of which it restored: on a GPU the run's dropout stream after the
    probe was no longer the one it would have had without it. Checked here through the global seeding calls."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the probe reseeded a generator that fork_rng does not restore")

    model = make_model()
    blocks = [b for _, b in find_blocks(model)]
    wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", forbidden)
    monkeypatch.setattr(torch, "manual_seed", forbidden)
    torch.random.default_generator.manual_seed(123)
    state = torch.get_rng_state()
    _, report = budget_plan_from_probe(loss_fn(model, ids), model, blocks, wrappers, 0.6)
    assert report["fits"]
    assert torch.equal(torch.get_rng_state(), state)  # the CPU stream is where it was


def test_plan_budget_prefers_cheap_recompute():
    prof = BlockProfile(retained={"none": 10.0, "selective": 5.0, "full": 1.0},
                        recompute={"none": 0.0, "selective": 1.0, "full": 4.0})
    profiles = [prof] * 4
    assert plan_budget(profiles, 0.0, 40.0)[0] == ["none"] * 4
    plan, est = plan_budget(profiles, 0.0, 31.0)  # two selective blocks (30) cost less than one full (31)
    assert plan == ["selective", "selective", "none", "none"] and est == estimate_peak(profiles, plan, 0.0) == 30.0
    # four selective blocks hold 20, but recomputing the last one brings its 10 back on top of 15
    assert estimate_peak(profiles, ["selective"] * 4, 0.0) == 25.0
    plan, est = plan_budget(profiles, 0.0, 2.0)  # below all-full's estimate: all full, caller warns
    assert plan == ["full"] * 4 and est > 2.0


def test_plan_budget_breaks_a_recompute_tie_towards_the_plan_that_uses_more_of_the_budget():
    """Equal recompute time (one full block costs 4, as two selective ones): the plan that holds more memory within
    the budget is taken, as documented, not the one that saves memory for nothing."""
    prof = BlockProfile(retained={"none": 10.0, "selective": 5.0, "full": 1.0},
                        recompute={"none": 0.0, "selective": 2.0, "full": 4.0})
    profiles = [prof] * 4
    assert estimate_peak(profiles, ["selective", "none", "none", "none"], 0.0) == 35.0  # the cost-2 plan misses 33
    assert estimate_peak(profiles, ["selective", "selective", "none", "none"], 0.0) == 30.0
    assert plan_budget(profiles, 0.0, 33.0) == (["full", "none", "none", "none"], 31.0)


# ---- discovery and errors ------------------------------------------------------------------------------------
def test_no_matching_blocks_names_pattern_and_lists_modules():
    module = LitLLM(make_model())
    with pytest.raises(ValueError, match=r"'model\.layers\.\*' matched no module") as e:
        find_blocks(module, "model.layers.*")
    assert "model.blocks" in str(e.value) and "model.tok_embeddings" in str(e.value)
    with pytest.raises(ValueError, match="nn.ModuleList named 'blocks'"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    names = [n for n, _ in find_blocks(module, "model.blocks.*")]
    assert names == [f"model.blocks.{i}" for i in range(4)] == [n for n, _ in find_blocks(module)]
    demo = torch.nn.Module()  # the docs' example: Lightning's demo Transformer as `self.model`, blocks 4 dots deep
    demo.model = Transformer(vocab_size=10, ninp=8, nhead=2, nhid=8, nlayers=2)
    with pytest.raises(ValueError, match=r"matched no module") as e:  # it listed model.transformer.encoder, no deeper
        find_blocks(demo, "model.layers.*")
    assert ("Its nn.ModuleLists, as patterns: model.transformer.encoder.layers.* (2 x TransformerEncoderLayer), "
            "model.transformer.decoder.layers.* (2 x TransformerDecoderLayer)") in str(e.value)


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="policy"):
        SelectiveCheckpointing(policy="sometimes")
    with pytest.raises(ValueError, match="aten.not_an_op"):
        SelectiveCheckpointing(save_ops=["aten.mm", "aten.not_an_op"])
    with pytest.raises(ValueError, match="memory_budget"):
        SelectiveCheckpointing(policy="budget", memory_budget=1.5)
    with pytest.raises(ValueError, match="probe_batch_size must be an integer >= 1, got 0"):  # was accepted
        SelectiveCheckpointing(policy="budget", probe_batch_size=0)
    with pytest.raises(ValueError, match="probe_seq_len must be an integer >= 1 or None, got 0"):
        SelectiveCheckpointing(policy="budget", probe_seq_len=0)
    assert torch.ops.aten.mm in resolve_ops(["aten.mm"])
    assert torch.ops.aten.mm.default in resolve_ops(["aten.mm.default"])


def test_state_dict_keys_unchanged_and_removable(ids):
    model = make_model()
    keys = list(model.state_dict())
    blocks = [b for _, b in find_blocks(model)]
    apply_checkpointing(blocks, uniform_plan(len(blocks), "selective"))
    assert list(model.state_dict()) == keys  # checkpoints load with and without checkpointing
    remove_checkpointing(blocks)
    assert all("forward" not in b.__dict__ for b in blocks)


class DebugFlagBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, debug=False, early_stop=None):
        y = self.lin(x)
        return 2 * y if debug else y


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_block_keywords_reach_the_block_and_checkpoint_positionally(mode, monkeypatch):
    """``block(x=x, debug=True)`` under checkpointing: torch.utils.checkpoint took ``debug`` as its own argument (so
    ``full`` silently computed without it and ``selective`` raised), and it takes the device RNG states it replays
    in recomputation from positional tensors only (on a GPU, ``layer(hidden_states=x)`` got other dropout masks)."""
    import lit_dtrain.callbacks._checkpoint_policies as policies

    positional = []

    def spy(fn, *args, **kwargs):
        positional.append(args)
        return policies.checkpoint.__wrapped__(fn, *args, **kwargs)

    spy.__wrapped__ = policies.checkpoint
    monkeypatch.setattr(policies, "checkpoint", spy)
    block, x = DebugFlagBlock(), torch.randn(2, 4, requires_grad=True)
    ref = block(x=x, debug=True, early_stop=1)
    ref.sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    apply_checkpointing([block], [mode])
    got = block(x=x, debug=True, early_stop=1)
    got.sum().backward()
    assert torch.equal(got, ref) and torch.equal(x.grad, ref_grad)
    assert len(positional) == 1 and any(a is x for a in positional[0])


def test_composes_with_torch_compile(ids):
    """Checkpointing first, then compile (aot_eager: dynamo + AOTAutograd, no C++ build; the inductor
    backend was checked by hand, see docs/activation_checkpointing.md)."""
    model = make_model()
    ref = grads(model, ids)
    blocks = [b for _, b in find_blocks(model)]
    for mode in ("selective", "full"):
        apply_checkpointing(blocks, uniform_plan(len(blocks), mode))
        torch._dynamo.reset()
        got = grads(torch.compile(model, backend="aot_eager"), ids)
        diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
        assert diff <= 1e-6, (mode, diff)
    torch._dynamo.reset()
