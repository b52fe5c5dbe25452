"""AdaptiveGradClip and OptimizerDiagnostics with other callbacks (LossSpikeMonitor in either order), several
optimizers under manual optimization, an interrupted step, and the GradScaler with fused or foreach AdamW."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import AdaptiveGradClip, OptimizerDiagnostics
from lit_dtrain.callbacks._spike_stats import RobustStat, zclip_threshold
from tests.faults import RaiseOnceAt
from tests.unit._grad_clip_helpers import grad_norm, run_clip
from tests.unit._loss_spike_helpers import Inject, make_data, make_module, make_trainer, one_thread  # noqa: F401


class AdamWLinear(L.LightningModule):
    """A plain module: ``nn.Linear(4, 1)`` (seeded) regressed to 1.0, with fused or foreach AdamW; its loss is inf at
    ``inf_at_step`` (inf grads, a step the GradScaler skips)."""

    def __init__(self, fused: bool, inf_at_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.fused, self.inf_at_step = torch.nn.Linear(4, 1), fused, inf_at_step

    def training_step(self, batch, batch_idx):
        loss = (self.lin(batch) - 1.0).square().mean()
        return loss * float("inf") if self.global_step == self.inf_at_step else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused, foreach=None if self.fused else True)


def test_grad_rms_is_unscaled_under_16_mixed_with_fused_adamw(tmp_path: Path) -> None:
    """Under ``16-mixed``, Lightning unscales the grads before ``on_before_optimizer_step`` except for optimizers that
    unscale inside ``step`` (fused AdamW): theirs still carry the GradScaler's scale there. AdaptiveGradClip and
    LossSpikeMonitor divide it out; OptimizerDiagnostics did not, so grad_rms read 1024x too high (init_scale 2**10)
    with fused AdamW. The same first step must give the same grad_rms with fused and foreach AdamW."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    grad_rms = {}
    for fused in (False, True):
        diag = OptimizerDiagnostics(every_n_steps=1)
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, plugins=[plugin], callbacks=[diag], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path))
        data = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        trainer.fit(AdamWLinear(fused), train_dataloaders=DataLoader(data, batch_size=8))
        grad_rms[fused] = diag.last["optim/0/grad_rms"]
    assert 0.0 < grad_rms[False] < 10.0
    assert grad_rms[True] == pytest.approx(grad_rms[False], rel=1e-3)


def test_a_reused_grad_clip_starts_fresh_in_a_new_fit(tmp_path: Path) -> None:
    """The same AdaptiveGradClip object in a second ``trainer.fit`` without ``ckpt_path`` starts with fresh grad-norm
    statistics (as a new object would), not with the first fit's (which would skip the warmup and clip by them)."""
    def fit(clip, inject):
        trainer = make_trainer(tmp_path, [Inject(inject), clip], max_steps=6)
        trainer.fit(make_module(), datamodule=make_data(tmp_path))

    reused, fresh = AdaptiveGradClip(warmup_steps=3), AdaptiveGradClip(warmup_steps=3)
    fit(reused, {4: "finite"})
    assert reused.clip_events == 1
    fit(fresh, {})
    fit(reused, {})
    assert reused.clip_events == fresh.clip_events == 0
    assert reused.state_dict() == fresh.state_dict() and reused.stat.count == 6


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_optimizer_diagnostics_agree_in_either_order_with_loss_spike_monitor(
    tmp_path: Path, monkeypatch, action: str
) -> None:
    """A step that LossSpikeMonitor drops is not an update: OptimizerDiagnostics logs nothing for it, whichever of the
    two comes first in the callback list. Listed after the monitor it saw the dropped grads (grad_rms 0.0) and, with
    ``rollback``, measured the restore as the step's update; listed before it, it logged the spike's grad_rms with an
    update of 0. Every other step logs the same values in both orders."""
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.callbacks import optimizer_diagnostics as od

    logged: dict[str, dict[int, dict[str, float]]] = {}
    for order in ("monitor_first", "diag_first"):
        rows = logged[order] = {}
        monkeypatch.setattr(od, "log_step_metrics", lambda tr, pl, metrics, step, rows=rows: rows.__setitem__(
            step, dict(metrics)))
        monitor = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2)
        diag = OptimizerDiagnostics(every_n_steps=1)
        callbacks = [monitor, diag] if order == "monitor_first" else [diag, monitor]
        trainer = make_trainer(tmp_path / order, [Inject({6: "finite"}), *callbacks], max_steps=9)
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        assert [e["step"] for e in monitor.events] == [6]
    for order, rows in logged.items():
        assert sorted(rows) == [0, 1, 2, 3, 4, 5, 7, 8], order  # nothing for the dropped step 6
        for step, metrics in rows.items():
            assert all(math.isfinite(v) for v in metrics.values()), (order, step)
            assert metrics["optim/decay/grad_rms"] > 0 and metrics["optim/decay/update_to_param_rms"] > 0
    first, second = logged["monitor_first"], logged["diag_first"]
    for step in first:
        assert first[step] == pytest.approx(second[step], rel=1e-6), step


class TwoOptimizers(L.LightningModule):
    """A plain LightningModule with manual optimization and two optimizers (a GAN-like layout) whose grad norms differ
    by about 100x."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.b.weight.mul_(100.0)

    def training_step(self, batch, batch_idx):
        for opt, layer in zip(self.optimizers(), (self.a, self.b)):
            opt.zero_grad()
            self.manual_backward(layer(batch).square().mean())
            opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.a.parameters(), 1e-3), torch.optim.AdamW(self.b.parameters(), 1e-3)


def _fit_two(tmp_path: Path, callbacks, max_steps: int = 12) -> L.Trainer:
    from torch.utils.data import DataLoader

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        default_root_dir=str(tmp_path))
    trainer.fit(TwoOptimizers(), DataLoader(torch.randn(64, 4), batch_size=4))
    return trainer


def test_optimizer_diagnostics_cover_every_optimizer_under_manual_optimization(tmp_path: Path, monkeypatch) -> None:
    """Under manual optimization Lightning counts every optimizer.step in global_step (two per batch here), so the
    cadence picked one of the two optimizers only (every_n_steps=2: opt1 at global steps 1, 3, ..., 11, opt0 never).
    The cadence now counts batches, Lightning's own x axis for the module's logs: both optimizers at batches 1, 3, 5."""
    from lit_dtrain.callbacks import optimizer_diagnostics as od

    rows: dict[int, dict[str, float]] = {}
    monkeypatch.setattr(od, "log_step_metrics", lambda tr, pl, metrics, step: rows.__setitem__(step, dict(metrics)))
    _fit_two(tmp_path, [OptimizerDiagnostics(every_n_steps=2)])
    assert sorted(rows) == [1, 3, 5]
    for metrics in rows.values():
        assert {k.split("/")[1] for k in metrics} == {"opt0", "opt1"}
        assert metrics["optim/opt1/0/grad_rms"] > 10 * metrics["optim/opt0/0/grad_rms"] > 0


class SpikeOptimizer(L.Callback):
    """Multiplies the grads of optimizer ``index`` by ``factor`` at batch ``batch`` (listed before the clip), and
    records every optimizer's grad norm as the clip then sees it: ``norms[i]`` per batch."""

    def __init__(self, index: int, batch: int, factor: float) -> None:
        self.index, self.batch, self.factor = index, batch, factor
        self.norms: dict[int, list[float]] = {0: [], 1: []}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        i = [id(o) for o in trainer.optimizers].index(id(optimizer))
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if i == self.index and len(self.norms[i]) == self.batch:
            for p in params:
                p.grad.mul_(self.factor)
        self.norms[i].append(grad_norm(params))


def test_adaptive_grad_clip_keeps_one_statistic_per_optimizer(tmp_path: Path, monkeypatch) -> None:
    """Two optimizers (manual optimization) whose grad norms differ ~100x: one shared statistic would fit neither (it
    used to refuse them). Each optimizer now has its own: its statistic is ZClip's on its own norms only, a spike in one
    optimizer's grads is clipped to that optimizer's threshold, and the rows are written per optimizer at the batch
    (Lightning's logging axis under manual optimization)."""
    from lit_dtrain.callbacks import adaptive_grad_clip as agc

    rows: dict[int, dict[str, float]] = {}
    monkeypatch.setattr(agc, "log_step_metrics", lambda tr, pl, m, step: rows.setdefault(step, {}).update(m))
    spike = SpikeOptimizer(index=1, batch=8, factor=20.0)
    clip = AdaptiveGradClip(warmup_steps=3, log_every_n_steps=4)
    _fit_two(tmp_path, [spike, clip], max_steps=24)  # 12 batches, 2 optimizer steps each
    assert [s.count for s in clip.stats] == [12, 12]
    clips = []
    for i, stat in enumerate(clip.stats):  # ZClip on this optimizer's norms only
        ref = RobustStat("ema", decay=0.97, scale_decay=0.97, warmup=3, clip_z=None, min_rel_scale=0.0)
        for batch, norm in enumerate(spike.norms[i]):
            threshold = zclip_threshold(ref, 2.5)
            if threshold is not None and norm > threshold:
                clips.append((i, batch))
                norm = threshold
            ref.add(norm)
        assert stat.mean == pytest.approx(ref.mean, rel=1e-6) and stat.var == pytest.approx(ref.var, rel=1e-6)
    assert (1, 8) in clips and clip.clip_events == len(clips)
    assert clip.stats[1].mean > 30 * clip.stats[0].mean  # one shared statistic would fit neither
    assert sorted(rows) == sorted({3, 7, 11} | {batch for _, batch in clips})  # every 4th batch, and every clip
    clipped = rows[8]
    assert clipped["grad_clip/opt1/clipped"] == 1.0
    assert clipped["grad_clip/opt1/clip_events"] == sum(c == 1 and b <= 8 for c, b in clips)
    assert clipped["grad_clip/opt1/norm"] == pytest.approx(spike.norms[1][8], rel=1e-5)
    assert clipped["grad_clip/opt1/threshold"] < spike.norms[1][8] / 5
    per_optimizer = [sum(i == j for i, _ in clips) for j in (0, 1)]
    assert [o["clip_events"] for o in clip.state_dict()["optimizers"]] == per_optimizer


def test_adaptive_grad_clip_loads_a_checkpoint_from_before_per_optimizer_statistics() -> None:
    """A checkpoint written when the callback kept one statistic (``{"stat", "clip_events"}``) is its optimizer 0's."""
    clip, _, _ = run_clip([1.0, 1.1, 0.9, 1.0, 5.0], warmup_steps=3)
    old_format = {"stat": clip.stats[0].state_dict(), "clip_events": clip.clip_events}
    other = AdaptiveGradClip(warmup_steps=3)
    other.load_state_dict(old_format)
    assert other.state_dict() == clip.state_dict() and other.threshold() == clip.threshold()
    assert other.clip_events == 1


def test_loss_spike_monitor_names_manual_optimization_as_unsupported(tmp_path: Path) -> None:
    from lit_dtrain.callbacks import LossSpikeMonitor

    with pytest.raises(RuntimeError, match=r"LossSpikeMonitor needs automatic optimization.*TwoOptimizers.*"
                                           r"automatic_optimization = False"):
        _fit_two(tmp_path, [LossSpikeMonitor(actions=["log"])])


def test_loss_spike_rollback_under_fsdp_is_a_one_line_config_error() -> None:
    """'rollback' under a sharded strategy (FSDP, on GPUs) raised NotImplementedError, which train.py printed as a
    traceback (its one-line errors are ConfigErrors: sweeps.user_error gave None); a ConfigError naming the fix now."""
    from types import SimpleNamespace

    from lit_dtrain.callbacks._spike_args import check_fit
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import EvenEpochsFSDPStrategy
    from lit_dtrain.sweeps import user_error

    trainer = SimpleNamespace(strategy=EvenEpochsFSDPStrategy.__new__(EvenEpochsFSDPStrategy))
    with pytest.raises(ConfigError, match=r"'rollback' .* sharded strategies \(EvenEpochsFSDPStrategy\): use 'skip' "
                                          r"\(callbacks.loss_spike.actions=\[log,skip\]\)") as caught:
        check_fit(trainer, SimpleNamespace(automatic_optimization=True), ["log", "rollback"])
    assert user_error(caught.value) is caught.value
    check_fit(trainer, SimpleNamespace(automatic_optimization=True), ["log", "skip"])  # skip works under FSDP


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_adaptive_grad_clip_agrees_in_either_order_with_loss_spike_monitor(
    tmp_path: Path, monkeypatch, action: str
) -> None:
    """A step LossSpikeMonitor drops never updates the weights, so its grad norm must not enter the clipping statistics
    nor count or log as a clip, whichever callback comes first. Listed before the monitor, AdaptiveGradClip absorbed
    the spike's (clipped) norm, counted a clip event and logged it for the dropped step (the docs asked users to list
    the monitor first). Both orders now end with identical statistics and log the same rows."""
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.callbacks import adaptive_grad_clip as agc

    results = {}
    for order in ("monitor_first", "clip_first"):
        rows: dict[int, dict[str, float]] = {}
        monkeypatch.setattr(agc, "log_step_metrics", lambda tr, pl, metrics, step, rows=rows: rows.__setitem__(
            step, dict(metrics)))
        monitor = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2)
        clip = AdaptiveGradClip(warmup_steps=3, log_every_n_steps=1)
        callbacks = [monitor, clip] if order == "monitor_first" else [clip, monitor]
        trainer = make_trainer(tmp_path / order, [Inject({6: "finite"}), *callbacks], max_steps=9)
        trainer.gradient_clip_val = None
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        assert [e["step"] for e in monitor.events] == [6]
        results[order] = (clip.state_dict(), rows, clip.last)
    (state_a, rows_a, last_a), (state_b, rows_b, last_b) = results["monitor_first"], results["clip_first"]
    assert sorted(rows_a) == sorted(rows_b) == [0, 1, 2, 3, 4, 5, 7, 8]  # nothing for the dropped step 6
    (opt_a,), (opt_b,) = state_a["optimizers"], state_b["optimizers"]
    assert opt_a["stat"]["count"] == opt_b["stat"]["count"] == 8
    assert opt_a["clip_events"] == opt_b["clip_events"]
    for key in ("mean", "var"):
        assert opt_a["stat"][key] == pytest.approx(opt_b["stat"][key], rel=1e-6)
    for step in rows_a:
        assert rows_a[step] == pytest.approx(rows_b[step], rel=1e-6), step
    assert last_a == pytest.approx(last_b, rel=1e-6)


def test_grad_clip_counts_steps_of_a_module_that_zeroes_grads_right_after_stepping(tmp_path: Path) -> None:
    """A LightningModule whose optimizer_step override calls zero_grad(set_to_none=True) right after the step (a
    common pattern) has no grads at batch end; AdaptiveGradClip must still count its steps as applied (it tells a
    dropped step by the grads the optimizer saw, inside optimizer.step), and OptimizerDiagnostics still log them."""
    class ZeroAfterStep(TwoOptimizers):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

        def training_step(self, batch, batch_idx):
            return self.a(batch).square().mean() + self.b(batch).square().mean()

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(closure=optimizer_closure)
            optimizer.zero_grad(set_to_none=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), 1e-3)

    from torch.utils.data import DataLoader

    clip, diag = AdaptiveGradClip(warmup_steps=3), OptimizerDiagnostics(every_n_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clip, diag],
                        default_root_dir=str(tmp_path))
    trainer.fit(ZeroAfterStep(), DataLoader(torch.randn(64, 4), batch_size=4))
    assert clip.stat.count == 8 and clip.last and math.isfinite(clip.last["threshold"])
    assert set(diag.last) == {"optim/0/update_to_param_rms", "optim/0/grad_rms", "optim/0/eps_dominated_frac"}


def test_optimizer_diagnostics_grad_rms_does_not_depend_on_the_order_with_adaptive_grad_clip(
    tmp_path: Path, monkeypatch
) -> None:
    """grad_rms is documented as the gradient before clipping. Listed after AdaptiveGradClip it read the clipped grads
    (at the injected spike, step 7: the clipped value instead of the raw one). It is now taken in on_after_backward,
    before any on_before_optimizer_step, so both orders log the same rows."""
    from lit_dtrain.callbacks import optimizer_diagnostics as od

    logged = {}
    for order in ("clip_first", "diag_first"):
        rows = logged[order] = {}
        monkeypatch.setattr(od, "log_step_metrics", lambda tr, pl, metrics, step, rows=rows: rows.__setitem__(
            step, dict(metrics)))
        clip, diag = AdaptiveGradClip(warmup_steps=3), OptimizerDiagnostics(every_n_steps=1)
        callbacks = [clip, diag] if order == "clip_first" else [diag, clip]
        trainer = make_trainer(tmp_path / order, [Inject({7: "finite"}), *callbacks], max_steps=9)
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        assert clip.clip_events >= 1
    first, second = logged["clip_first"], logged["diag_first"]
    assert sorted(first) == sorted(second) == list(range(9))
    for step in first:
        assert first[step] == pytest.approx(second[step], rel=1e-6), step
    assert first[7]["optim/decay/grad_rms"] > 5 * first[6]["optim/decay/grad_rms"]  # the raw spike, not clipped


def test_a_step_interrupted_after_the_clip_is_not_counted_twice(tmp_path: Path) -> None:
    """An exception after AdaptiveGradClip saw a step and before the optimizer took it (here a later callback's
    on_before_optimizer_step at step 5) left that step's norm in the statistics; the same Trainer fitted again redoes
    step 5, so it entered twice (9 norms after 8 steps). The unfinished step is now undone on the exception."""
    clip = AdaptiveGradClip(warmup_steps=3)
    trainer = make_trainer(tmp_path, [clip, RaiseOnceAt("on_before_optimizer_step", 5)], max_steps=8)
    module, dm = make_module(), make_data(tmp_path)
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 5
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 8 and clip.stat.count == 8


def test_a_step_the_grad_scaler_skips_logs_nothing_with_fused_or_foreach_adamw(tmp_path: Path, monkeypatch) -> None:
    """Under ``16-mixed`` the GradScaler skips a step with inf grads. For foreach AdamW it never calls
    ``optimizer.step``, so OptimizerDiagnostics logged nothing; fused AdamW unscales inside ``step`` and is called with
    the scaler's ``found_inf`` (it then leaves the parameters alone), and the diagnostics logged an inf grad_rms with an
    update of 0 for it. Both now log nothing for the skipped step and the same rows for the others."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import optimizer_diagnostics as od

    logged = {}
    for fused in (False, True):
        rows = logged[fused] = {}
        monkeypatch.setattr(od, "log_step_metrics", lambda tr, pl, metrics, step, rows=rows: rows.__setitem__(
            step, dict(metrics)))
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, plugins=[plugin], logger=False,
                            callbacks=[OptimizerDiagnostics(every_n_steps=1)], enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        data = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
        trainer.fit(AdamWLinear(fused, inf_at_step=2), train_dataloaders=DataLoader(data, batch_size=8))
        assert trainer.precision_plugin.scaler.get_scale() == 2.0**9  # the scaler did skip step 2 (and backed off)
    for fused, rows in logged.items():
        assert sorted(rows) == [0, 1, 3, 4], fused
        assert all(math.isfinite(v) for metrics in rows.values() for v in metrics.values()), fused
        assert all(metrics["optim/0/grad_rms"] > 0 and metrics["optim/0/update_to_param_rms"] > 0
                   for metrics in rows.values()), fused
    for step, metrics in logged[False].items():
        assert logged[True][step] == pytest.approx(metrics, rel=1e-3), step
