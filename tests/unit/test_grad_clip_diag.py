"""AdaptiveGradClip (ZClip) and OptimizerDiagnostics: exact clipping, loss scale, mixed precision, logged values.
(With other callbacks, several optimizers and the GradScaler: test_grad_clip_diag_combinations.py.)"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import AdaptiveGradClip, OptimizerDiagnostics
from lit_dtrain.callbacks._spike_stats import RobustStat, zclip_threshold
from lit_dtrain.callbacks.optimizer_diagnostics import eps_dominated_fraction
from tests.unit._grad_clip_helpers import Logs, fake_trainer, grad_norm, run_clip
from tests.unit._loss_spike_helpers import Inject, make_data, make_module, make_trainer, one_thread  # noqa: F401


def test_zclip_clips_exactly_to_mean_plus_z_std_and_keeps_direction() -> None:
    norms = [1.0 + 0.05 * math.sin(i) for i in range(30)] + [10.0, 1.0]
    clip, logs, seen = run_clip(norms, z_threshold=2.5, warmup_steps=25)
    threshold, after, grads, original = seen[30]
    assert threshold is not None and 1.0 < threshold < 1.3
    assert after == pytest.approx(threshold, rel=1e-5)  # clipped exactly to mean + z * std
    cos = sum(float((a * b).sum()) for a, b in zip(grads, original)) / (after * math.sqrt(
        sum(float(b.square().sum()) for b in original)))
    assert cos == pytest.approx(1.0, abs=1e-6)  # direction preserved
    assert seen[31][1] == pytest.approx(1.0, rel=1e-6)  # ordinary norms pass untouched
    assert all(s[1] == pytest.approx(n, rel=1e-6) for s, n in zip(seen[:30], norms))  # nothing clipped before
    assert clip.clip_events == 1
    assert logs.values["grad_clip/clipped"][30] == 1.0 and logs.values["grad_clip/clip_events"][-1] == 1.0
    assert logs.values["grad_clip/norm"][30] == pytest.approx(10.0, rel=1e-5)
    # the statistics absorbed the clipped norm, not the raw one (ZClip)
    ref = RobustStat("ema", decay=0.97, scale_decay=0.97, warmup=25, clip_z=None, min_rel_scale=0.0)
    for n in logs.values["grad_clip/norm"][:30]:  # the fp32 norms the callback measured
        ref.add(n)
    assert zclip_threshold(ref, 2.5) == pytest.approx(threshold, rel=1e-9)
    ref.add(threshold)
    ref.add(logs.values["grad_clip/norm"][31])
    assert clip.stat.state_dict() == ref.state_dict()


def test_loss_scaled_grads_give_the_same_decisions() -> None:
    norms = [1.0 + 0.05 * math.sin(i) for i in range(30)] + [10.0]
    _, _, plain = run_clip(norms, warmup_steps=25)
    _, _, scaled = run_clip(norms, scale=1024.0, warmup_steps=25)
    for (t0, n0, g0, _), (t1, n1, g1, _) in zip(plain, scaled):
        assert (t0 is None and t1 is None) or t0 == pytest.approx(t1, rel=1e-6)
        assert n0 == pytest.approx(n1, rel=1e-5)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b / 1024.0, a, rtol=1e-5, atol=0)


def test_reciprocal_mode_clips_harder_and_max_norm_caps() -> None:
    norms = [1.0 + 0.05 * math.sin(i) for i in range(30)] + [10.0]
    _, _, z = run_clip(norms, warmup_steps=25, z_threshold=2.5)
    _, logs, rec = run_clip(norms, warmup_steps=25, mode="reciprocal", z_threshold=2.5)
    assert rec[30][1] < z[30][1]
    # exactly mean + z_threshold**2 / z * std, z the outlier's z-score under the statistics before it
    ref = RobustStat("ema", decay=0.97, scale_decay=0.97, warmup=25, clip_z=None, min_rel_scale=0.0)
    for n in logs.values["grad_clip/norm"][:30]:
        ref.add(n)
    mean, std = ref.location(), ref.scale()
    assert rec[30][1] == pytest.approx(mean + 2.5**2 / ((10.0 - mean) / std) * std, rel=1e-5)
    _, _, capped = run_clip([5.0, 5.0, 5.0], warmup_steps=25, max_norm=2.0)
    assert [round(s[1], 5) for s in capped] == [2.0, 2.0, 2.0]  # the ceiling acts during warmup


def test_nonfinite_and_missing_grads_are_left_alone() -> None:
    clip = AdaptiveGradClip(warmup_steps=2)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    clip.on_before_optimizer_step(fake_trainer(0), Logs(), opt)  # no grad at all
    p.grad = torch.tensor([1.0, math.inf, 0.0])
    clip.on_before_optimizer_step(fake_trainer(1), Logs(), opt)
    assert clip.stat.count == 0 and clip.clip_events == 0 and math.isinf(float(p.grad[1]))


def test_clip_state_roundtrip() -> None:
    clip, _, _ = run_clip([1.0, 1.1, 0.9, 1.0, 5.0], warmup_steps=3)
    other = AdaptiveGradClip(warmup_steps=3)
    other.load_state_dict(clip.state_dict())
    assert other.threshold() == clip.threshold() and other.clip_events == clip.clip_events == 1


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_clip_in_a_real_run_acts_on_the_spike(tmp_path: Path, precision: str) -> None:
    class NormProbe(L.Callback):  # runs after AdaptiveGradClip in the same hook
        def __init__(self):
            self.norms = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.norms[trainer.global_step] = grad_norm(params)

    thresholds = {}

    class ThresholdProbe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            thresholds[trainer.global_step] = clip.last.get("threshold")

    clip, probe = AdaptiveGradClip(warmup_steps=4), NormProbe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, precision=precision, logger=False,
                        callbacks=[Inject({8: "finite"}), clip, probe, ThresholdProbe()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert clip.last and clip.clip_events >= 1
    assert probe.norms[8] == pytest.approx(thresholds[8], rel=1e-4)  # the spike's grads clipped to the threshold
    assert "grad_clip/threshold" in trainer.callback_metrics


def test_eps_dominated_fraction_matches_definition() -> None:
    v = torch.tensor([0.0, 1e-20, 9e-18, 1e-17, 1e-10])
    # bias_correction2 = 1 - 0.95**2 = 0.0975; sqrt(v / 0.0975) < 1e-8  <=>  v < 9.75e-18
    assert eps_dominated_fraction(v, step=2, beta2=0.95, eps=1e-8) == (3, 5)


def test_optimizer_diagnostics_values(tmp_path: Path) -> None:
    class Before(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3:  # the last diagnostic step: (3 + 1) % 2 == 0
                self.params = [[p.detach().clone() for p in g["params"]] for g in trainer.optimizers[0].param_groups]

    diag, before = OptimizerDiagnostics(every_n_steps=2), Before()
    trainer = make_trainer(tmp_path, [before, diag], max_steps=4)
    lit = make_module()
    lit.optimizer_factory = partial(torch.optim.AdamW, lr=1e-3, eps=1e-4)  # a large eps: many elements dominated
    trainer.fit(lit, datamodule=make_data(tmp_path))
    opt = trainer.optimizers[0]
    assert set(diag.last) == {f"optim/{name}/{m}" for name in ("decay", "no_decay")
                              for m in ("update_to_param_rms", "grad_rms", "eps_dominated_frac")}
    for group, old in zip(opt.param_groups, before.params):
        name = group["name"]
        new = torch.cat([p.detach().flatten() for p in group["params"]])
        old = torch.cat([p.flatten() for p in old])
        ratio = float((new - old).square().mean().sqrt() / old.square().mean().sqrt())
        assert diag.last[f"optim/{name}/update_to_param_rms"] == pytest.approx(ratio, rel=1e-4)
        v = torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in group["params"]])
        frac = float(((v / (1 - 0.999**4)).sqrt() < 1e-4).float().mean())
        assert diag.last[f"optim/{name}/eps_dominated_frac"] == pytest.approx(frac, abs=1e-6)
        assert 0.0 < diag.last[f"optim/{name}/grad_rms"] < 1.0
    assert "optim/decay/eps_dominated_frac" in trainer.callback_metrics


def test_optimizer_diagnostics_without_adam_state_warns(tmp_path: Path) -> None:
    diag = OptimizerDiagnostics(every_n_steps=1)
    trainer = make_trainer(tmp_path, [diag], max_steps=2)
    lit = make_module()
    lit.optimizer_factory = partial(torch.optim.SGD, lr=1e-2)
    with pytest.warns(UserWarning, match="eps_dominated_frac is not logged"):
        trainer.fit(lit, datamodule=make_data(tmp_path))
    assert set(diag.last) == {f"optim/{n}/{m}" for n in ("decay", "no_decay") for m in ("update_to_param_rms",
                                                                                          "grad_rms")}
    with pytest.raises(ValueError, match="every_n_steps"):
        OptimizerDiagnostics(every_n_steps=0)
    with pytest.raises(ValueError, match=r"AdaptiveGradClip: warmup_steps must be an integer >= 2, got 1"):
        AdaptiveGradClip(warmup_steps=1)


def test_scalars_are_written_at_the_step_they_describe(tmp_path: Path) -> None:
    """self.log in a callback is written only after a step k with (k + 1) % log_every_n_steps == 0, under that k,
    with the last value logged: grad_clip/* logged at steps 0, 3, 6, 9 (and on a clip) and optim/* at 0, 4, 8 were
    written at 4, 9 under those numbers with older steps' values. Now each value is written at its own step, on
    Lightning's cadence (steps k with (k + 1) % n == 0, where train/loss is written): grad_clip/* had been written at
    steps 0, 5, 10 while train/loss and spike/* were at 4, 9, 14, and grad_clip/threshold was NaN in the warmup."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_dtrain.callbacks import LossSpikeMonitor

    class Record(L.Callback):
        def __init__(self):
            self.norm, self.clipped, self.diag = {}, {}, {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - 1
            self.norm[step], self.clipped[step] = clip.last["norm"], clip.last["clipped"]
            if (step + 1) % 5 == 0:
                self.diag[step] = diag.last["optim/decay/grad_rms"]

    clip = AdaptiveGradClip(warmup_steps=3)
    diag, record = OptimizerDiagnostics(every_n_steps=5), Record()
    monitor = LossSpikeMonitor(actions=["log"], warmup_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=15,
                        callbacks=[Inject({7: "finite"}), clip, diag, monitor, record],
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0), log_every_n_steps=5,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), limit_val_batches=0)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()

    def steps(tag):
        return {e.step: e.value for e in acc.Scalars(tag)}

    assert set(steps("train/loss")) == {4, 9, 14}
    norm = steps("grad_clip/norm")
    clip_steps = {s for s, c in record.clipped.items() if c}
    assert 7 in clip_steps  # the injected spike was clipped
    assert set(norm) == {4, 9, 14} | clip_steps
    assert norm == pytest.approx({s: record.norm[s] for s in norm}, rel=1e-6)
    threshold = steps("grad_clip/threshold")
    assert set(threshold) == set(norm) and all(math.isfinite(v) for v in threshold.values())
    assert set(steps("spike/count")) == {4, 9, 14} | {7}  # (every spike event is written too)
    diag_tb = steps("optim/decay/grad_rms")
    assert diag_tb == pytest.approx(record.diag, rel=1e-6) and set(diag_tb) == {4, 9, 14}
    assert "grad_clip/norm" in trainer.callback_metrics and "optim/decay/grad_rms" in trainer.callback_metrics


def test_grad_clip_threshold_is_not_logged_during_the_warmup(tmp_path: Path) -> None:
    """Before its statistics are ready (and without max_norm) there is no threshold: nothing is logged for it (it was
    NaN), while the norm is; with max_norm the warmup threshold is max_norm."""
    from lightning.pytorch.loggers import CSVLogger

    for max_norm in (None, 100.0):
        clip = AdaptiveGradClip(warmup_steps=4, max_norm=max_norm)
        logger = CSVLogger(str(tmp_path), name=f"csv{max_norm}", version=0)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[clip], logger=logger,
                            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=0)
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        import csv

        rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
        logged = {int(r["step"]): r["grad_clip/threshold"] for r in rows if r.get("grad_clip/norm")}
        assert sorted(logged) == list(range(6))
        if max_norm is None:
            assert [s for s, v in logged.items() if v] == [4, 5]  # warmup steps 0-3: no threshold, not NaN
            assert all(math.isfinite(float(v)) for v in logged.values() if v)
        else:
            assert [float(logged[s]) for s in range(4)] == [100.0] * 4


def test_eps_dominated_frac_uses_the_amsgrad_denominator(tmp_path: Path) -> None:
    """With ``amsgrad=True`` torch's Adam/AdamW divide by ``sqrt(max_exp_avg_sq / bias_correction2) + eps``, not by
    ``exp_avg_sq``. A LightningModule of one's own whose gradient is large at step 0 and zero afterwards: ``exp_avg_sq``
    decays (beta2=0.1) far below eps**2 while ``max_exp_avg_sq`` keeps step 0's value, so no element is eps-dominated.
    The diagnostic read ``exp_avg_sq`` and reported every element as dominated."""
    from torch.utils.data import DataLoader

    class Vanishing(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))

        def training_step(self, batch, batch_idx):
            scale = 1.0 if self.trainer.global_step == 0 else 0.0
            return (self.w * batch).sum() * scale

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.1), eps=1e-8, amsgrad=True)

    diag = OptimizerDiagnostics(every_n_steps=20)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=21, callbacks=[diag], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(Vanishing(), train_dataloaders=DataLoader(torch.ones(64, 8), batch_size=2))
    state = trainer.optimizers[0].state[next(trainer.lightning_module.parameters())]
    bias_correction2 = 1 - 0.1 ** float(state["step"])
    denom = (state["max_exp_avg_sq"] / bias_correction2).sqrt()
    assert bool((denom > 1e-8).all()) and bool(((state["exp_avg_sq"] / bias_correction2).sqrt() < 1e-8).all())
    assert diag.last["optim/0/eps_dominated_frac"] == 0.0
