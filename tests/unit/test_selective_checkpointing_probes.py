"""SelectiveCheckpointing: buffers under recomputation, the budget probe under autocast, bf16-true and a float input,
blocks that never run, compiled and shared blocks, the probe's stopwatch on a GPU."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.callbacks._checkpoint_policies import (
    find_blocks,
    set_plan,
)
from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.module import LitLLM
from lit_dtrain.utils.memory import measure_activation_memory
from tests.unit._selective_ckpt_helpers import fit, loss_fn


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
