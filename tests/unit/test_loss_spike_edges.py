"""LossSpikeMonitor edge cases found by audits: check_grad=false with a NaN gradient, ``training_step`` returning
None under gradient accumulation, a plain DataLoader whose indices are not ``0..n-1``."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import LossSpikeMonitor
from lit_dtrain.module import NonFiniteError
from tests.unit._loss_spike_helpers import make_data, make_module, make_trainer, one_thread  # noqa: F401


class NanGradAt(L.Callback):
    """Make one gradient element NaN after backward at the given global step (the loss stays finite: an overflow in
    backward)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            p = next(p for p in pl_module.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")


def unchecked_module():
    module = make_module()
    module.check_finite = False  # LitLLM's own stop off: only the monitor stands between a NaN grad and the weights
    return module


@pytest.mark.parametrize("nan_step", [4, 9])
@pytest.mark.parametrize(("check_grad", "actions"), [(False, ["log", "skip"]), (True, ["log", "lr_cooldown"])])
def test_an_applied_nan_gradient_never_ends_a_run_with_nan_weights(tmp_path: Path, nan_step: int, check_grad: bool,
                                                                   actions: list[str]) -> None:
    """check_grad=false does not look at the gradients, and actions without skip/rollback drop nothing, so a NaN
    gradient (under a finite loss) is applied. Before, every later (NaN) loss was skipped (its healthy batch's samples
    excluded) or cooled down, and a run that ended within max_nonfinite steps of the update (here 10) ended normally
    with NaN weights. Now it stops at the first NaN loss (update at step 4: loss at 5), or after the last step (9),
    before a checkpoint could save the weights."""
    monitor = LossSpikeMonitor(actions=actions, warmup_steps=3, check_grad=check_grad)
    trainer = make_trainer(tmp_path, [NanGradAt(nan_step), monitor], max_steps=10)
    module = unchecked_module()
    why = "check_grad=false does not look for" if not check_grad else r"actions \['log', 'lr_cooldown'\] do not drop"
    with pytest.raises(NonFiniteError, match=rf"weights are non-finite .* (applied, which {why})"):
        trainer.fit(module, datamodule=make_data(tmp_path))
    assert trainer.global_step == min(nan_step + 1, 10)
    assert monitor.excluded == []  # no healthy batch was blamed


def test_check_grad_false_with_rollback_restores_finite_weights(tmp_path: Path) -> None:
    """With rollback the first NaN loss restores a snapshot from before the update: the run goes on, finite."""
    monitor = LossSpikeMonitor(actions=["log", "rollback"], warmup_steps=3, check_grad=False, snapshot_every=2)
    trainer = make_trainer(tmp_path, [NanGradAt(4), monitor], max_steps=10)
    module = unchecked_module()
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert trainer.global_step == 10
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events] == [(5, 4)]
    assert all(bool(p.isfinite().all()) for p in module.parameters())



@pytest.mark.parametrize(("monitor_args", "fix"), [
    (None, r"To go on, enable 'callbacks=\[default,loss_spike\]'"),
    ({"actions": ["log"]}, r"let them through: add 'skip' or 'rollback' to its actions \(\['log'\] drop no step\)"),
    ({"actions": ["log", "skip"], "check_grad": False}, r"let them through: set its check_grad=true"),
    ({"actions": ["log", "lr_cooldown"], "check_grad": False}, r"check_grad=true .* and add 'skip' or 'rollback'"),
])
def test_the_non_finite_gradient_stop_names_the_monitor_setting_that_let_them_through(tmp_path: Path, monitor_args,
                                                                                      fix: str) -> None:
    """LitLLM's stop at a NaN gradient (finite loss) told the user to enable 'callbacks=[default,loss_spike]' also
    where the monitor was on, with check_grad=false or actions that drop no step: now it names that setting."""
    monitor = [] if monitor_args is None else [LossSpikeMonitor(warmup_steps=3, **monitor_args)]
    trainer = make_trainer(tmp_path, [NanGradAt(4), *monitor], max_steps=6)
    with pytest.raises(NonFiniteError, match=rf"non-finite gradients at step 4 .*{fix}"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))


class NoneAt(L.Callback):
    """``training_step`` returns None (Lightning's way to skip a batch) at the given batch indices; records the
    sample indices of those micro-batches."""

    def __init__(self, batches: set[int]) -> None:
        self.batches, self.skipped = batches, []

    def setup(self, trainer, pl_module, stage) -> None:
        original = pl_module.training_step

        def training_step(batch, batch_idx, *args, **kwargs):
            if batch_idx in self.batches:
                self.skipped.extend(int(i) for i in batch["index"])
                return None
            return original(batch, batch_idx, *args, **kwargs)

        pl_module.training_step = training_step


class PoisonAt(L.Callback):
    """NaN logits in every micro-batch of the given optimizer step."""

    def __init__(self, step: int) -> None:
        self.step, self.trained = step, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._handle = None
        if trainer.global_step == self.step:
            self.trained.append([int(i) for i in batch["index"]])
            self._handle = pl_module.model.register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._handle is not None:
            self._handle.remove()


def test_a_micro_batch_that_returns_none_is_not_excluded_with_its_steps_spike(tmp_path: Path) -> None:
    """accumulate_grad_batches=2, step 3 = batches 6 and 7; batch 6 returns None, batch 7 is a NaN spike: only batch
    7's samples are excluded (batch 6's were too, though it was never trained on)."""
    none, poison = NoneAt({6}), PoisonAt(3)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=[none, poison, monitor], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), limit_val_batches=0, accumulate_grad_batches=2)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert len(none.skipped) == 4 and len(poison.trained) == 2
    (event,) = monitor.events
    assert event["step"] == 3 and event["index"] == poison.trained[1]
    assert sorted(monitor.excluded) == sorted(poison.trained[1])
    assert not set(none.skipped) & set(monitor.excluded)


class ShiftedIds(torch.utils.data.Dataset):
    """A user's dataset whose ``index`` is a global id (``1000 + i``: a shard of a larger corpus), not ``0..n-1``."""

    def __init__(self) -> None:
        from tests.unit._user_project_helpers import IndexedDataset

        self.inner = IndexedDataset()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        return {**self.inner[i], "index": 1000 + i}


class SpikesAt(L.LightningModule):
    """The foreign project's dict-batch module with a 100x loss at the given steps."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        from tests.unit._user_project_helpers import DictBatchModule

        self.inner, self.steps = DictBatchModule(), steps

    def training_step(self, batch, batch_idx):
        return self.inner.training_step(batch, batch_idx) * (100.0 if self.global_step in self.steps else 1.0)

    def configure_optimizers(self):
        return self.inner.configure_optimizers()


@pytest.mark.parametrize(("batch_size", "spikes"), [(64, {6}), (16, {6, 7, 8, 9})])
def test_a_plain_dataloader_whose_ids_are_not_0_to_n_minus_1_still_stops_when_every_step_is_skipped(
    tmp_path: Path, batch_size: int, spikes: set[int]
) -> None:
    """Without a sampler, a later step whose batch holds an excluded index is skipped. The check that the exclusions
    leave something to train on compared them with ``0..len(dataset)-1``: with ids 1000..1063, spikes that excluded
    them all (one full batch, or the 4 batches of an epoch) left every later step skipped, and the run ended normally
    having trained nothing more. Now it stops after an epoch's worth of such steps."""
    data = DataLoader(ShiftedIds(), batch_size=batch_size, shuffle=False)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", max_steps=40, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    with pytest.raises(RuntimeError, match=r"\(an epoch of the train DataLoader\) (was|were all) skipped"
                                           r".* 64 sample ids are excluded and the dataset has 64") as excinfo:
        trainer.fit(SpikesAt(spikes), data)
    steps_per_epoch = 64 // batch_size
    said = "1 step (an epoch of the train DataLoader) was skipped" if steps_per_epoch == 1 else (
        f"{steps_per_epoch} steps (an epoch of the train DataLoader) were all skipped")
    assert f"the last {said}" in str(excinfo.value)  # at batch_size 64: "the last 1 steps (...) were all skipped"
    assert sorted(monitor.excluded) == list(range(1000, 1064))
    assert trainer.global_step == max(spikes) + 1 + steps_per_epoch
    assert [e["reasons"] for e in monitor.events][-steps_per_epoch:] == [["excluded_sample"]] * steps_per_epoch


def test_exclusions_that_leave_samples_to_train_on_never_stop_a_plain_dataloader_run(tmp_path: Path) -> None:
    """16 of 64 ids excluded (one spike, batch 16, shuffled): most later steps hold one of them and are skipped, but
    some train, so the run goes on to max_steps (an epoch of skipped steps in a row is no error here)."""
    data = DataLoader(ShiftedIds(), batch_size=16, shuffle=True)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, rel_threshold=10.0,  # only the 100x loss
                               path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", max_steps=40, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    trainer.fit(SpikesAt({6}), data)
    assert trainer.global_step == 40 and len(monitor.excluded) == 16
    skipped = [e for e in monitor.events if e["reasons"] == ["excluded_sample"]]
    assert len(skipped) >= 4  # (the run had an epoch's worth of them)


def test_the_weights_check_does_not_call_large_finite_fp16_weights_non_finite() -> None:
    """Under 16-true the norm of finite fp16 weights overflows (1e6 values of 100: inf), so a check by norm would have
    stopped a healthy run; the check is isfinite itself."""
    from types import SimpleNamespace

    from lit_dtrain.callbacks._spike_step import weights_finite

    trainer = SimpleNamespace(world_size=1)
    module = torch.nn.Linear(1000, 1000).half()
    with torch.no_grad():
        module.weight.fill_(100.0)
    assert weights_finite(trainer, module)
    with torch.no_grad():
        module.bias[3] = float("nan")
    assert not weights_finite(trainer, module)


def test_the_weights_checks_all_reduce_runs_on_the_strategys_device_for_an_empty_or_offloaded_shard() -> None:
    """A rank whose FSDP shard is empty took the CPU for its flag (NCCL reduces CUDA tensors only), as did a
    CPU-offloaded shard; the flag is on ``root_device`` now (``meta`` stands in for a GPU)."""
    from types import SimpleNamespace

    from lit_dtrain.callbacks._spike_step import weights_finite

    reduced_on = []
    strategy = SimpleNamespace(root_device=torch.device("meta"),
                               reduce=lambda t, reduce_op: reduced_on.append(t.device) or torch.zeros(()))
    trainer = SimpleNamespace(world_size=2, strategy=strategy)
    assert weights_finite(trainer, torch.nn.Linear(0, 0))  # an empty shard (FSDP's flat parameter of 0 elements)
    assert weights_finite(trainer, torch.nn.Linear(4, 4))  # a shard offloaded to the CPU
    assert reduced_on == [torch.device("meta")] * 2


class NegativeLoss(L.LightningModule):
    """A user's objective that is negative (a Gaussian NLL-like MSE - 5), with a 100x MSE at step 12."""

    def __init__(self) -> None:
        super().__init__()
        from tests.toys import TinyRegression

        self.inner = TinyRegression()

    def training_step(self, batch, batch_idx):
        mse = self.inner.loss(batch)
        return mse * (100.0 if self.global_step == 12 else 1.0) - 5.0

    def configure_optimizers(self):
        return self.inner.configure_optimizers()

    def train_dataloader(self):
        return self.inner.train_dataloader()


def test_a_spike_of_a_negative_loss_is_detected(tmp_path: Path) -> None:
    """The relative rise was ``loss / location - 1``, and 0 for a location <= 0: with rel_threshold set (the default)
    no spike of a negative loss could be found, and a 300x rise (-1.9 -> 623) was trained on. It is now
    ``(loss - location) / |location|``."""
    from lit_dtrain.callbacks._spike_stats import relative_rise

    assert relative_rise(3.0, 2.0) == 0.5 and relative_rise(-1.0, -2.0) == 0.5 and relative_rise(-3.0, -2.0) == -0.5
    assert relative_rise(1.0, 0.0) == math.inf and relative_rise(0.0, 0.0) == 0.0
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5, path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    trainer.fit(NegativeLoss())
    assert [(e["step"], e["reasons"]) for e in monitor.events] == [(12, ["loss"])]
    assert monitor.detector.loss_stat.location() < 0


def test_a_lasting_shift_under_max_consecutive_null_is_told_without_the_log_action(tmp_path: Path, caplog) -> None:
    """max_consecutive=None never accepts a new level: a loss 30x from step 8 on makes every later step a spike, and
    ``skip`` drops them all. Without ``log`` nothing said so (the run ended with exit 0, 17 of its 25 steps dropped);
    now a warning comes once the run of spikes reaches 10 steps (and 100, 1000 ...)."""
    from tests.unit._loss_spike_helpers import Inject

    monitor = LossSpikeMonitor(actions=["skip"], warmup_steps=5, max_consecutive=None,
                               path=str(tmp_path / "spikes.jsonl"))
    trainer = make_trainer(tmp_path, [Inject({s: "x" for s in range(8, 25)}), monitor], max_steps=25)
    with caplog.at_level("WARNING", logger="lit_dtrain.callbacks.loss_spike"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert len(monitor.events) == 17 and [e["step"] for e in monitor.events] == list(range(8, 25))
    warned = [r.getMessage() for r in caplog.records if "max_consecutive=null" in r.getMessage()]
    assert warned == [warned[0]] and "the last 10 steps (to step 17) were all spikes" in warned[0]


class OtherRankStops:
    """A stand-in Trainer of rank 1 of 2 under DDP, whose other rank has a reason to stop: the sum-reduce of the
    ranks' stop flags gives this rank's flag + 1."""

    world_size, num_training_batches, accumulate_grad_batches = 2, 6, 1

    def __init__(self) -> None:
        self.strategy = self
        self.root_device = torch.device("cpu")
        self.reduced = []

    def reduce(self, tensor, reduce_op):
        self.reduced.append(reduce_op)
        return tensor + 1


def test_every_rank_stops_together_when_another_ranks_shard_is_all_excluded() -> None:
    """A user's own per-rank shards (plain DataLoader, use_distributed_sampler=False) differ in size: the exclusions
    can cover rank 0's 8 samples but not this rank's 24. Before, only rank 0 raised and this rank failed in its next
    collective (2 gloo ranks: "Connection closed by peer"; NCCL: a wait for its timeout). Now both checks reduce a stop
    flag, and this rank raises too, naming the other rank."""
    from lit_dtrain.callbacks._spike_samples import ExcludedOnlyRun

    monitor = LossSpikeMonitor(actions=["log", "skip"])
    monitor._sampler, monitor._num_train_samples, monitor._device = None, 24, torch.device("cpu")
    trainer = OtherRankStops()
    with pytest.raises(RuntimeError, match=r"excluded on 1 other rank\(s\) of 2"):
        monitor.exclude(list(range(8)), trainer)  # this rank's own 24 are not all excluded
    run = ExcludedOnlyRun()
    with pytest.raises(RuntimeError, match=r"on 1 other rank\(s\) of 2, an epoch .* all skipped"):
        run.update(trainer, {"counted": False}, 16, 24)  # 16 of this rank's 24: its own check passes
    assert trainer.reduced == ["sum", "sum"]
    run.update(trainer, None, 16, 24)  # a step that trained: no check, no collective
    assert run.steps == 0 and len(trainer.reduced) == 2


class _Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((4,), float(i)), "index": i}


class _NanFirstStep(L.LightningModule):
    """A user's module whose first step's loss is NaN (a spike at step 0, within any warmup)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch["x"]).pow(2).mean()
        return loss * float("nan") if self.global_step == 0 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("limits", [{"fast_dev_run": True}, {"max_steps": 1}, {"max_steps": 2}])
def test_a_spike_that_excludes_every_sample_at_the_last_step_ends_the_fit(tmp_path: Path, limits: dict) -> None:
    """Trainer(fast_dev_run=True) (or max_steps=1) with a spike on its single batch, which holds the whole dataset,
    raised 'every sample ... (8, indices 0..7) has been excluded, so every later step would be skipped': no later
    step comes. It ends the fit now, the samples excluded; with a step to come (max_steps=2) it still raises."""
    monitor = LossSpikeMonitor(actions=["log", "skip"])
    trainer = L.Trainer(callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu", **limits)
    loader = DataLoader(_Indexed(), batch_size=8)
    if limits.get("max_steps") == 2:
        with pytest.raises(RuntimeError, match=r"every sample .* \(8, indices 0\.\.7\) has been excluded"):
            trainer.fit(_NanFirstStep(), loader)
        return
    trainer.fit(_NanFirstStep(), loader)
    assert trainer.global_step == 1 and sorted(monitor.excluded) == list(range(8))


@pytest.mark.parametrize("limits", [{"fast_dev_run": 2}, {"max_steps": 2}])
def test_the_every_sample_excluded_error_points_at_spikes_jsonl_only_where_it_is_written(tmp_path: Path,
                                                                                          limits: dict) -> None:
    """Trainer(fast_dev_run=2) writes no spikes.jsonl (a smoke test's), yet its 'every sample ... has been excluded'
    error ended 'See <default_root_dir>/spikes.jsonl'. Now it names no file there; a run that writes one still does."""
    monitor = LossSpikeMonitor(actions=["log", "skip"])
    trainer = L.Trainer(callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu", **limits)
    with pytest.raises(RuntimeError, match=r"has been excluded") as raised:
        trainer.fit(_NanFirstStep(), DataLoader(_Indexed(), batch_size=8))
    events = tmp_path / "spikes.jsonl"
    assert raised.value.args[0].endswith(f"'skip'/'rollback'. See {events}") == events.exists()
    assert events.exists() == ("max_steps" in limits)


@pytest.mark.parametrize(("kwargs", "inject", "error", "message"), [
    ({"actions": ["log", "skip", "raise"], "raise_after": 1, "raise_window": 1}, {5: "finite"}, "LossSpikeError",
     "LossSpikeMonitor: 1 loss spike within 1 step (step 5, raise_after=1); see "),  # "1 loss spikes within 1 steps"
    ({"actions": ["log", "skip"], "max_nonfinite": 1}, {5: "nan"}, "NonFiniteError",
     "LossSpikeMonitor: 1 non-finite (NaN/inf) step, step 5 (max_nonfinite=1); "),  # was "1 ... steps in a row, 5-5"
])
def test_a_stop_at_one_spike_names_it_in_the_singular(tmp_path: Path, kwargs, inject, error, message) -> None:
    from tests.unit._loss_spike_helpers import Inject

    trainer = make_trainer(tmp_path, [Inject(inject), LossSpikeMonitor(warmup_steps=3, **kwargs)], max_steps=8)
    with pytest.raises(Exception) as raised:
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert type(raised.value).__name__ == error and str(raised.value).startswith(message)
