"""lit_dtrain's callbacks at the edges of a user's own Lightning project: a ``PreemptionCheckpoint`` stop while the
module optimizes by hand (accumulating, or stepping before its backward), a ``WSDScheduler`` whose decay lies past the
fit's last step (automatic and manual optimization, or an early stop) or beside Lightning's ``BackboneFinetuning`` or
SWA, a ``LossSpikeMonitor`` rollback beside ``EMAWeightAveraging`` (``StochasticWeightAveraging``:
``test_rollback_weight_averaging.py``) or across a finetuning unfreeze, exclusions under ``limit_train_batches``. Each
test checks the result (the resumed weights, the EMA, the warning's words), not only that the run finished."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_dtrain.callbacks import FourierSamplerCallback, LossSpikeMonitor, PreemptionCheckpoint, WSDScheduler
from tests.unit._user_project_helpers import UserModule, fit, regression_data
from tests.unit.test_preemption import Own


class SigtermAtBatch(L.Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx, self.sent = batch_idx, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(tmp_path: Path, callbacks, ckpt_path=None) -> tuple[UserModule, L.Trainer]:
    module = UserModule(manual=True, step_every=4)  # 8 batches an epoch: updates at batches 3 and 7
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, regression_data(), ckpt_path=ckpt_path)
    return module, trainer


def test_a_sigterm_between_manual_accumulation_steps_saves_after_the_step_that_takes_the_grads(tmp_path: Path):
    """A module that accumulates by hand (``manual_backward`` every batch, ``step()`` every 4th) gets SIGTERM at batch
    5, mid-window. The save waits for batch 7's update: the file is at step 2, and a resume from it ends with the
    straight run's weights. It saved at batch 5 (step 1) before: the grads of batches 4 and 5 were lost and the resumed
    update at batch 7 had only those of batches 6 and 7 (max weight difference 0.043 after 4 updates)."""
    straight, _ = _fit(tmp_path / "a", [])
    stop = PreemptionCheckpoint(dirpath=str(tmp_path / "ck"))
    try:
        _fit(tmp_path / "b", [SigtermAtBatch(5), stop])
        raise AssertionError("the SIGTERM did not stop the fit")
    except SIGTERMException:
        pass
    assert stop.saved_step == 2
    resumed, trainer = _fit(tmp_path / "c", [], ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    assert trainer.global_step == 4 and resumed.steps_run == 8  # the second epoch only
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


class StepsBeforeBackward(UserModule):
    """Manual optimization that steps the previous batch's grads first, then runs this batch's backward: every batch
    ends with grads no step has taken yet."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        opt = self.optimizers()
        if self.steps_run > 1:
            opt.step()
            opt.zero_grad()
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self(x), y))


def test_a_sigterm_under_manual_optimization_that_steps_before_its_backward_still_saves(tmp_path: Path) -> None:
    """Each batch ends with a backward after its step. The save is at the end of the signal's batch, which stepped:
    waiting for a batch end without grads in flight would never save."""
    stop = PreemptionCheckpoint(dirpath=str(tmp_path / "ck"))
    trainer = L.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[SigtermAtBatch(5), stop])
    with pytest.raises(SIGTERMException):
        trainer.fit(StepsBeforeBackward(), regression_data())
    assert stop.saved_step == trainer.global_step == 5 and (tmp_path / "ck" / "last.ckpt").is_file()


@pytest.mark.parametrize(
    ("total_steps", "decay_steps", "expected"),
    [
        (16, 3, "info"),  # decay at steps 13..15: the 8-step fit ends in the stable phase
        (10, 6, "warning"),  # decay at steps 4..9: cut after step 7
        (8, 3, None),  # the horizon is the fit's
    ],
    ids=["ends_before_the_decay", "ends_inside_the_decay", "matches"],
)
def test_wsd_says_when_the_trainer_stops_before_its_decay_ends(tmp_path: Path, caplog, total_steps, decay_steps,
                                                                expected) -> None:
    """``Trainer(max_steps=8)`` with ``total_steps`` beyond it: the fit never reached min_lr_factor, without a word (a
    ``max_steps`` set too low by mistake gave an undecayed model silently). A fit that ends before the decay is a WSD
    stable run too (branch decays from it later): one info line says it ends at the peak LR; one that ends inside the
    decay is warned about, with the factor its last step ran at."""
    wsd = WSDScheduler(total_steps=total_steps, warmup_steps=2, decay_steps=decay_steps)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer = fit(tmp_path, [wsd], max_steps=8)
    said = [str(w.message) for w in caught if "WSDScheduler: the trainer stops" in str(w.message)]
    infos = [r.getMessage() for r in caplog.records if "WSDScheduler: the trainer stops" in r.getMessage()]
    last_lr = trainer.optimizers[0].param_groups[0]["lr"]  # the LR set for step 8, the next one; step 7's was:
    factor = wsd.lr_factor(7)
    if expected == "info":
        assert factor == 1.0 and said == []
        assert infos == [
            "WSDScheduler: the trainer stops after 8 optimizer steps, before the decay starts at step 13 "
            "(total_steps=16, decay_steps=3): this fit ends at the peak LR, in the stable phase (a stable run to "
            "branch a decay from later). For the decay in this fit, set total_steps=8"
        ]
    elif expected == "warning":
        assert 0.0 < factor < 1.0 and infos == [] and last_lr > 0.0
        assert said == [
            f"WSDScheduler: the trainer stops after 8 optimizer steps, inside the decay (steps 4..9, total_steps=10): "
            f"its last step runs at {factor:.4g} of the peak LR, not min_lr_factor=0.0. Set total_steps=8 (or let "
            f"the trainer run to max_steps=10)"
        ]
    else:
        assert factor == 0.0 and said == [] and infos == []


class StopAt(L.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True  # (what EarlyStopping and max_time do)


@pytest.mark.parametrize("stop", [6, 14, None], ids=["stable_phase", "inside_the_decay", "no_stop"])
def test_wsd_says_when_the_fit_stops_early_before_its_decay_ends(tmp_path: Path, stop: int | None) -> None:
    """``EarlyStopping`` (here ``trainer.should_stop``) ends a 16-step fit whose decay is steps 12..15: the weights are
    those of the stable phase (or of a decay cut short), and the check at train start had seen 16 planned steps, so
    nothing said so. One warning at train end now says where it stopped and how to decay."""
    wsd = WSDScheduler(total_steps=16, decay_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            callbacks=[wsd, StopAt(stop)])
        trainer.fit(Own())
    said = [str(w.message) for w in caught if "WSDScheduler: the fit stopped" in str(w.message)]
    if stop is None:
        assert trainer.global_step == 16 and said == []
        return
    assert trainer.global_step == stop
    assert said == [
        f"WSDScheduler: the fit stopped after {stop} optimizer steps of the 16 it planned (EarlyStopping, max_time or "
        f"trainer.should_stop), before the decay ends (steps 12..15): its last step ran at "
        f"{wsd.lr_factor(stop - 1):.4g}x the peak LR and its weights are not decayed. To decay them, resume from its "
        f"last checkpoint with WSDScheduler(total_steps={stop} + D, decay_steps=D)"
    ]


def test_wsd_stopped_inside_its_warmup_is_told_to_train_past_it_first(tmp_path: Path) -> None:
    """A fit stopped at step 3 inside an 8-step warmup was told to resume with WSDScheduler(total_steps=3 + D,
    decay_steps=D), a horizon inside the warmup, which WSDScheduler refuses (and train.py's decay branch,
    advised the same way, refuses a checkpoint inside the warmup). It is told to train past the warmup first."""
    wsd = WSDScheduler(total_steps=16, warmup_steps=8, decay_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            callbacks=[wsd, StopAt(3)])
        trainer.fit(Own())
    said = [str(w.message) for w in caught if "WSDScheduler: the fit stopped" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(
        "its last step ran at 0.375x the peak LR and its weights are not decayed. To decay them, train on to step 8 "
        "or later first, past the warmup (warmup_steps=8), then resume from its last checkpoint with "
        "WSDScheduler(total_steps=<that step> + D, decay_steps=D)"), said
    with pytest.raises(ValueError, match=r"warmup_steps=8 \+ decay_steps=4 > total_steps=7"):  # the horizon told before
        WSDScheduler(total_steps=3 + 4, warmup_steps=8, decay_steps=4)


class SpikeAt10(Own):
    def training_step(self, batch, batch_idx):
        loss = (self.net(batch["x"]) - batch["y"]).square().mean()  # (Own's spike at step 15 left out)
        return loss * 1000.0 if self.trainer.global_step == 10 else loss


class AverageAfterEachStep(L.Callback):
    """The EMA's parameters at each batch end, by ``global_step``."""

    def __init__(self, ema: EMAWeightAveraging) -> None:
        self.ema, self.seen = ema, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen[trainer.global_step] = [p.detach().clone() for p in self.ema._average_model.module.parameters()]


@pytest.mark.parametrize("ema_first", [True, False], ids=["ema_first", "monitor_first"])
def test_a_rollback_restores_the_ema_of_a_weight_averaging_callback_too(tmp_path: Path, ema_first: bool) -> None:
    """Lightning's ``EMAWeightAveraging`` beside a rolling-back ``LossSpikeMonitor``: the spike at step 10 rolls the
    weights back to the snapshot after step 8, and the EMA goes back with them, to its value after step 8 in either
    callback order. It kept the discarded steps (the spike's weights among them): 0.115 (EMA first) and 0.062 (monitor
    first) off, with decay 0.5, in the EMA model that is evaluated and saved."""
    ema = EMAWeightAveraging(decay=0.5)
    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=4, snapshot_every=2, snapshot_keep=2,
                               path=str(tmp_path / "spikes.jsonl"))
    seen = AverageAfterEachStep(ema)
    trainer = L.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[ema, monitor, seen] if ema_first else [monitor, ema, seen])
    trainer.fit(SpikeAt10())
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events] == [(10, 8)]
    assert not all(torch.equal(p, q) for p, q in zip(seen.seen[8], seen.seen[10]))  # the EMA moved in steps 9, 10
    for p, q in zip(seen.seen[8], seen.seen[11]):
        assert torch.equal(p, q)


class LrAtEachStep(L.Callback):
    def __init__(self) -> None:
        self.lrs = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def test_wsd_says_that_stochastic_weight_averaging_lrs_do_not_apply(tmp_path: Path) -> None:
    """``StochasticWeightAveraging(swa_lrs=0.01)`` beside ``WSDScheduler``: SWA's SWALR sets the LR at its epochs' ends,
    WSD at every step, so every step runs at WSD's LR (0.05, the peak, through epoch 1) and swa_lrs never apply. That
    went without a word (Lightning's SWA takes over a module's own scheduler, so a user expects its LR); one warning
    now says which LR the run uses."""
    lrs = LrAtEachStep()
    wsd = WSDScheduler(total_steps=32, decay_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            callbacks=[wsd, StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1), lrs])
        trainer.fit(Own())
    said = [str(w.message) for w in caught if "StochasticWeightAveraging's swa_lrs" in str(w.message)]
    assert said == [
        "WSDScheduler sets the LR at every step, so StochasticWeightAveraging's swa_lrs (its SWALR schedule) do not "
        "apply: the LR stays WSD's and SWA only averages the weights (at each epoch start from swa_epoch_start). For "
        "SWA's LR, leave WSDScheduler out"
    ]
    assert sorted(lrs.lrs) == list(range(32))
    assert all(lr == pytest.approx(0.05 * wsd.lr_factor(step)) for step, lr in lrs.lrs.items())


class WithBackbone(UserModule):
    """``BackboneFinetuning``'s contract: a ``backbone`` attribute, an optimizer over the trainable parameters."""

    @property
    def backbone(self):
        return self.net[0]

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], 1e-2)


def test_wsd_refuses_a_finetuning_callback_that_adds_param_groups_at_fit_start(tmp_path: Path) -> None:
    """``BackboneFinetuning`` adds the backbone's param group at its unfreeze epoch and sets that group's LR itself.
    The fit failed there, at step 8 after the frozen epoch had trained ("a param group added during training has no
    peak LR"); it is refused before the first step now, naming the callback."""
    module = WithBackbone()
    with pytest.raises(RuntimeError) as caught:
        fit(tmp_path, [BackboneFinetuning(unfreeze_backbone_at_epoch=1), WSDScheduler(total_steps=16, decay_steps=4)],
            module, max_steps=16)
    assert str(caught.value).startswith(
        "WSDScheduler sets the LR of the param groups it finds at fit start, but ['BackboneFinetuning'] adds param "
        "groups during training"
    )
    assert module.steps_run == 0


class UnfrozenAtEpoch1(Own):
    """16 batches an epoch; ``BackboneFinetuning`` adds the first layer's param group at epoch 1 (step 16); the loss
    spikes at step 17."""

    @property
    def backbone(self):
        return self.net[0]

    def training_step(self, batch, batch_idx):
        loss = (self.net(batch["x"]) - batch["y"]).square().mean()  # (Own's spike at step 15 left out)
        return loss * 1000.0 if self.trainer.global_step == 17 else loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


class WeightsAfterEachStep(L.Callback):
    def __init__(self) -> None:
        self.seen = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]


def test_a_rollback_past_a_finetuning_unfreeze_drops_the_step_and_says_why(tmp_path: Path) -> None:
    """The snapshots (after steps 12 and 16, taken at batch end) hold one param group; the unfreeze at step 16 added
    a second. The rollback at step 17 failed in torch's ``load_state_dict`` ("loaded state dict has a different number
    of parameter groups", a ValueError mid-training). Now the step is dropped as a skip (the weights stay those after
    step 17's predecessor), with a warning, and ``rolled_back_to`` is None."""
    monitor = LossSpikeMonitor(actions=["log", "rollback"], warmup_steps=4, snapshot_every=4, snapshot_keep=2,
                               path=str(tmp_path / "spikes.jsonl"))
    weights = WeightsAfterEachStep()
    trainer = L.Trainer(accelerator="cpu", max_steps=20, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), monitor, weights])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(UnfrozenAtEpoch1())
    assert [len(o.param_groups) for o in trainer.optimizers] == [2]
    assert_dropped_at_17(monitor, caught, weights)


def assert_dropped_at_17(monitor: LossSpikeMonitor, caught, weights: WeightsAfterEachStep) -> None:
    """The spike at step 17 found no snapshot of the current layout: dropped as a skip, with the warning."""
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events] == [(17, None)]
    assert [str(w.message) for w in caught if "no snapshot to roll back to" in str(w.message)] == [
        "LossSpikeMonitor: no snapshot to roll back to at step 17: the optimizers' param groups or the module's state "
        "keys changed since the last one (a BaseFinetuning unfreeze adds a group, ModelPruning's first prune adds "
        "weight_orig and weight_mask); the spike's step is dropped as with 'skip', the weights stay; snapshots start "
        "again from the next one"
    ]
    for p, q in zip(weights.seen[17], weights.seen[18]):  # the spike's step (global_step 17 -> 18) changed nothing
        assert torch.equal(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(weights.seen[18], weights.seen[19]))  # the next one trains


class SpikesAt6And7(Own):
    def training_step(self, batch, batch_idx):
        loss = (self.net(batch["x"]) - batch["y"]).square().mean()
        return loss * 1000.0 if self.trainer.global_step in (6, 7) else loss


def test_limit_train_batches_bounds_the_samples_an_exclusion_can_use_up(tmp_path: Path) -> None:
    """``limit_train_batches=2`` of a sequential DataLoader of 64 samples (batches of 4): every epoch draws samples
    0..7. The spikes at steps 6 and 7 exclude all 8, so every later step would be skipped: that is refused at the
    exclusion. Before, the count compared was the dataset's 64: 22 of 30 steps trained nothing and the run exited 0."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    trainer = L.Trainer(accelerator="cpu", max_steps=30, limit_train_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[monitor])
    with pytest.raises(RuntimeError) as caught:
        trainer.fit(SpikesAt6And7())
    assert trainer.global_step == 8 and sorted(monitor.excluded) == list(range(8))
    assert "spike at step 7 failed (2 spikes, 8 samples excluded in all): every sample of the train DataLoader's " \
           "dataset that its epochs draw (8, indices 0..7) has been excluded" in str(caught.value)


@pytest.mark.parametrize(("total_steps", "said"), [(8, True), (4, False)], ids=["max_steps", "max_steps_over_2"])
def test_wsd_under_manual_optimization_says_at_train_end_when_the_updates_fell_short(tmp_path: Path, caplog,
                                                                                       total_steps, said) -> None:
    """Two optimizers stepping every batch, ``max_steps=8`` (``global_step`` counts both: 4 updates each). With
    ``total_steps=8`` the schedule's decay (steps 5..7) never came, without a word; an info line at train end now
    says so and names the fix. ``total_steps=max_steps / 2``, as documented, says nothing."""
    wsd = WSDScheduler(total_steps=total_steps, warmup_steps=1, decay_steps=3 if total_steps == 8 else 2)
    with caplog.at_level(logging.INFO):
        fit(tmp_path, [wsd], UserModule(manual=True, two=True), max_steps=8)
    assert wsd.updates == [4, 4]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("WSDScheduler: the fit ended")]
    assert lines == ([
        "WSDScheduler: the fit ended after 4 updates of its optimizer(s) (manual optimization), before the decay "
        "starts at step 5 (total_steps=8, decay_steps=3): this fit ends at the peak LR, in the stable phase (a stable "
        "run to branch a decay from later). For the decay in this fit, set total_steps=4 (with k optimizers that step "
        "every batch, max_steps / k)"
    ] if said else [])


class OwnDataModule(L.LightningDataModule):
    def train_dataloader(self):
        return regression_data()


def test_the_fourier_sampler_beside_a_datamodule_of_ones_own_names_lmdatamodule(tmp_path: Path) -> None:
    """A datamodule of one's own (no ``sampler``) was told 'got NoneType; select it with `data/sampler=fourier`', a
    config group of train.py, with no word of the LMDataModule and FourierSampler the callback needs."""
    module = UserModule()
    with pytest.raises(TypeError, match=r"sampler to be a FourierSampler, got none: OwnDataModule has no attribute "
                                        r"'sampler'; pass trainer.fit\(datamodule=LMDataModule\(\.\.\., "
                                        r"sampler=FourierSampler\(\.\.\.\)\)\) \(from lit_dtrain.data and "
                                        r"lit_dtrain.data.samplers\)"):
        fit(tmp_path, [FourierSamplerCallback()], module, max_steps=2, datamodule=OwnDataModule())
    assert module.steps_run == 0
