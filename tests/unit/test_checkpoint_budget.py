"""The ``budget`` policy: the probe measures in the precision FSDP trains in (FSDP cannot run on CPU under Lightning:
a trainer stand-in carries FSDP's precision plugin), and a block called several times is estimated per call."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import FSDPPrecision

import lit_dtrain.callbacks._checkpoint_budget as checkpoint_budget
from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe
from lit_dtrain.callbacks._checkpoint_policies import BlockProfile, apply_checkpointing, estimate_peak, uniform_plan
from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.module import LitLLM
from tests.unit._selective_ckpt_helpers import fake_measurements, fake_probe, fit, lit_llm


@pytest.mark.parametrize("precision, dtype, autocast", [
    ("bf16-true", torch.bfloat16, False),  # FSDP converts the module to bf16 after setup: the probe ran in fp32
    ("bf16-mixed", torch.float32, True),  # FSDP's autocast is CUDA's only, and the probe runs before the move
    ("32-true", torch.float32, False),
])
def test_budget_probe_under_fsdp_precision(precision, dtype, autocast):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=257, block_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=64))
    module = LitLLM(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = SimpleNamespace(precision_plugin=FSDPPrecision(precision), datamodule=None,
                              strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, torch.is_autocast_enabled("cpu"))))
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.5, probe_batch_size=2)
    cb.setup(trainer, module, "fit")
    assert seen and set(seen) == {(dtype, autocast)}  # (under autocast the residual stream stays fp32)
    after = module.state_dict()  # the probe gave the fp32 weights back, bit for bit
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert cb.budget_report is not None and len(cb.plan) == 3


def test_a_block_called_three_times_is_recomputed_one_call_at_a_time():
    """Its ``retained`` sums its calls; the estimate brought all of them back at once on recomputation."""
    shared = BlockProfile(retained={"none": 30.0, "selective": 15.0, "full": 3.0}, calls=3)
    assert estimate_peak([shared], ["full"], base=0.0) == 2.0 + 10.0  # two calls' inputs held, one call recomputed
    assert estimate_peak([BlockProfile(retained=shared.retained)], ["full"], base=0.0) == 30.0  # one call: as before


def test_budget_estimate_of_a_shared_block_is_near_its_measurement():
    """Block 1 called three times: all-``full`` was estimated at 0.647 of ``none`` and measured at 0.208, so a 0.5
    budget got all-``full`` where ``full, full, none`` (0.311) fits."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=3, d_model=64, n_head=4, n_kv_head=2, block_size=128))
    b = model.blocks
    model.blocks = torch.nn.ModuleList([b[0], b[1], b[1], b[1], b[2]])
    ids = torch.randint(0, 257, (2, 129), generator=torch.Generator().manual_seed(0))
    blocks = [b[0], b[1], b[2]]
    wrappers = apply_checkpointing(blocks, uniform_plan(3, "none"))
    plan, report = budget_plan_from_probe(
        lambda: F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()), model, blocks, wrappers, 0.5
    )
    assert report["full_ratio"] < 0.4 and report["fits"]
    assert plan == ["full", "full", "none"], report["tries"]


def test_the_estimated_peak_adds_what_lives_outside_the_blocks():
    """``base`` (embeddings, logits, loss) lives through the whole step, so every plan's estimate includes it: a
    budget is a fraction of the whole no-checkpointing peak, and a plan compared without it fitted 5 bytes early."""
    block = BlockProfile(retained={"none": 10.0, "selective": 4.0, "full": 1.0})
    assert estimate_peak([block], ["none"], base=5.0) == 15.0
    assert estimate_peak([block], ["full"], base=5.0) == 15.0  # its recompute brings the 10 of `none` back
    assert estimate_peak([block, block], ["full", "none"], base=5.0) == 16.0  # 1 + 10 held after the forward


def test_the_probe_estimates_no_checkpointing_at_exactly_its_measured_peak():
    """The probe's ``base`` is the measured ``none`` peak less the blocks' activations, so the estimate of the
    ``none`` plan is that peak itself (ratio 1.0): a budget of 1.0 keeps every block as it is."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, block_size=32))
    ids = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))
    blocks = list(model.blocks)
    wrappers = apply_checkpointing(blocks, uniform_plan(2, "none"))
    plan, report = budget_plan_from_probe(
        lambda: F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()), model, blocks, wrappers, 1.0
    )
    assert plan == ["none", "none"]
    assert report["tries"][0]["estimated_ratio"] == pytest.approx(1.0, abs=1e-12)


class BatchNormBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return x + F.relu(self.bn(self.lin(x)))


def test_the_probe_gives_back_gradients_and_buffers_it_found():
    """The probe runs forward and backward several times: the gradients a caller had (accumulation in progress)
    and the BatchNorm running statistics and batch counter are what they were before it, bit for bit. Its first
    pass added into the caller's gradients in place, and it gave them back doubled (a 4-block Llama's: 2.0 times
    their norm, up to 0.093 off)."""
    torch.manual_seed(0)
    blocks = [BatchNormBlock() for _ in range(3)]
    root = torch.nn.Sequential(*blocks)
    x = torch.randn(16, 8)
    root(x).square().sum().backward()  # a gradient in progress and buffers moved once
    grads = {n: p.grad.clone() for n, p in root.named_parameters()}
    buffers = {n: b.clone() for n, b in root.named_buffers()}
    wrappers = apply_checkpointing(blocks, uniform_plan(3, "none"))
    budget_plan_from_probe(lambda: root(x).square().sum(), root, blocks, wrappers, 0.6)
    assert all(torch.equal(p.grad, grads[n]) for n, p in root.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in root.named_buffers())
    assert int(buffers["0.bn.num_batches_tracked"]) == 1


def test_when_the_replans_run_out_the_plan_returned_is_the_last_one_measured(monkeypatch):
    """With no re-plan left, the probe re-planned once more and returned that plan unmeasured: ``selective,
    selective, selective, none`` under a report whose figures were those of ``selective, selective, none, none``
    (0.85, "fits": False), and the callback then warned "using full checkpointing" for a plan with no full block. The
    plan returned is the last one measured, and its wrappers are in it."""
    plan, report, wrappers = fake_probe(monkeypatch, lambda plan: 4.0, 0.8, max_replans=0)
    assert plan == report["plan"] == report["tries"][-1]["plan"] == ["selective", "selective", "none", "none"]
    assert [w.mode for w in wrappers] == plan
    assert report["measured_ratio"] == 34 / 40 and report["fits"] is False and len(report["tries"]) == 1


def test_the_callback_warns_about_a_measured_plan_over_the_budget_as_such(monkeypatch):
    """The callback said "memory_budget=0.8 is below what checkpointing every block reaches (0.850 ...); using full
    checkpointing" for any plan that missed, though only an all-``full`` plan is that; a plan that missed after its
    re-plans is named with its figure."""
    plan, report, _ = fake_probe(monkeypatch, lambda plan: 4.0, 0.8, max_replans=0)
    monkeypatch.setattr(checkpoint_budget, "budget_plan_from_probe", lambda *args: (plan, report))
    trainer = SimpleNamespace(precision_plugin=None, datamodule=None,
                              strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.8)
    with pytest.warns(UserWarning, match=r"^SelectiveCheckpointing: plan \['selective', 'selective', 'none', 'none'\] "
                                         r"measured 0\.850 of no-checkpointing activation memory, over "
                                         r"memory_budget=0\.8, after 1 tries; it is used") as record:
        cb.setup(trainer, lit_llm(), "fit")
    assert not any("using full checkpointing" in str(w.message) for w in record)
    assert cb.plan == ["selective", "selective", "none", "none"] and [w.mode for w in cb.wrappers] == cb.plan


def test_a_model_with_a_frozen_parameter_is_probed_and_trains_like_no_checkpointing():
    """MemTracker registers a gradient hook on each parameter of a module it enters: a model with a frozen one (a
    fine-tune's embedding, requires_grad=False) failed its budget probe at setup with "cannot register a hook on a
    tensor that doesn't require gradient". It is probed, and trains bit for bit like the fit without the callback."""
    modules = [lit_llm(), lit_llm()]
    for module in modules:
        next(module.model.parameters()).requires_grad_(False)
    frozen = next(modules[0].model.parameters()).detach().clone()
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.5, probe_seq_len=32)
    fit(modules[0], [cb], steps=2)
    fit(modules[1], [], steps=2)
    assert cb.budget_report["fits"] and "full" in cb.plan and any(w.calls > 0 for w in cb.wrappers)
    first = next(modules[0].model.parameters())
    assert torch.equal(first, frozen) and first.grad is None
    for (name, p), q in zip(modules[0].model.named_parameters(), modules[1].model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("max_replans, tries", [(0, 1), (1, 2), (3, 2)])
def test_max_replans_from_the_config_reaches_the_probe(monkeypatch, max_replans, tries):
    """``max_replans`` was fixed at 3 inside the probe: ``callbacks.selective_ckpt.max_replans=0`` (keep the first plan
    measured) was refused as a key the config lacks. From the config it reaches the probe: a plan missing by 4 bytes
    (0.85 of a 0.8 budget) is kept after one try with 0, re-planned once to 0.725 with 1 or more."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).parents[2] / "conf" / "callbacks" / "selective_ckpt.yaml").selective_ckpt
    cb = instantiate(conf, policy="budget", memory_budget=0.8, max_replans=max_replans)
    fake_measurements(monkeypatch, lambda: cb.wrappers, lambda plan: 4.0)
    trainer = SimpleNamespace(precision_plugin=None, datamodule=None,
                              strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_replans=0's "measured 0.850 ... over memory_budget=0.8"
        cb.setup(trainer, lit_llm(), "fit")
    assert len(cb.budget_report["tries"]) == tries
    assert cb.budget_report["measured_ratio"] == (34 / 40 if tries == 1 else 29 / 40)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_a_bad_max_replans_is_one_line_naming_it(value):
    """A negative count gave the probe no try at all (an IndexError on its empty list of tries, no plan)."""
    with pytest.raises(ValueError, match=rf"^SelectiveCheckpointing: max_replans must be an integer >= 0, got "
                                         rf"{re.escape(repr(value))}$"):
        SelectiveCheckpointing(policy="budget", max_replans=value)
    with pytest.raises(ValueError, match=r"^max_replans must be an integer >= 0, got -1$"):
        budget_plan_from_probe(lambda: None, torch.nn.Linear(2, 2), [], [], 0.5, max_replans=-1)
