"""lit_dtrain's callbacks imported into a Lightning project that is not lit_dtrain's: a plain LightningModule whose
``training_step`` returns a bare loss tensor, its own optimizer (and LR scheduler), its own DataLoader of ``(x, y)``
tuples, no Hydra. What must work, what must be refused at fit start (naming what is missing and how to provide it),
and that a ``trainer.fit(ckpt_path=...)`` resume of such a module continues each callback exactly."""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks import (
    AdaptiveGradClip,
    FourierSamplerCallback,
    LossSpikeMonitor,
    OptimizerDiagnostics,
    SelectiveCheckpointing,
    WSDScheduler,
)


def regression_data(n: int = 64, batch_size: int = 8) -> DataLoader:
    """The user's own DataLoader: ``(x, y)`` tuples, no ``index``, no dict; some samples 8x larger (grad spikes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    x[5::11] *= 8.0
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


class UserModule(L.LightningModule):
    """``nn.Sequential`` MLP; ``training_step`` returns the bare loss. ``groups``: two param groups with LRs 1e-2 and
    1e-3; ``scheduler``: a ``StepLR`` of its own; ``manual``: manual optimization (every optimizer steps each batch);
    ``two``: two optimizers (AdamW for the first layer, SGD for the last); ``step_every``: under manual optimization,
    accumulate the grads of that many batches per update."""

    def __init__(
        self,
        groups: bool = False,
        scheduler: bool = False,
        manual: bool = False,
        two: bool = False,
        step_every: int = 1,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.groups, self.scheduler, self.two, self.step_every = groups, scheduler, two, step_every
        self.automatic_optimization = not manual
        self.example_input_array = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        self.steps_run = 0  # training_step calls

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.manual_backward(loss / self.step_every)
        if (batch_idx + 1) % self.step_every == 0:
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        return None

    def configure_optimizers(self):
        if self.two:
            return torch.optim.AdamW(self.net[0].parameters(), 1e-2), torch.optim.SGD(self.net[2].parameters(), 1e-2)
        if self.groups:
            opt = torch.optim.AdamW(
                [{"params": self.net[0].parameters(), "lr": 1e-2}, {"params": self.net[2].parameters(), "lr": 1e-3}]
            )
        else:
            opt = torch.optim.AdamW(self.parameters(), 1e-2)
        if self.scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)}
        return opt


def fit(
    tmp_path: Path,
    callbacks,
    module: L.LightningModule | None = None,
    max_steps: int = 8,
    ckpt_path=None,
    save_every: int | None = None,
    datamodule: L.LightningDataModule | None = None,
    **trainer_kwargs,
) -> L.Trainer:
    if save_every:
        callbacks = [
            *callbacks,
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=save_every
            ),
        ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=bool(save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(tmp_path),
        **trainer_kwargs,
    )
    module = module if module is not None else UserModule()
    if datamodule is not None:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    else:
        trainer.fit(module, regression_data(), ckpt_path=ckpt_path)
    return trainer


def _equal(a, b) -> bool:
    """Exact equality of nested states holding tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


RESUMABLE = {
    "wsd": (lambda tmp: WSDScheduler(total_steps=16, warmup_steps=4, decay_steps=6), {"groups": True}),
    "wsd_two_optimizers": (
        lambda tmp: WSDScheduler(total_steps=16, warmup_steps=4, decay_steps=6),
        {"manual": True, "two": True},
    ),
    "loss_spike": (
        lambda tmp: LossSpikeMonitor(
            actions=["log", "lr_cooldown"],
            warmup_steps=3,
            z_threshold=1.0,
            rel_threshold=None,
            grad_z_threshold=1.0,
            cooldown_steps=2,
            cooldown_ramp_steps=2,
            path=str(tmp / "spikes.jsonl"),
        ),
        {},
    ),
    "adaptive_grad_clip": (lambda tmp: AdaptiveGradClip(warmup_steps=3, z_threshold=1.0), {}),
    "adaptive_grad_clip_two_optimizers": (
        lambda tmp: AdaptiveGradClip(warmup_steps=3, z_threshold=1.0),
        {"manual": True, "two": True},
    ),
    "optimizer_diagnostics": (lambda tmp: OptimizerDiagnostics(every_n_steps=3), {"groups": True}),
    "selective_checkpointing": (lambda tmp: SelectiveCheckpointing(policy="budget", module_pattern="net.*"), {}),
}


MIXED = {"precision": "bf16-mixed", "accumulate_grad_batches": 2}


@pytest.mark.parametrize(
    ("name", "trainer_kwargs"),
    [(name, {}) for name in sorted(RESUMABLE)]
    + [(name, MIXED) for name in sorted(RESUMABLE) if not RESUMABLE[name][1].get("manual")],
    ids=lambda v: "bf16_accumulate2" if v == MIXED else (v or "fp32"),
)
def test_a_resume_of_the_users_module_continues_each_callback_exactly(tmp_path: Path, name: str, trainer_kwargs):
    """16 steps straight (checkpoint after step 8, an epoch boundary of the user's DataLoader) against 8 steps, then
    ``trainer.fit(ckpt_path=<step 8>)`` with a new callback object: the callback's state and the weights are equal.
    Also under ``bf16-mixed`` with ``accumulate_grad_batches=2`` (manual optimization has no Lightning accumulation)."""
    make, module_kwargs = RESUMABLE[name]
    half = 8 * (2 if module_kwargs.get("two") else 1)  # global_step counts both optimizers' steps: 2 a batch
    straight_cb = make(tmp_path / "a")
    straight = UserModule(**module_kwargs)
    fit(tmp_path / "a", [straight_cb], straight, max_steps=2 * half, save_every=half, **trainer_kwargs)
    (ckpt,) = (tmp_path / "a" / "ckpt").glob(f"*step={half}.ckpt")
    saved = torch.load(ckpt, weights_only=True)["callbacks"].get(straight_cb.state_key)
    if name not in ("optimizer_diagnostics", "selective_checkpointing"):  # (their state does not change in a fit)
        assert saved is not None and not _equal(saved, straight_cb.state_dict()), name  # the resume had work to do
    resumed_cb = make(tmp_path / "b")
    resumed = UserModule(**module_kwargs)
    fit(tmp_path / "b", [resumed_cb], resumed, max_steps=2 * half, ckpt_path=str(ckpt), **trainer_kwargs)
    assert _equal(resumed_cb.state_dict(), straight_cb.state_dict()), name
    for (key, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), (name, key)


def _no_probe_input() -> UserModule:
    module = UserModule()
    module.example_input_array = None
    return module


REFUSED = {
    "selective_checkpointing_without_blocks": (
        lambda tmp: SelectiveCheckpointing(policy="full"),
        UserModule,
        ValueError,
        r"exactly one nn.ModuleList named 'blocks' in UserModule \(found: none\); pass module_pattern .*"
        r"Modules seen: net, net.0, net.1, net.2",
    ),
    "selective_checkpointing_budget_without_probe_input": (
        lambda tmp: SelectiveCheckpointing(policy="budget", module_pattern="net.*"),
        _no_probe_input,
        ValueError,
        r"policy='budget'\) needs a probe input: set UserModule.example_input_array",
    ),
    "loss_spike_skip_without_index": (
        lambda tmp: LossSpikeMonitor(actions=["log", "skip"], path=str(tmp / "s.jsonl")),
        UserModule,
        KeyError,
        r"needs the batch key 'index' .*got list.*actions=\['log', 'lr_cooldown'\]",
    ),
    "loss_spike_manual_optimization": (
        lambda tmp: LossSpikeMonitor(actions=["log"], path=str(tmp / "s.jsonl")),
        lambda: UserModule(manual=True),
        RuntimeError,
        r"LossSpikeMonitor needs automatic optimization, but UserModule sets automatic_optimization = False",
    ),
    "wsd_with_the_modules_own_scheduler": (
        lambda tmp: WSDScheduler(total_steps=8, decay_steps=2),
        lambda: UserModule(scheduler=True),
        RuntimeError,
        r"WSDScheduler sets the LR itself, but the LightningModule also configures LR scheduler\(s\) \['StepLR'\]",
    ),
    "fourier_sampler_without_its_datamodule": (
        lambda tmp: FourierSamplerCallback(),
        UserModule,
        RuntimeError,
        r"FourierSamplerCallback needs trainer.datamodule \(an LMDataModule with a FourierSampler\)",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_a_users_module_does_not_provide_is_refused_before_it_trains(tmp_path: Path, name: str) -> None:
    """A callback that needs something the module or its data do not give fails before the first training step, with
    an error that names what is missing and how to provide it (none of these needed a fix)."""
    make, module_factory, error, match = REFUSED[name]
    module = module_factory()
    with pytest.raises(error, match=match):
        fit(tmp_path, [make(tmp_path)], module, max_steps=4)
    assert module.steps_run == 0, name


class UserLM(L.LightningModule):
    """A user's own byte-level LM on lit_dtrain's ``LMDataModule`` batches (``input_ids``, ``labels``, ``index``);
    ``training_step`` returns the bare loss unless ``per_token``, which returns the keys the FourierSampler reads."""

    def __init__(self, per_token: bool = False, declare: tuple[str, ...] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)
        self.per_token = per_token
        if declare is not None:
            self.step_output_keys = declare
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        logits = self.head(self.embed(batch["input_ids"]))  # (B, T, V)
        token_loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        token_loss = token_loss.view_as(batch["labels"])  # (B, T)
        if not self.per_token:
            return token_loss.mean()
        return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2)


def lm_data(tmp_path: Path):
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.datamodule import LMDataModule
    from lit_dtrain.data.samplers.fourier import FourierSampler

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    source = CorpusSource(name="text", kind="files", paths=[str(corpus)])
    return LMDataModule(
        sources=[source],
        block_size=16,
        batch_size=4,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        sampler=FourierSampler(step_unit=1),
    )


def test_fourier_sampler_with_a_users_lm_learns_from_its_token_losses(tmp_path: Path) -> None:
    data, module = lm_data(tmp_path), UserLM(per_token=True)
    fit(tmp_path, [FourierSamplerCallback()], module, max_steps=4, datamodule=data, limit_val_batches=0)
    assert data.sampler.state_dict()["updates"] == 4


@pytest.mark.parametrize("declare", [("loss",), None])
def test_fourier_sampler_callback_names_the_keys_a_users_module_does_not_return(tmp_path: Path, declare) -> None:
    """A module that returns a bare loss: a module that declares ``step_output_keys`` is refused at setup, before any
    training step; one that does not is refused at the end of its first step (the outputs are not known before).
    Either way the message names the missing keys and what they are."""
    from lit_dtrain.callbacks._contract import StepOutputError

    module = UserLM(declare=declare)
    match = (
        r"FourierSamplerCallback needs training_step to return \['token_loss', 'index'\].*"
        r"'token_loss': the per-token loss \[B, T\], detached.*'index': the batch's sample indices"
    )
    with pytest.raises(StepOutputError, match=match):
        fit(
            tmp_path, [FourierSamplerCallback()], module, max_steps=4, datamodule=lm_data(tmp_path), limit_val_batches=0
        )
    assert module.steps_run == (0 if declare else 1)


class UpdateLRs(L.Callback):
    """Records the LR of param group ``group`` at every update of every optimizer (step pre-hooks, so the LR the update
    used)."""

    def __init__(self, group: int = 0) -> None:
        self.group = group

    def on_train_start(self, trainer, pl_module) -> None:
        self.used = {i: [] for i in range(len(trainer.optimizers))}
        for i, opt in enumerate(trainer.optimizers):
            opt.register_step_pre_hook(lambda o, a, kw, i=i: self.used[i].append(o.param_groups[self.group]["lr"]))


@pytest.mark.parametrize(("two", "step_every"), [(True, 1), (False, 2), (False, 1)])
def test_wsd_under_manual_optimization_follows_each_optimizers_updates(tmp_path: Path, two: bool, step_every: int):
    """Under manual optimization Lightning's global_step counts every optimizer.step: with two optimizers stepping each
    batch it advances by 2 a batch, and the schedule, which followed it, gave each optimizer every other LR of the
    schedule (0.5, 1.0, 0.0, 0.0 for 4 updates of a 4-step schedule; its warmup and stable phase in half the updates).
    The k-th update of each optimizer now uses the schedule's LR for step k; one that accumulates by hand (an update
    every 2 batches) keeps following its updates, and so does a plain manual loop."""
    wsd, record = WSDScheduler(total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear"), UpdateLRs()
    optimizers = 2 if two else 1
    fit(tmp_path, [wsd, record], UserModule(manual=True, two=two, step_every=step_every), max_steps=4 * optimizers)
    expected = [1e-2 * wsd.lr_factor(k) for k in range(4)]
    assert [0.5, 1.0, 0.5, 0.0] == [wsd.lr_factor(k) for k in range(4)]
    for i in range(optimizers):
        assert record.used[i] == expected, i


class HalveLRInsideStep(L.Callback):
    """Scales the LR of every update by 0.5 the way ``FourierSamplerCallback``'s stage multiplier does (a step pre-hook
    through ``_lr_scaling``, undone right after the update)."""

    def on_train_start(self, trainer, pl_module) -> None:
        from lit_dtrain.callbacks._lr_scaling import scale_lrs_for_step

        for opt in trainer.optimizers:
            opt.register_step_pre_hook(lambda o, args, kwargs: scale_lrs_for_step(o, 0.5))


def test_wsd_under_manual_optimization_composes_with_a_per_step_lr_scaling(tmp_path: Path) -> None:
    """The schedule sets the next update's LR inside optimizer.step (a post-hook); the scaling's own restore, a later
    post-hook, would put back the LR from before the update over it unless it is taken back first."""
    wsd, record = WSDScheduler(total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, HalveLRInsideStep(), record], UserModule(manual=True), max_steps=4)
    assert record.used[0] == [0.5 * 1e-2 * wsd.lr_factor(k) for k in range(4)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-2 * wsd.lr_factor(4)  # the schedule's, unscaled


@pytest.mark.parametrize("trainer_kwargs", [{}, MIXED], ids=["fp32", "bf16_accumulate2"])
def test_wsd_sets_each_param_groups_lr_of_a_users_optimizer_exactly(tmp_path: Path, trainer_kwargs) -> None:
    """Two param groups with peaks 1e-2 and 1e-3: every update uses each group's peak times the schedule's factor for
    its step, float for float; under accumulation once per optimizer step."""
    wsd = WSDScheduler(total_steps=6, warmup_steps=2, decay_steps=3, decay_type="linear")
    first, second = UpdateLRs(group=0), UpdateLRs(group=1)
    trainer = fit(tmp_path, [wsd, first, second], UserModule(groups=True), max_steps=6, **trainer_kwargs)
    assert trainer.global_step == 6
    assert first.used[0] == [1e-2 * wsd.lr_factor(k) for k in range(6)]
    assert second.used[0] == [1e-3 * wsd.lr_factor(k) for k in range(6)]
    assert len(set(first.used[0])) == 5  # warmup, peak, three decay steps (the last at 0): the schedule moved


class OverflowAtBatch(UserModule):
    """``UserModule`` under manual optimization whose loss is inf at batch ``bad`` (an fp16 overflow the GradScaler
    skips under ``16-mixed``); ``fused``: a fused AdamW, which unscales inside ``step`` (its hooks still run)."""

    def __init__(self, bad: int, fused: bool) -> None:
        super().__init__(manual=True)
        self.bad, self.fused = bad, fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y) * (math.inf if batch_idx == self.bad else 1.0)
        opt = self.optimizers()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2, fused=self.fused)


class LRAtEachStepCall(L.Callback):
    """The LR of param group 0 at every ``optimizer.step`` call, taken or skipped by the GradScaler, and the scale."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.lrs, self.scales = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_wsd_under_manual_optimization_counts_a_step_the_gradscaler_skipped(tmp_path: Path, fused: bool) -> None:
    """Under ``16-mixed`` the GradScaler skips an update whose grads overflowed: a foreach optimizer's ``step`` (and its
    post-hook) is then never called, a fused one's is (it skips inside). Both count it as one of the schedule's steps,
    as automatic optimization does (``global_step``, and so the schedule, advance on a skipped step): else the
    schedule fell one step behind per skip and never reached its end by ``max_steps``, and only for foreach."""
    wsd, record = WSDScheduler(total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear"), LRAtEachStepCall()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = fit(tmp_path, [wsd, record], OverflowAtBatch(bad=1, fused=fused), max_steps=4, plugins=[plugin])
    assert record.scales[2] == record.scales[1] / 2  # the overflowed step was skipped
    assert record.lrs == [1e-2 * wsd.lr_factor(k) for k in range(4)]
    assert wsd.updates == [4]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-2 * wsd.lr_factor(4)


@pytest.mark.parametrize(
    ("total_steps", "trainer_kwargs", "warned"),
    [
        (8, {"max_steps": -1, "max_epochs": 2}, True),  # 2 epochs of 8 batches: 16 steps, the last 8 at LR 0
        (16, {"max_steps": -1, "max_epochs": 2}, False),
        (8, {"max_steps": -1, "max_epochs": 2, "accumulate_grad_batches": 2}, False),  # 2 x 4 steps
        (8, {"max_steps": 12}, True),
        (11, {"max_steps": 12}, True),  # "the last 1 steps run at" before
        (12, {"max_steps": 12}, False),
    ],
    ids=["epochs_past", "epochs_match", "epochs_accumulate_match", "steps_past", "one_step_past", "steps_match"],
)
def test_wsd_warns_when_the_trainer_runs_past_its_total_steps(tmp_path: Path, total_steps, trainer_kwargs, warned):
    """A user's ``Trainer(max_epochs=...)`` (or a ``max_steps`` beyond the horizon) whose steps outnumber
    ``total_steps``: every step after the decay runs at ``min_lr_factor`` (LR 0), which was silent. Now a warning at
    train start names both counts; a matching horizon says nothing."""
    wsd = WSDScheduler(total_steps=total_steps, warmup_steps=2, decay_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, [wsd], **trainer_kwargs)
    horizon = [str(w.message) for w in caught if "WSDScheduler: the trainer will take" in str(w.message)]
    if warned:
        steps = trainer.global_step
        assert steps > total_steps and trainer.optimizers[0].param_groups[0]["lr"] == 0.0  # what it warned about
        assert horizon == [
            f"WSDScheduler: the trainer will take {steps} optimizer steps (trainer.estimated_stepping_batches, from "
            f"max_steps/max_epochs), but total_steps={total_steps}: the decay ends at step {total_steps - 1} and the "
            f"last {'1 step runs' if steps == total_steps + 1 else f'{steps - total_steps} steps run'} at "
            f"min_lr_factor=0.0 of the peak LR. Set total_steps={steps} (or "
            f"stop the trainer at max_steps={total_steps})"
        ]
    else:
        assert trainer.global_step == total_steps and horizon == []


class IdDataset(torch.utils.data.Dataset):
    """Dict samples ``{"x", "y", "index"}`` whose ``index`` is the user's own id: a string, or a float."""

    def __init__(self, kind: str) -> None:
        self.data, self.kind = regression_data().dataset, kind

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x, y = self.data[i]
        return {"x": x, "y": y, "index": f"sample-{i}" if self.kind == "str" else float(i)}


class DictBatchModule(UserModule):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch["x"], batch["y"]), batch_idx)


@pytest.mark.parametrize("kind", ["str", "float"])
def test_loss_spike_monitor_names_an_index_that_holds_no_integer_sample_indices(tmp_path: Path, kind: str) -> None:
    """A user's batch whose ``index`` holds string ids failed in ``torch.as_tensor`` ("too many dimensions 'str'"),
    with ``log`` alone too, and float values were truncated into exclusions. ``skip`` now says what ``index`` must
    hold before the first step trains; ``log`` ignores such an index and still records the spikes."""
    data = DataLoader(IdDataset(kind), batch_size=8)
    module = DictBatchModule()
    skip = LossSpikeMonitor(actions=["log", "skip"], path=str(tmp_path / "skip.jsonl"))
    got = "list of str" if kind == "str" else "torch.float64 values"
    with pytest.raises(TypeError, match=rf"needs the batch key 'index' to hold integer sample indices.*got {got}\."):
        L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[skip]).fit(module, data)
    assert module.steps_run == 0
    log = LossSpikeMonitor(actions=["log"], warmup_steps=3, z_threshold=1.0, rel_threshold=None,
                           path=str(tmp_path / "log.jsonl"))
    L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[log]).fit(DictBatchModule(), data)
    assert log.num_spikes > 0 and [e["index"] for e in log.events if "index" in e] == [[]] * log.num_spikes


@pytest.mark.parametrize(
    ("scheduler", "accumulate"),
    [(False, 1), (False, 2), (True, 1)],
    ids=["no_scheduler", "accumulate2", "epoch_steplr"],
)
def test_once_per_step_lr_monitor_writes_one_row_per_step_in_an_epoch_based_run(tmp_path: Path, scheduler, accumulate):
    """With Lightning's default ``logging_interval=None``, an optimizer without an LR scheduler (the one a
    ``WSDScheduler`` drives) was logged at every epoch start and again by the epoch's first batch: two rows at the first
    step of each epoch of a ``max_epochs`` run. Now one row per step; an epoch-interval scheduler (``StepLR``) still
    gets its row at each epoch start."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_dtrain.callbacks import OncePerStepLRMonitor

    trainer = L.Trainer(
        accelerator="cpu", max_epochs=3, limit_train_batches=4, accumulate_grad_batches=accumulate, log_every_n_steps=1,
        logger=CSVLogger(str(tmp_path), name="csv", version=0), callbacks=[OncePerStepLRMonitor()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(UserModule(scheduler=scheduler), regression_data())
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["lr-AdamW"])) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    if scheduler:  # StepLR(step_size=3, gamma=0.5) stepped per epoch: one row at each epoch's first step
        assert rows == [(0, 1e-2), (4, 1e-2), (8, 1e-2)]
    else:
        assert rows == [(step, 1e-2) for step in range(trainer.global_step)] and trainer.global_step == 12 // accumulate


class IndexedDataset(torch.utils.data.Dataset):
    """The user's ``(x, y)`` samples as dicts with their position under ``index``."""

    def __init__(self) -> None:
        self.data = regression_data().dataset

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        x, y = self.data[i]
        return {"x": x, "y": y, "index": i}


class SpikeAtStep(DictBatchModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (100.0 if self.global_step == 6 else 1.0)


def test_loss_spike_skip_with_a_plain_dataloader_refuses_to_exclude_every_sample(tmp_path: Path) -> None:
    """Without a sampler, a later step whose batch holds an excluded index is skipped. A spike in a full-batch
    DataLoader excluded every sample, and every later step was skipped: the run trained nothing more and ended as if
    it had trained. Now the exclusion raises, naming it (as a sampler with exclude() does), after the spike is
    recorded."""
    data = DataLoader(IndexedDataset(), batch_size=64, shuffle=True)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    module = SpikeAtStep()
    trainer = L.Trainer(accelerator="cpu", max_steps=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    with pytest.raises(RuntimeError, match=r"spike at step 6 failed .*every sample of the train DataLoader's dataset "
                                           r"that its epochs draw \(64, indices 0..63\) has been excluded"):
        trainer.fit(module, data)
    assert [e["step"] for e in monitor.events] == [6] and sorted(monitor.events[0]["index"]) == list(range(64))
