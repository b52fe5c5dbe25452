"""Exact results of ``SelectiveCheckpointing`` (``callbacks/selective_checkpointing.py``) where single-point mutants
passed test_selective_checkpointing*.py, test_checkpoint_budget.py and test_callback_arguments.py (eleventh hand
mutation audit). The budget probe runs in ``setup`` on a trainer stand-in (as in test_checkpoint_budget.py)."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from omegaconf import OmegaConf

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.callbacks._checkpoint_policies import resolve_ops
from lit_dtrain.callbacks.selective_checkpointing import _probe_autocast
from tests.unit._selective_ckpt_helpers import fit, lit_llm

CONF = Path(__file__).parents[2] / "conf" / "callbacks" / "selective_ckpt.yaml"


def stand_in(precision="32-true", block_size=None):
    """A trainer as ``setup`` reads it: its precision plugin, datamodule and broadcast."""
    plugin = FSDPPrecision(precision) if precision != "32-true" else None
    datamodule = None if block_size is None else SimpleNamespace(block_size=block_size)
    return SimpleNamespace(precision_plugin=plugin, datamodule=datamodule,
                           strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))


def test_the_class_defaults_are_the_configs():
    """A project that builds ``SelectiveCheckpointing()`` itself gets what ``'callbacks=[default,selective_ckpt]'``
    gives: ``selective`` with matmuls and SDPA saved, ``every_k`` 2, a 0.5 budget, probe batch 1."""
    conf = OmegaConf.to_container(OmegaConf.load(CONF)["selective_ckpt"])
    conf.pop("_target_")
    defaults = {k: p.default for k, p in inspect.signature(SelectiveCheckpointing).parameters.items()}
    assert defaults == conf
    cb = SelectiveCheckpointing(save_ops=["aten.mm"])
    assert cb.save_ops == ["aten.mm"]


def test_the_callbacks_save_ops_reach_the_blocks():
    """``save_ops=[aten.mm]`` is the list the wrappers save, not the default one."""
    cb, module = SelectiveCheckpointing(save_ops=["aten.mm"]), lit_llm()
    cb.setup(stand_in(), module, "fit")
    assert all(w.context_fn.args[0].ops == resolve_ops(["aten.mm"]) == {torch.ops.aten.mm} for w in cb.wrappers)


@pytest.mark.parametrize("policy, plan", [("none", ["none"] * 4), ("full", ["full"] * 4),
                                          ("every_k", ["none", "full", "none", "full"])])
def test_each_block_policy_sets_its_plan(policy, plan):
    """``none`` only reports: its blocks are wrapped, in mode ``none``, and run plainly."""
    cb, module = SelectiveCheckpointing(policy=policy), lit_llm()
    cb.setup(stand_in(), module, "fit")
    assert cb.plan == plan and [w.mode for w in cb.wrappers] == plan


def test_a_budget_probe_is_run_for_a_module_first_seen_in_a_validate():
    """A budget callback that probed module A, then served ``trainer.validate`` of module B (no probe there), must
    probe B at B's fit: B's plan checkpoints, and its report is its own."""
    cb, a, b = SelectiveCheckpointing(policy="budget", memory_budget=0.3, probe_seq_len=16), lit_llm(), lit_llm()
    cb.setup(stand_in(), a, "fit")
    report_a = cb.budget_report
    cb.setup(stand_in(), b, "validate")
    assert cb.budget_report is None and cb.plan == ["none"] * 4
    cb.setup(stand_in(), b, "fit")
    assert cb.budget_report is not report_a and cb.budget_report["fits"] and "full" in cb.plan
    assert [w.mode for w in cb.wrappers] == cb.plan and all(w.inner.__self__ is blk for w, blk in
                                                            zip(cb.wrappers, b.model.blocks))


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_no_budget_probe_outside_fit(stage):
    """test and predict run without grad, as validate does: no probe (a forward and backward per mode), nothing
    checkpointed."""
    cb, module = SelectiveCheckpointing(policy="budget"), lit_llm()
    cb.setup(stand_in(), module, stage)
    assert cb.budget_report is None and [w.mode for w in cb.wrappers] == ["none"] * 4


def test_a_validate_with_ckpt_path_does_not_take_the_checkpoints_plan():
    """Lightning loads every callback's state at ``validate(ckpt_path=...)`` too: the plan there is a fit's, and
    this object's plan stays its own."""
    cb, module = SelectiveCheckpointing(policy="budget"), lit_llm()
    cb.setup(stand_in(), module, "validate")
    cb.load_state_dict({"policy": "budget", "plan": ["full"] * 4})
    assert cb.plan == ["none"] * 4 and [w.mode for w in cb.wrappers] == ["none"] * 4


def test_blocks_left_unwrapped_on_purpose_are_not_warned_about():
    """``every_k=2``: blocks 0 and 2 run plainly (mode ``none``), so they are not "blocks that did not run with
    grad"; no warning."""
    cb = SelectiveCheckpointing(policy="every_k", every_k=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*did not run")
        fit(lit_llm(), [cb], steps=1)
    assert [w.mode for w in cb.wrappers] == ["none", "full", "none", "full"]
    assert [w.calls for w in cb.wrappers] == [0, 1, 0, 1]


class TwoInputLM(L.LightningModule):
    """Its forward takes two arguments: ``example_input_array`` is a tuple, or a dict of keywords."""

    def __init__(self, example) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                                               torch.nn.Linear(64, 16)) for _ in range(3)))
        self.example_input_array = example
        self.seen = []

    def forward(self, x, scale):
        self.seen.append((tuple(x.shape), float(scale)))
        return self.model(x) * scale


@pytest.mark.parametrize("as_dict", [False, True])
def test_budget_probe_unpacks_a_tuple_or_dict_example(as_dict):
    x, scale = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), torch.tensor(2.0)
    module = TwoInputLM({"x": x, "scale": scale} if as_dict else (x, scale))
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.7, module_pattern="model.*")
    cb.setup(stand_in(), module, "fit")
    assert cb.budget_report is not None and len(cb.plan) == 3
    assert set(module.seen) == {((4, 16), 2.0)}


@pytest.mark.parametrize("probe_seq_len, block_size, seen", [(16, 32, 16), (None, 32, 32), (None, None, 64),
                                                              (64, None, 64)])
def test_budget_probe_length(probe_seq_len, block_size, seen):
    """``probe_seq_len`` first, else the datamodule's ``block_size``, else the model's (64); the model's own length
    is allowed. The probe feeds exactly that many tokens."""
    cb, module = SelectiveCheckpointing(policy="budget", memory_budget=0.6, probe_seq_len=probe_seq_len), lit_llm()
    lengths = []
    module.model.blocks[0].register_forward_pre_hook(lambda m, a: lengths.append(tuple(a[0].shape[:2])))
    cb.setup(stand_in(block_size=block_size), module, "fit")
    assert set(lengths) == {(1, seen)}


def test_a_budget_below_what_full_reaches_warns_and_a_met_one_does_not():
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.01, probe_seq_len=16)
    with pytest.warns(UserWarning, match=r"memory_budget=0\.01 is below what checkpointing every block reaches "
                                         r"\(0\.\d+ of no-checkpointing activation memory\); using full checkpointing"):
        cb.setup(stand_in(), lit_llm(), "fit")
    assert cb.plan == ["full"] * 4 and cb.budget_report["fits"] is False
    ok = SelectiveCheckpointing(policy="budget", memory_budget=0.6, probe_seq_len=16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*memory_budget")
        ok.setup(stand_in(), lit_llm(), "fit")
    assert ok.budget_report["fits"] is True


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_the_probe_autocasts_to_the_trainers_half_dtype(precision, dtype):
    trainer = SimpleNamespace(precision_plugin=MixedPrecision(precision, "cpu"))
    with _probe_autocast(trainer, torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype


def test_a_bf16_true_probe_gives_back_the_gradients_it_found():
    """Under bf16-true the probe runs on the model cast to bf16 and then gives every parameter its fp32 tensor back:
    its gradient too (a fit's gradients of the last step, in fp32), bit for bit."""
    module = lit_llm()
    for p in module.parameters():
        p.grad = torch.full_like(p, 0.5)
    cb = SelectiveCheckpointing(policy="budget", memory_budget=0.6, probe_seq_len=16)
    cb.setup(stand_in("bf16-true"), module, "fit")
    assert cb.budget_report is not None
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.equal(p.grad, torch.full_like(p, 0.5))
               for p in module.parameters())
