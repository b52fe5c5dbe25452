"""SelectiveCheckpointing: gradient parity, memory and FLOPs actually change, block discovery, Lightning use."""

from __future__ import annotations

import io
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader

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
from lit_dtrain.errors import ConfigError
from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.module import LitLLM
from lit_dtrain.sweeps import user_error
from lit_dtrain.utils.memory import measure_activation_memory, measure_backward_flops

CFG = dict(vocab_size=257, block_size=64, n_layer=4, n_head=4, n_kv_head=2, d_model=64)


def make_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**CFG))


def loss_fn(model, ids):
    return lambda: F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())


def grads(model, ids) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model, ids)().backward()
    return [p.grad.clone() for p in model.parameters()]


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


# ---- Lightning ----------------------------------------------------------------------------------------------
def token_batches(n: int, seq: int = 32, vocab: int = 257) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, vocab, (seq,), generator=g)} for _ in range(n)]
    for d in data:
        d["labels"] = torch.roll(d["input_ids"], -1)
    return DataLoader(data, batch_size=2)


def fit(module, callbacks, steps: int = 3, precision="32-true"):
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, precision=precision, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, token_batches(2 * steps))
    return trainer


def lit_llm() -> LitLLM:
    return LitLLM(make_model(), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_callback_in_trainer_matches_plain_training(precision):
    plain = lit_llm()
    fit(plain, [], precision=precision)
    cb = SelectiveCheckpointing(policy="selective")
    ckpt = lit_llm()
    trainer = fit(ckpt, [cb], precision=precision)
    assert cb.plan == ["selective"] * 4 and all(w.calls >= 3 for w in cb.wrappers)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert (a - b).abs().max().item() <= 1e-6, name
    state = cb.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == {"policy": "selective", "plan": ["selective"] * 4}
    cb.setup(trainer, ckpt, "validate")  # a second setup does not wrap twice
    assert all(b.forward is w for b, w in zip(ckpt.model.blocks, cb.wrappers))
    again = lit_llm()  # the same callback object on another module (a sweep loop) wraps that module's blocks
    fit(again, [cb], precision=precision)
    assert all(b.forward is w for b, w in zip(again.model.blocks, cb.wrappers))
    assert all(w.calls >= 3 for w in cb.wrappers)


def test_budget_callback_probes_and_restores_state_plan():
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.6, probe_seq_len=48)
    module = lit_llm()
    fit(module, [cb], steps=1)
    assert cb.budget_report["fits"] and cb.plan == cb.budget_report["plan"] and "full" in cb.plan
    other = SelectiveCheckpointing(policy="budget")
    other.wrappers = apply_checkpointing(list(make_model().blocks), ["none"] * 4)
    other.load_state_dict(cb.state_dict())  # a resumed run keeps the plan it trained with
    assert [w.mode for w in other.wrappers] == cb.plan


def test_budget_probe_longer_than_the_model_names_probe_seq_len():
    """probe_seq_len above the model's block_size failed in the probe's forward with the model's ValueError, under
    Hydra's traceback, naming no setting."""
    cb = SelectiveCheckpointing(policy="budget", probe_seq_len=1000)
    with pytest.raises(ConfigError, match=r"probe_seq_len=1000 exceeds the model's block_size 64; use probe_seq_len "
                                          r"<= 64"):
        cb._probe_forward(L.Trainer(accelerator="cpu", logger=False), lit_llm())


def test_budget_resume_says_which_plan_it_uses():
    """A resumed budget run probes again in setup and logs that plan, then load_state_dict puts the checkpoint's plan
    back: when the two differ (another memory_budget, noisy timings) the run must say that the probe's plan is not
    the one it uses."""
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.9)
    cb.wrappers = apply_checkpointing(list(make_model().blocks), ["none"] * 4)
    cb.plan = ["full", "none", "none", "none"]  # what this run's probe chose (and logged)
    set_plan(cb.wrappers, cb.plan)
    saved = {"policy": "budget", "plan": ["full", "full", "full", "none"]}
    with pytest.warns(UserWarning, match=r"checkpoint's plan \['full', 'full', 'full', 'none'\].*not used"):
        cb.load_state_dict(saved)
    assert cb.plan == saved["plan"] and [w.mode for w in cb.wrappers] == saved["plan"]


def test_budget_resume_with_a_plan_for_another_block_count_says_so():
    """A checkpoint's plan for another number of blocks (module_pattern changed) was dropped without a word."""
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.9)
    cb.wrappers = apply_checkpointing(list(make_model().blocks), ["none"] * 4)
    cb.plan = ["full", "none", "none", "none"]
    set_plan(cb.wrappers, cb.plan)
    with pytest.warns(UserWarning, match=r"checkpoint's plan covers 2 blocks, this run checkpoints 4; this run's probe "
                                         r"plan \['full', 'none', 'none', 'none'\] is used"):
        cb.load_state_dict({"policy": "budget", "plan": ["full", "full"]})
    assert [w.mode for w in cb.wrappers] == ["full", "none", "none", "none"]


class ForeignLM(L.LightningModule):
    """Someone else's LightningModule: Lightning's demo encoder-decoder Transformer, its own loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(vocab_size=257, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.1)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        out = self.model(ids, batch["labels"])
        return F.nll_loss(out, batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_foreign_lightning_module_through_module_pattern():
    plain = ForeignLM()
    fit(plain, [])
    cb = SelectiveCheckpointing(policy="selective", module_pattern="model.transformer.*.layers.*")
    foreign = ForeignLM()
    fit(foreign, [cb])
    assert cb.block_names == [f"model.transformer.{part}.layers.{i}" for part in ("encoder", "decoder") for i in (0, 1)]
    assert all(w.calls == 3 for w in cb.wrappers)  # every block was checkpointed on every step
    # dropout masks are replayed exactly in recomputation, so training is unchanged
    for (name, a), b in zip(plain.named_parameters(), foreign.parameters()):
        assert (a - b).abs().max().item() <= 1e-6, name
    with pytest.raises(ValueError, match="model.layers.*matched no module"):
        fit(ForeignLM(), [SelectiveCheckpointing(module_pattern="model.layers.*")])
    with pytest.raises(ConfigError, match="every_k=5 exceeds the 4 blocks"):
        fit(ForeignLM(), [SelectiveCheckpointing("every_k", every_k=5, module_pattern="model.transformer.*.layers.*")])


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


def test_module_pattern_naming_a_container_is_an_error():
    """``model.layers`` (the ModuleList, never called) instead of ``model.layers.*`` checkpointed nothing, silently."""
    module = LitLLM(make_model())
    with pytest.raises(ValueError, match=r"matched model\.blocks, which has no forward.*'model\.blocks\.\*'"):
        find_blocks(module, "model.blocks")
    # found in setup, so a ConfigError named under the callback: train.py prints it in one line, no traceback
    with pytest.raises(ConfigError, match=r"^SelectiveCheckpointing: module_pattern 'model\.blocks' matched "
                                          r"model\.blocks, which has no forward") as e:
        fit(lit_llm(), [SelectiveCheckpointing("full", module_pattern="model.blocks")], steps=1)
    assert user_error(e.value) is e.value
    # the hint for blocks that do not exist yet belongs to a pattern that matched nothing, not to this one
    assert "configure_model" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^SelectiveCheckpointing: module_pattern 'model\.layers\.\*' matched no "
                                          r"module.*LitLLM\.configure_model builds the blocks"):
        fit(lit_llm(), [SelectiveCheckpointing("full", module_pattern="model.layers.*")], steps=1)


def test_budget_probes_only_for_fit():
    """validate/test/predict run without grad: the probe (forward + backward per mode) is skipped, and on a
    frozen model it used to fail ("cannot register a hook on a tensor that doesn't require gradient")."""
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.6, probe_seq_len=48)
    module = lit_llm()
    module.requires_grad_(False)
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[cb], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.validate(module, token_batches(2))
    assert cb.budget_report is None and cb.plan == ["none"] * 4 and all(w.calls == 0 for w in cb.wrappers)
    module.requires_grad_(True)
    fit(module, [cb], steps=1)  # a later fit of the same module still probes and plans
    assert cb.budget_report["fits"] and cb.plan == cb.budget_report["plan"] and "full" in cb.plan
    assert [w.mode for w in cb.wrappers] == cb.plan


class NormBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d)

    def forward(self, x):
        return x + F.relu(self.bn(self.lin(x)))


class BatchNormLM(L.LightningModule):
    """Blocks with buffers updated in forward: BatchNorm's running statistics and batch counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(257, 16)
        self.model = torch.nn.Sequential(NormBlock(16), NormBlock(16))
        self.head = torch.nn.Linear(16, 257)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.model(self.emb(batch["input_ids"]).flatten(0, 1)))
        return F.cross_entropy(logits, batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputation_does_not_update_buffers_twice(policy):
    """Recomputing a BatchNorm block in backward ran its running-statistics update a second time."""
    plain = BatchNormLM()
    fit(plain, [])
    cb = SelectiveCheckpointing(policy=policy, module_pattern="model.*")
    ckpt = BatchNormLM()
    fit(ckpt, [cb])
    assert all(w.calls == 3 for w in cb.wrappers)
    a, b = plain.state_dict(), ckpt.state_dict()
    assert a.keys() == b.keys()
    assert int(b["model.0.bn.num_batches_tracked"]) == 3  # one update per step, not two
    for k in a:
        assert (a[k].float() - b[k].float()).abs().max().item() <= 1e-6, k


def test_budget_probe_runs_under_the_trainers_autocast():
    """bf16-mixed training keeps bf16 matmul outputs next to fp32 ones, so the ratios between modes are not the fp32
    ones. The probe ran without the precision plugin's autocast: on this 5-block model its plan, measured at 0.291
    of ``none`` in fp32, kept 0.310 of ``none``'s activation memory in bf16-mixed training, over a budget of 0.3
    that the report said it met."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=257, block_size=128, n_layer=5, n_head=4, n_kv_head=2, d_model=128))
    module = LitLLM(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.3, probe_batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    autocast_seen = []
    hook = model.blocks[0].register_forward_pre_hook(
        lambda m, a: autocast_seen.append(torch.is_autocast_enabled("cpu"))
    )
    cb.setup(trainer, module, "fit")
    hook.remove()
    assert autocast_seen and all(autocast_seen)
    ids = torch.randint(0, 257, (2, 129), generator=torch.Generator().manual_seed(1))

    def act(plan):  # a bf16-mixed training step's activation memory, autocast as Lightning applies it
        set_plan(cb.wrappers, plan)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):  # the forward only
                loss = loss_fn(module, ids)()
            loss.backward()

        peak = measure_activation_memory(step, module).max_act
        module.zero_grad(set_to_none=True)
        return peak

    none = act(["none"] * 5)
    ratio = act(cb.plan) / none
    assert cb.budget_report["fits"] and ratio <= 0.3


def test_budget_probe_runs_in_the_bf16_true_dtype():
    """Under bf16-true Lightning converts the model to bf16 after setup, where the probe ran in fp32: on this 5-block
    model its plan, measured at 0.291 of ``none`` in fp32, kept 0.313 of ``none``'s activation memory in bf16-true
    training, over a budget of 0.3 that the report said it met."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=257, block_size=128, n_layer=5, n_head=4, n_kv_head=2, d_model=128))
    module = LitLLM(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.3, probe_batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    dtypes = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: dtypes.append(a[0].dtype))
    cb.setup(trainer, module, "fit")
    hook.remove()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    after = module.state_dict()  # the probe gave the fp32 weights back, bit for bit
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(p.grad is None for p in module.parameters())
    module.to(torch.bfloat16)  # what Lightning's bf16-true plugin does after setup
    ids = torch.randint(0, 257, (2, 129), generator=torch.Generator().manual_seed(1))

    def act(plan):
        set_plan(cb.wrappers, plan)
        peak = measure_activation_memory(lambda: loss_fn(module, ids)().backward(), module).max_act
        module.zero_grad(set_to_none=True)
        return peak

    assert cb.budget_report["fits"] and act(cb.plan) / act(["none"] * 5) <= 0.3


class FloatInputLM(L.LightningModule):
    """Takes float features: its example_input_array is a float tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                                               torch.nn.Linear(64, 16)) for _ in range(3)))
        self.example_input_array = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))

    def forward(self, x):
        return self.model(x)


def test_budget_probe_converts_a_float_example_input_under_bf16_true():
    """The probe runs the bf16-true model in bf16; a float example_input_array must be fed in bf16 as Lightning feeds
    a training batch, not as fp32 into bf16 weights (a dtype mismatch in the first Linear)."""
    module = FloatInputLM()
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.7, module_pattern="model.*")
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    cb.setup(trainer, module, "fit")
    assert cb.budget_report is not None and len(cb.plan) == 3
    assert module.example_input_array.dtype == torch.float32  # converted for the probe, not in place


class SpareBlocksLM(BatchNormLM):
    """A LightningModule with blocks its training step never calls (an unused copy, a module used only by weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = torch.nn.Sequential(NormBlock(16), NormBlock(16))


def test_pattern_matching_blocks_that_never_run_warns():
    """A module_pattern that matched modules the training step never calls checkpointed nothing there, while the
    log said ``modes {'full': 4}``: the first training step now names the blocks that did not run."""
    cb = SelectiveCheckpointing(policy="full", module_pattern="*.*")  # model.0, model.1, spare.0, spare.1
    with pytest.warns(UserWarning, match=r"spare\.0, spare\.1 did not run with grad in the first training step"):
        fit(SpareBlocksLM(), [cb])
    assert [w.calls for w in cb.wrappers] == [3, 3, 0, 0]
    ok = SelectiveCheckpointing(policy="full", module_pattern="model.*")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*did not run")
        fit(SpareBlocksLM(), [ok])
    assert [w.calls for w in ok.wrappers] == [3, 3]


class SharedBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class CompiledSpareBlocksLM(SpareBlocksLM):
    """Blocks without buffers (with a graph-only backend, a BatchNorm update would run again in recomputation), two of
    them unused, the model compiled in place in ``configure_model`` (after the callback's setup) as
    ``LitLLM(compile=True)`` does."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(SharedBlock(16), SharedBlock(16))
        self.spare = torch.nn.Sequential(SharedBlock(16), SharedBlock(16))
        self.backend = backend

    def configure_model(self) -> None:
        self.model.compile(backend=self.backend)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_compiled_blocks_compile_once_and_are_seen_running(policy):
    """Counting checkpointed calls (``calls += 1``) under torch.compile made dynamo guard on the count: the model
    recompiled on every step until the recompile limit, and then trained eagerly."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    cb = SelectiveCheckpointing(policy=policy, module_pattern="*.*")  # model.0, model.1 run; spare.0, spare.1 do not
    torch._dynamo.reset()
    try:
        with pytest.warns(UserWarning, match=r"did not run with grad") as record:
            fit(CompiledSpareBlocksLM(counter), [cb], steps=6)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1  # one graph for six steps: no recompile
    idle = [str(w.message) for w in record if "did not run with grad" in str(w.message)]
    assert len(idle) == 1 and "spare.0, spare.1 did not run" in idle[0]  # the compiled blocks were seen running
    assert [w.ran for w in cb.wrappers] == [True, True, False, False]


class SharedBlocksLM(BatchNormLM):
    """ALBERT-style weight sharing: one block object listed four times in ``blocks`` and called four times."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([SharedBlock(16)] * 4)
        self.model = torch.nn.Sequential(*self.blocks)
        self.example_input_array = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))

    def forward(self, ids):
        return self.head(self.model(self.emb(ids)))


def test_a_block_listed_twice_is_one_block():
    """Each entry of ``blocks`` got a plan entry, but a shared block has one forward, so the last entry's mode won:
    ``budget`` reported plan ['full', 'full', 'selective', 'none'] and ran every call in ``none`` (measured 1.0 of
    ``none``, "fits": False), and ``every_k=2`` logged ['none', 'full', 'none', 'full'] and ran all four in full."""
    module = SharedBlocksLM()
    assert [name for name, _ in find_blocks(module)] == ["blocks.0"]
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.8)
    fit(module, [cb])
    assert cb.block_names == ["blocks.0"] and [w.mode for w in cb.wrappers] == cb.plan
    assert cb.budget_report["fits"] and cb.budget_report["measured_ratio"] <= 0.8
    with pytest.raises(ValueError, match="every_k=2 exceeds the 1 blocks found"):
        fit(SharedBlocksLM(), [SelectiveCheckpointing("every_k", every_k=2)])


def test_budget_probe_stopwatch_waits_for_the_gpu_around_a_cuda_op(monkeypatch):
    """CUDA ops return when queued, so the per-op stopwatch of the ``budget`` probe timed kernel launches on a GPU
    (seen in bench_activation_ckpt --device cuda); it now synchronizes around an op on CUDA tensors, and only then."""
    import time

    from lit_dtrain.callbacks._checkpoint_budget import _BlockOpTimer
    from lit_dtrain.callbacks._checkpoint_policies import SaveOpsPolicy

    class OnCuda(torch.Tensor):
        is_cuda = property(lambda self: True)

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(time.perf_counter()))
    timer = _BlockOpTimer(SaveOpsPolicy(frozenset()), n_blocks=1)
    timer.current = 0

    def op(*args, **kwargs):
        time.sleep(0.01)
        return args[0]

    cuda_tensor = torch.Tensor._make_subclass(OnCuda, torch.zeros(2))
    timer.__torch_dispatch__(op, (), (cuda_tensor,))
    assert len(syncs) == 2 and syncs[1] - syncs[0] >= 0.01  # before and after the op
    assert timer.full[0] >= 0.01 and timer.selective[0] == timer.full[0]
    timer.__torch_dispatch__(op, (), (torch.zeros(2),))
    assert len(syncs) == 2  # a CPU op: no synchronize
