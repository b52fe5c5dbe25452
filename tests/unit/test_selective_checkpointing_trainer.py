"""SelectiveCheckpointing in a Lightning Trainer: parity with plain training, the budget policy's probe and its plan
at a resume, a LightningModule of one's own, a container named as the block pattern."""

from __future__ import annotations

import io

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer

from lit_dtrain.callbacks import SelectiveCheckpointing
from lit_dtrain.callbacks._checkpoint_policies import (
    apply_checkpointing,
    find_blocks,
    set_plan,
)
from lit_dtrain.errors import ConfigError
from lit_dtrain.module import LitLLM
from lit_dtrain.sweeps import user_error
from tests.unit._selective_ckpt_helpers import fit, lit_llm, make_model, token_batches


# ---- Lightning ----------------------------------------------------------------------------------------------
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
    assert all(w.calls >= 3 and w.inner.__self__ is b for b, w in zip(again.model.blocks, cb.wrappers))
    assert all("forward" not in b.__dict__ for b in again.model.blocks)  # given back at teardown


@pytest.mark.parametrize("policy", ["full", "budget"])
def test_the_blocks_are_checkpointed_only_in_the_callbacks_own_fits(policy):
    """The wrappers stayed on the blocks after the fit: a second fit of the module without the callback went on
    recomputing them (policy=full, model=nano, batch 8: 1058 ms a step against 752 ms for a module never patched; 60
    checkpointed calls in 12 steps), and so did a plain forward with grad (9.3 MiB of saved activations against 138).
    They are taken out at teardown; the same callback in a later fit puts the same wrappers back with the same plan
    (no new budget probe)."""
    cb, module = SelectiveCheckpointing(policy=policy, memory_budget=0.3), lit_llm()
    trainer = fit(module, [cb])
    plan, report, calls = list(cb.plan), cb.budget_report, [w.calls for w in cb.wrappers]
    assert set(plan) - {"none"}  # something is checkpointed
    fit(module, [])  # a fit without the callback: nothing checkpointed
    assert [w.calls for w in cb.wrappers] == calls
    assert all("forward" not in b.__dict__ for b in module.model.blocks)
    ids = torch.randint(0, 257, (2, 32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module.model(ids).sum().backward()
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        make_model()(ids).sum().backward()
    assert len(saved) == len(plain)
    trainer.fit_loop.epoch_loop.max_steps = 6  # the same trainer fitted on: the same wrappers again, plan kept
    trainer.fit(module, token_batches(12))
    assert cb.plan == plan and cb.budget_report is report
    assert all(w.calls > c for w, c, mode in zip(cb.wrappers, calls, plan) if mode != "none")


def test_the_blocks_get_their_forward_back_when_the_fit_raises():
    """A fit that raised (an out-of-memory error a caller retries, a notebook) never reached teardown: its blocks
    stayed wrapped (policy=full: 4 of 4 'forward' attributes left, checkpointed in a later fit without the callback).
    They are taken out at the exception too; the same callback in a later fit puts them back."""

    class Boom(L.Callback):
        def on_train_batch_end(self, *args) -> None:
            raise RuntimeError("boom")

    cb, module = SelectiveCheckpointing(policy="full"), lit_llm()
    with pytest.raises(RuntimeError, match="boom"):
        fit(module, [cb, Boom()])
    assert all("forward" not in b.__dict__ for b in module.model.blocks)
    calls = [w.calls for w in cb.wrappers]
    fit(module, [])
    assert [w.calls for w in cb.wrappers] == calls  # nothing checkpointed without the callback
    fit(module, [cb])
    assert all(w.calls > c for w, c in zip(cb.wrappers, calls))

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
