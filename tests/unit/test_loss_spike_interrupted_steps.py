"""LossSpikeMonitor with a plain module, and steps that raised, were interrupted or never completed."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.faults import RaiseOnceAt
from tests.unit._loss_spike_helpers import (
    Inject,
    make_data,
    make_module,
    make_trainer,
    one_thread,  # noqa: F401 - its autouse fixture, as before the split
)


def test_a_plain_module_gets_told_how_to_use_the_monitor(tmp_path: Path) -> None:
    """A plain LightningModule fed (x, y) pairs (collated to a list) with the default actions (log, skip): the error
    names the missing 'index' and the actions that need no index, and comes alone; a dict batch whose 'index' is a
    list of ints (a default collate of ints gives a tensor, a custom one may not) is taken as the indices (it raised
    AttributeError: 'list' object has no attribute 'detach')."""
    from torch.utils.data import DataLoader

    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
            return (self.lin(x) - y).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(32, 4)
    tuples = DataLoader(list(zip(x, x.sum(1, keepdim=True))), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[LossSpikeMonitor(path=str(tmp_path / "s.jsonl"))])
    import warnings

    with warnings.catch_warnings(record=True) as said, pytest.raises(
            KeyError, match=r"needs the batch key 'index'.*got list.*actions=\['log', 'lr_cooldown'\]"):
        warnings.simplefilter("always")
        trainer.fit(Plain(), tuples)
    # the error alone: "there is no datamodule, so no sampler with exclude(); steps ... will be skipped instead" came
    # first, a promise about steps that never ran
    assert not [w for w in said if "LossSpikeMonitor" in str(w.message)]

    def collate(items):
        return {"x": torch.stack([i[0] for i in items]), "y": torch.stack([i[1] for i in items]),
                "index": [i[2] for i in items]}

    dicts = DataLoader([(a, a.sum(0, keepdim=True), i) for i, a in enumerate(x)], batch_size=4, collate_fn=collate)
    monitor = LossSpikeMonitor(warmup_steps=2, path=str(tmp_path / "s.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[monitor])
    trainer.fit(Plain(), dicts)
    assert trainer.global_step == 3 and monitor.detector.loss_stat.count == 3
    assert monitor.num_spikes == 0 and not (tmp_path / "s.jsonl").exists()  # docs: no spike, no file


def test_a_fit_that_raised_mid_step_leaves_no_half_step_behind(tmp_path: Path) -> None:
    """An exception between backward and the end of a step (here from on_after_backward at step 5) left that step's
    loss in the monitor; the same Trainer fitted again (it continues at step 5) added it to the next step's loss,
    which read as 2x and was dropped as a spike."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [monitor, RaiseOnceAt("on_after_backward", 5)], max_steps=8)
    module, dm = make_module(), make_data(tmp_path)
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 5
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 8
    assert monitor.events == [] and monitor.num_spikes == 0


def test_a_step_interrupted_after_the_decision_is_not_counted_twice(tmp_path: Path) -> None:
    """An exception after the monitor decided a step and before the optimizer took it (here a later callback's
    on_before_optimizer_step at step 5) left that step's loss in the statistics; the same Trainer fitted again redoes
    step 5, so it entered twice (9 losses after 8 steps). The unfinished decision is now undone on the exception."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [monitor, RaiseOnceAt("on_before_optimizer_step", 5)], max_steps=8)
    module, dm = make_module(), make_data(tmp_path)
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 5
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 8 and monitor.detector.loss_stat.count == 8
    assert monitor.detector.grad_stat.count == 8 and monitor.events == []


@pytest.mark.parametrize(("precision", "accumulate", "value"), [("32-true", 2, 50.0), ("16-mixed", 1, float("nan"))])
def test_the_poison_fault_reaches_the_monitor_in_either_callback_order(
    tmp_path: Path, precision: str, accumulate: int, value: float
) -> None:
    """``tests.faults.PoisonLossAtStep`` multiplied the loss in place in its own on_before_backward: listed after the
    monitor (as ``+callbacks.fault`` is after ``callbacks=[default,loss_spike]``) it reached the monitor's loss only
    through the first micro-batch's tensor, which the monitor happened to keep (not the others': the monitor judged
    step 3 by (50 l0 + l1) / 2), and under 16-mixed (the monitor divides by the loss scale, a copy) not at all. The
    fault must hit every callback the same way, as a bad batch would."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tests.faults import PoisonLossAtStep

    events = {}
    for order in ("poison_first", "poison_last"):
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
        poison = PoisonLossAtStep(3, value=value)
        callbacks = [poison, monitor] if order == "poison_first" else [monitor, poison]
        plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if precision == "16-mixed" else []
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=callbacks, logger=False,
                            plugins=plugins, accumulate_grad_batches=accumulate, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            default_root_dir=str(tmp_path / order))
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        events[order] = [(e["step"], e["reasons"], e["loss"]) for e in monitor.events]
    assert [step for step, _, _ in events["poison_first"]] == [3]
    assert events["poison_last"] == events["poison_first"]



@pytest.mark.parametrize("how", ["same_trainer", "checkpoint"])
def test_a_level_shift_of_a_step_that_never_completed_is_not_recorded(tmp_path: Path, how: str) -> None:
    """The ``level_shift`` line was written to the events file when the step was decided, before it was taken. A fit
    that failed after the decision (here a later callback raising in on_before_optimizer_step at step 6) left it
    there, and the run continued (the same Trainer fitted again, or a resume from the step-6 checkpoint) recorded the
    step again: the file held the level shift twice (with a chosen ``path``; the default spikes.jsonl moved it to
    spikes.superseded.jsonl on resume), and the continued monitor's events too. Events are now recorded when their
    step completes, so the file equals the straight run's."""
    injected = {step: "finite" for step in range(5, 12)}  # the loss level moves up for good at step 5

    def monitor(run: str) -> LossSpikeMonitor:
        return LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_consecutive=2,
                                path=str(tmp_path / run / "events.jsonl"))

    def lines(run: str) -> list:
        text = (tmp_path / run / "events.jsonl").read_text()
        return [(d["step"], d["reasons"]) for d in map(json.loads, text.splitlines())]

    straight = monitor("straight")
    make_trainer(tmp_path / "straight", [Inject(injected), straight], max_steps=9).fit(
        make_module(), datamodule=make_data(tmp_path))
    expected = [(5, ["loss"]), (6, ["level_shift"])]
    assert lines("straight") == expected and [(e["step"], e["reasons"]) for e in straight.events] == expected

    interrupted = monitor("run")
    raising = [Inject(injected), interrupted, RaiseOnceAt("on_before_optimizer_step", 6)]
    module, dm = make_module(), make_data(tmp_path)
    if how == "same_trainer":
        trainer = make_trainer(tmp_path / "run", raising, max_steps=9)
        with pytest.raises(RuntimeError, match="interrupted at step 6"):
            trainer.fit(module, datamodule=dm)
        assert lines("run") == expected[:1]  # nothing for the step that was decided but never taken
        trainer.fit(module, datamodule=dm)
        assert [(e["step"], e["reasons"]) for e in interrupted.events] == expected
    else:
        first = make_trainer(tmp_path / "run", [Inject(injected), monitor("run")], max_steps=6)
        first.fit(module, datamodule=dm)
        first.save_checkpoint(tmp_path / "run" / "step6.ckpt")
        with pytest.raises(RuntimeError, match="interrupted at step 6"):
            make_trainer(tmp_path / "run", raising, max_steps=9).fit(
                make_module(), datamodule=make_data(tmp_path), ckpt_path=tmp_path / "run" / "step6.ckpt")
        assert lines("run") == expected[:1]
        make_trainer(tmp_path / "run", [Inject(injected), monitor("run")], max_steps=9).fit(
            make_module(), datamodule=make_data(tmp_path), ckpt_path=tmp_path / "run" / "step6.ckpt")
    assert lines("run") == expected
