"""lit_dtrain's callbacks in a Lightning project of one's own, in the combinations a user sets up beside them: the
save schedule of ``ModelCheckpoint``, a frozen backbone in the optimizer of ``OptimizerDiagnostics``, two optimizers
under manual optimization beside the ``FourierSampler``, per-token losses of the wrong shape, a rollback under
``OneCycleLR``. Each test checks the result (which files were written at which step, the logged value, the LR each
update used, the error's words), not only that the run finished. (The basic contract is in
``test_callbacks_in_foreign_projects.py``.)"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks import AdaptiveGradClip, ModelCheckpoint, OptimizerDiagnostics
from tests.unit._user_project_helpers import fit


def data(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SaveSteps(L.Callback):
    """The global step of every checkpoint written."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.steps.append(trainer.global_step)


def _save_steps(tmp_path: Path, cls, **kwargs) -> list[int]:
    saves = SaveSteps()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=4, limit_train_batches=4, val_check_interval=0.5, num_sanity_val_steps=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[cls(dirpath=tmp_path / cls.__module__.split(".")[0], save_last=True, **kwargs), saves],
    )
    trainer.fit(Regression(), data(), data())
    return saves.steps


@pytest.mark.parametrize("trigger", [{"every_n_epochs": 2}, {"every_n_train_steps": 5}, {}])
def test_model_checkpoint_writes_last_ckpt_on_the_users_save_schedule(tmp_path: Path, trigger: dict) -> None:
    """A validation is a save point only in an epoch that ``every_n_epochs`` selects (every epoch without a trigger;
    none with ``every_n_train_steps`` alone), as in Lightning; there ``last.ckpt`` is written also when the top-k did
    not change. It was written at every validation: ``every_n_train_steps=5`` with two validations per 4-step epoch
    gave 13 writes (steps 2, 4, 5, 5, 6, 8, 10, 10, ...) where Lightning writes 6."""
    ours = _save_steps(tmp_path, ModelCheckpoint, **trigger)
    if trigger:  # no monitor: every save point saves top-k and last, so Lightning's own schedule is the reference
        assert ours == _save_steps(tmp_path, LightningModelCheckpoint, **trigger)
    want = {"every_n_epochs": [6, 6, 8, 8, 14, 14, 16, 16], "every_n_train_steps": [5, 5, 10, 10, 15, 15]}
    assert ours == want.get(next(iter(trigger), None), [s for s in (2, 4, 6, 8, 10, 12, 14, 16) for _ in (0, 1)])


def test_model_checkpoint_with_a_monitor_writes_last_ckpt_at_every_validation(tmp_path: Path) -> None:
    """``monitor`` with ``save_top_k=1``: Lightning writes ``last.ckpt`` only when the best changes; lit_dtrain's at
    every validation of the schedule (every epoch here), the best or not."""
    ours = _save_steps(tmp_path, ModelCheckpoint, monitor="val_loss", mode="max", save_top_k=1)
    assert ours == [2, 2, 4, 6, 8, 10, 12, 14, 16]  # (mode=max: the first validation stays the best)
    ours = _save_steps(tmp_path / "b", ModelCheckpoint, monitor="val_loss", mode="max", every_n_epochs=2)
    assert ours == [6, 6, 8, 14, 16]  # the first one of the schedule is also the best


class FineTune(Regression):
    """A frozen backbone and an unused layer; ``all_params``: ``AdamW(self.parameters())``, as fine-tuning code often
    has it (torch skips the parameters without a grad), else only the trained ones."""

    def __init__(self, all_params: bool) -> None:
        super().__init__()
        self.backbone, self.unused, self.all_params = nn.Linear(4, 4), nn.Linear(4, 4), all_params
        self.backbone.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(self.backbone(x)), y)

    def configure_optimizers(self):
        params = self.parameters() if self.all_params else self.net.parameters()
        return torch.optim.AdamW(params, lr=0.01)


@pytest.mark.parametrize("all_params", [True, False])
def test_optimizer_diagnostics_measures_the_parameters_the_update_changed(tmp_path: Path, all_params: bool) -> None:
    """``update_to_param_rms`` is that of the parameters the step updated: a frozen backbone and an unused layer in the
    same param group, which AdamW leaves alone, made it 2.9x smaller here (0.0073 for 0.0214: their weights counted in
    the RMS)."""
    diag, module = OptimizerDiagnostics(every_n_steps=3), FineTune(all_params)
    before = {}

    class Before(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before.update({n: p.detach().clone() for n, p in pl_module.net.named_parameters()})

    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Before(), diag])
    trainer.fit(module, data())
    delta = torch.cat([(p.detach() - before[n]).flatten() for n, p in module.net.named_parameters()])
    old = torch.cat([before[n].flatten() for n, _ in module.net.named_parameters()])
    assert diag.last["optim/0/update_to_param_rms"] == pytest.approx((delta.norm() / old.norm()).item(), rel=1e-5)


class TwoOptimizerLM(L.LightningModule):
    """A user's LM with two optimizers stepped by hand each batch (as Muon + AdamW setups are), returning the keys the
    FourierSampler reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        token_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        token_loss = token_loss.view_as(batch["labels"])
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(token_loss.mean())
        for opt in self.optimizers():
            opt.step()
        return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.embed.parameters(), 0.1), torch.optim.SGD(self.head.parameters(), 0.1)


def test_fourier_sampler_stages_follow_the_batches_of_two_optimizers_under_manual_optimization(tmp_path: Path):
    """Lightning's ``global_step`` counts both optimizers' steps, two a batch: the sampler's stages (LR multiplier,
    mix, bands) came twice as fast, and at batch 2 the first optimizer's update took the warmup's x0.1 and the second's
    the ramp's x0.5. Each batch's updates now take the stage of that batch, and the sampler is fed under it."""
    from lit_dtrain.callbacks import FourierSamplerCallback
    from tests.unit._user_project_helpers import lm_data

    used = []

    class LRs(L.Callback):
        def on_train_start(self, trainer, pl_module):  # (after the callback's pre-hook, which scales the LR)
            for k, opt in enumerate(trainer.optimizers):
                opt.register_step_pre_hook(lambda o, args, kwargs, k=k: used.append(
                    (trainer.fit_loop.epoch_loop.batch_idx, k, o.param_groups[0]["lr"] / 0.1)))

    data = lm_data(tmp_path)  # FourierSampler(step_unit=1): x0.1 for steps 0-4, then x0.5 (the brief's stages)
    trainer = L.Trainer(accelerator="cpu", max_steps=24, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FourierSamplerCallback(), LRs()], default_root_dir=str(tmp_path))
    trainer.fit(TwoOptimizerLM(), datamodule=data)
    sampler = data.sampler
    assert [b for b, _, _ in used] == [b for b in range(12) for _ in (0, 1)]
    assert [pytest.approx(m) for _, _, m in used] == [sampler.lr_multiplier(b) for b, _, _ in used]
    assert [m for b, _, m in used if b in (2, 9)] == pytest.approx([0.1, 0.1, 0.5, 0.5])  # (0.1, 0.5 and 1.0, 1.0)
    assert (sampler.updates, sampler.last_step) == (12, 11)  # (12, 22)


class ReshapedOutputs(TwoOptimizerLM):
    """``training_step`` outputs as user code gets them wrong: ``change`` rewrites ``token_loss`` or ``index``."""

    def __init__(self, change) -> None:
        super().__init__()
        self.automatic_optimization, self.change = True, change

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        token_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        out = {"loss": token_loss.mean(), "token_loss": token_loss.view_as(batch["labels"]), "index": batch["index"]}
        return {**out, **self.change(out)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)


RESHAPED = {  # what the user returned -> what the error says (None: accepted)
    "flattened": (lambda o: {"token_loss": o["token_loss"].flatten()}, r"'token_loss' is a torch.float32 tensor of "
                  r"shape \(64,\), not the per-token loss \[B, T\].*\.view_as\(labels\)"),
    "per_sample": (lambda o: {"token_loss": o["token_loss"].mean(1)}, r"'token_loss' is a .* of shape \(4,\)"),
    "transposed": (lambda o: {"token_loss": o["token_loss"].t()},
                   r"'index' holds 4 sample indices for the 16 rows of 'token_loss' \(16, 4\)"),
    "2d_index": (lambda o: {"index": o["index"][:, None]}, r"'index' is a torch.int64 tensor of shape \(4, 1\)"),
    "float_index": (lambda o: {"index": o["index"].float()}, r"'index' is a torch.float32 tensor"),
    "list_index": (lambda o: {"index": o["index"].tolist()}, None),
}


@pytest.mark.parametrize("name", list(RESHAPED))
def test_fourier_sampler_callback_names_a_token_loss_or_index_of_the_wrong_shape(tmp_path: Path, name: str) -> None:
    """A flattened ``[B*T]`` or a per-sample ``[B]`` token loss, a 2-D or float ``index``: a ``StepOutputError`` that
    names the callback, the key, the shape and the fix, at the end of the first step. They raised the sampler's
    ``ValueError: need token_loss [B, T] and index [B], got (64,) and (4,)``, and a list ``index`` an
    ``AttributeError: 'list' object has no attribute 'shape'``; a list of integers is now taken as the tensor."""
    from lit_dtrain.callbacks import FourierSamplerCallback
    from lit_dtrain.callbacks._contract import StepOutputError
    from tests.unit._user_project_helpers import lm_data

    change, error = RESHAPED[name]
    data = lm_data(tmp_path)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FourierSamplerCallback()], default_root_dir=str(tmp_path))
    if error is None:
        trainer.fit(ReshapedOutputs(change), datamodule=data)
        assert data.sampler.updates == 3
        return
    with pytest.raises(StepOutputError, match=r"^FourierSamplerCallback: in what training_step returned, " + error):
        trainer.fit(ReshapedOutputs(change), datamodule=data)
    assert trainer.global_step == 1 and data.sampler.updates == 0


class CycledMomentum(L.LightningModule):
    """AdamW under ``OneCycleLR``, which cycles beta1 with the LR; dict batches with ``index``; the loss of
    ``spike_at`` x1000."""

    def __init__(self, spike_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.spike_at = nn.Linear(4, 1), spike_at

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch["x"]), batch["y"])
        return loss * 1000 if self.global_step == self.spike_at else loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=16, base_momentum=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


class IndexedPairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True), "index": i}


def _hparams_used(tmp_path: Path, spike_at: int | None) -> tuple[list, list]:
    from lit_dtrain.callbacks import LossSpikeMonitor

    used = []

    class Used(L.Callback):  # each update's LR and beta1 (a pre-hook: no callback here scales them)
        def on_train_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_pre_hook(
                lambda o, args, kwargs: used.append((o.param_groups[0]["lr"], o.param_groups[0]["betas"][0])))

    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=3, z_threshold=None, rel_threshold=5.0,
                               snapshot_every=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[Used(), monitor])
    trainer.fit(CycledMomentum(spike_at), DataLoader(IndexedPairs(), batch_size=4))
    return used, [(e["step"], e["rolled_back_to"]) for e in monitor.events]


def test_a_rollback_keeps_the_momentum_a_one_cycle_schedule_set(tmp_path: Path) -> None:
    """A rollback restores the weights and optimizer moments of an older step, not its schedule: each update uses
    the LR and the beta1 that ``OneCycleLR`` set for its step, as in a run without the spike. The step after the
    rollback took the snapshot's beta1 (0.041 off the schedule's), the LR already the schedule's."""
    straight, events = _hparams_used(tmp_path / "a", None)
    assert events == []
    rolled, events = _hparams_used(tmp_path / "b", 9)
    assert events == [(9, 8)]
    assert [x for pair in rolled for x in pair] == pytest.approx([x for pair in straight for x in pair])


def test_adaptive_grad_clip_beside_gradient_clip_val_says_it_in_the_trainers_words(tmp_path: Path) -> None:
    """A project of one's own with Trainer(gradient_clip_val=1.0) was told 'set trainer.gradient_clip_val=null', a
    train.py override, for a Trainer it builds in Python."""
    with pytest.warns(UserWarning) as caught:
        fit(tmp_path, [AdaptiveGradClip()], max_steps=1, gradient_clip_val=1.0)
    said = [str(w.message) for w in caught if "AdaptiveGradClip" in str(w.message)]
    assert said == ["AdaptiveGradClip runs before Lightning's gradient_clip_val=1.0, which still applies; to clip "
                    "adaptively only, build the Trainer with gradient_clip_val=None (train.py: "
                    "trainer.gradient_clip_val=null)"]
