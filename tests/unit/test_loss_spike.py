"""LossSpikeMonitor: detection on synthetic sequences, skip / rollback exactness, cool-down, raise, resume, state."""

from __future__ import annotations

import json
import math
import random
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import AdaptiveGradClip, LossSpikeMonitor
from lit_dtrain.callbacks._spike_stats import (
    GRAD_SPIKE,
    LOSS_SPIKE,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    RobustStat,
    SpikeDetector,
    SpikeWindow,
    cooldown_factor,
)
from lit_dtrain.callbacks.loss_spike import LossSpikeError
from tests.conftest import make_corpus
from tests.faults import RaiseOnceAt


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest single-threaded, especially when CPU cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ---------------------------------------------------------------------------------------------------------------
# pure statistics
# ---------------------------------------------------------------------------------------------------------------


def synthetic_losses(n: int, seed: int, noise: float = 0.04) -> list[float]:
    """A decaying training-loss curve with multiplicative noise and occasional mild bumps (no spikes)."""
    rng = random.Random(seed)
    out = []
    for t in range(n):
        base = 2.0 + 3.5 * math.exp(-t / 150.0)
        bump = 0.08 * base if rng.random() < 0.02 else 0.0  # a harder-than-usual batch, not a spike
        out.append(base * (1.0 + noise * rng.gauss(0.0, 1.0)) + bump)
    return out


SPIKES = {300: ("mul", 1.6), 777: ("nan", None), 1200: ("mul", 2.5), 1201: ("mul", 2.0), 1650: ("inf", None)}


def with_spikes(losses: list[float]) -> list[float]:
    out = list(losses)
    for step, (kind, factor) in SPIKES.items():
        out[step] = out[step] * factor if kind == "mul" else math.nan if kind == "nan" else math.inf
    return out


@pytest.mark.parametrize("method", ["ema", "median"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_finds_exactly_the_known_spikes(method: str, seed: int) -> None:
    detector = SpikeDetector(method=method, warmup_steps=50)
    losses = with_spikes(synthetic_losses(2000, seed))
    found = [t for t, x in enumerate(losses) if detector.decide(x).is_spike]
    assert found == sorted(SPIKES)


def test_detector_reasons_and_warmup() -> None:
    detector = SpikeDetector(warmup_steps=10, grad_z_threshold=6.0)
    # during warmup only non-finite values count
    assert detector.decide(100.0, 1.0).reasons == []
    assert detector.decide(math.nan, 1.0).reasons == [NONFINITE_LOSS]
    assert detector.decide(3.0, math.inf).reasons == [NONFINITE_GRAD]
    detector = SpikeDetector(warmup_steps=10, grad_z_threshold=6.0)
    for i in range(30):
        assert not detector.decide(3.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 2)).is_spike
    assert detector.decide(3.01, 10.0).reasons == [GRAD_SPIKE]
    assert detector.decide(9.0, 1.0).reasons == [LOSS_SPIKE]
    assert detector.decide(1.0, 1.0).reasons == []  # lower than usual is never a spike
    count = detector.loss_stat.count
    detector.decide(9.0, 1.0)
    assert detector.loss_stat.count == count  # spikes are not absorbed into the statistics


def test_a_lasting_level_shift_is_accepted_after_max_consecutive_spikes() -> None:
    losses = synthetic_losses(1500, 0)
    shifted = losses[:1000] + [1.6 * x for x in losses[1000:]]  # the loss level moves up for good
    detector = SpikeDetector(max_consecutive=10)
    decisions = [detector.decide(x) for x in shifted]
    assert [t for t, d in enumerate(decisions) if d.is_spike] == list(range(1000, 1009))
    assert [t for t, d in enumerate(decisions) if d.level_shift] == [1009]
    never = SpikeDetector(max_consecutive=None)
    assert sum(never.decide(x).is_spike for x in shifted) > 400  # without it, skip would drop every later step


def test_a_lasting_grad_norm_level_shift_is_accepted_after_max_consecutive_spikes() -> None:
    """With grad_z_threshold, a grad norm that rose for good was a spike at every later step: skip dropped all of
    them. It is accepted after max_consecutive grad-norm spikes in a row, as the loss is."""
    losses = synthetic_losses(400, 0)
    grads = [g if t < 200 else 20.0 * g for t, g in enumerate(synthetic_losses(400, 1))]
    detector = SpikeDetector(grad_z_threshold=4.0, max_consecutive=10)
    decisions = [detector.decide(x, g) for x, g in zip(losses, grads)]
    assert [t for t, d in enumerate(decisions) if d.is_spike] == list(range(200, 209))
    assert {tuple(d.reasons) for d in decisions if d.is_spike} == {(GRAD_SPIKE,)}
    assert [t for t, d in enumerate(decisions) if d.grad_level_shift] == [209]
    assert not any(d.level_shift for d in decisions)  # the loss did not move
    assert detector.loss_stat.count == 400 - 9  # the accepted step's loss counts; the spikes' do not
    state = SpikeDetector(grad_z_threshold=4.0)
    state.load_state_dict(detector.state_dict())
    assert state.state_dict() == detector.state_dict()


def test_both_thresholds_must_hold() -> None:
    only_z = SpikeDetector(z_threshold=6.0, rel_threshold=None, warmup_steps=5)
    both = SpikeDetector(z_threshold=6.0, rel_threshold=0.2, warmup_steps=5)
    for x in [3.0, 3.001, 2.999, 3.0, 3.001, 3.0]:
        only_z.decide(x)
        both.decide(x)
    # 10% above a very flat history: z is huge (scale floor 1% of 3.0 -> z = 10) but rel = 0.1 < 0.2
    assert only_z.decide(3.3, update=False).is_spike
    assert not both.decide(3.3, update=False).is_spike
    assert both.decide(3.7, update=False).is_spike


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_spike_inside_the_warmup_does_not_blind_the_detector(seed: int) -> None:
    """Nothing can be a spike during the warmup; a 10x loss there used to inflate the EMA scale so much that a
    3x loss 80 steps after the warmup had z = 2.5 (missed) and detection came back only after ~300 steps."""
    losses = synthetic_losses(400, seed)
    polluted = list(losses)
    polluted[20] = 10 * losses[20]
    clean_detector, detector = SpikeDetector(warmup_steps=50), SpikeDetector(warmup_steps=50)
    for t in range(130):
        clean_detector.decide(losses[t])
        detector.decide(polluted[t])
        if t == 30:  # mid-warmup, the state (with its warmup values) round-trips through plain JSON
            detector.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert detector.decide(3 * losses[130], update=False).is_spike
    # the despiked warmup leaves statistics close to those of the clean run
    assert detector.loss_stat.scale() < 1.5 * clean_detector.loss_stat.scale()
    assert abs(detector.loss_stat.location() / clean_detector.loss_stat.location() - 1) < 0.01
    # and a clean warmup is left exactly as it was: the recomputation only happens when there is a spike
    plain = RobustStat(warmup=50, clip_z=None)  # clip_z=None: no despiking
    again = SpikeDetector(warmup_steps=50)
    for x in losses[:60]:
        plain.add(x)
        again.decide(x)
    assert (plain.mean, plain.var) == (again.loss_stat.mean, again.loss_stat.var)


@pytest.mark.parametrize("warmup", [2, 3, 5])
def test_a_spike_inside_a_warmup_shorter_than_6_steps_does_not_blind_the_detector(warmup: int) -> None:
    """The despiking takes the noise scale from the warmup's own values, and fewer than 6 cannot tell one spike from
    noise: with warmup_steps 2-5 and a 10x loss at step 1, a 3x loss at step 200 went undetected. The first 6 values
    are now despiked again once there are 6 of them."""
    for seed in range(3):
        losses = synthetic_losses(400, seed)
        polluted = list(losses)
        polluted[1] = 10 * losses[1]
        detector = SpikeDetector(warmup_steps=warmup)
        for t in range(200):
            detector.decide(polluted[t])
            if t == 3:  # the kept values round-trip through the state
                detector.load_state_dict(json.loads(json.dumps(detector.state_dict())))
        assert detector.decide(3 * losses[200], update=False).is_spike, seed


def test_robust_stat_ema_tracks_mean_and_std() -> None:
    rng = random.Random(0)
    stat = RobustStat("ema", decay=0.99, warmup=10, clip_z=None, min_rel_scale=0.0)
    for _ in range(5000):
        stat.add(rng.gauss(10.0, 2.0))
    assert abs(stat.location() - 10.0) < 0.5
    assert abs(stat.scale() - 2.0) < 0.4
    med = RobustStat("median", window=2001, warmup=10, min_rel_scale=0.0)
    for _ in range(2001):
        med.add(rng.gauss(10.0, 2.0))
    assert abs(med.location() - 10.0) < 0.2
    assert abs(med.scale() - 2.0) < 0.2


def test_robust_stat_ema_weighs_early_values_and_errors_equally() -> None:
    """Until ``1/(1-decay)`` values the location is the plain mean and the scale the RMS of the one-step forecast
    errors ``x_k - mean(x_1..x_(k-1))`` (exact on a short series)."""
    stat = RobustStat("ema", decay=0.99, warmup=2, clip_z=None, min_rel_scale=0.0, min_scale=0.0)
    for x in (1.0, 3.0, 2.0, 6.0):  # running means 1, 2, 2, 3; errors 2, 0, 4
        stat.add(x)
    assert stat.location() == pytest.approx(3.0, rel=1e-12)
    assert stat.scale() == pytest.approx(math.sqrt((4 + 0 + 16) / 3), rel=1e-12)


def test_detector_state_roundtrip_gives_identical_decisions() -> None:
    losses = with_spikes(synthetic_losses(2000, 3))
    a = SpikeDetector(method="median", window=50)
    for x in losses[:1000]:
        a.decide(x)
    b = SpikeDetector(method="median", window=50)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # plain floats/ints/lists only
    for x in losses[1000:]:
        da, db = a.decide(x), b.decide(x)
        assert (da.reasons, da.loss_z if math.isfinite(da.loss_z) else 0) == (
            db.reasons, db.loss_z if math.isfinite(db.loss_z) else 0)


def test_window_and_cooldown() -> None:
    w = SpikeWindow(max_spikes=3, window_steps=100)
    assert [w.add(s) for s in (10, 50, 200, 250, 260)] == [False, False, False, False, True]
    edge = SpikeWindow(max_spikes=3, window_steps=100)  # the window is the last 100 steps, (step - 100, step]
    assert [edge.add(s) for s in (0, 50, 100)] == [False, False, False]  # step 0 is 100 steps back: outside
    assert edge.add(149) is True  # 50, 100, 149
    assert [cooldown_factor(s, 0.1, 2, 3) for s in range(-1, 7)] == pytest.approx(
        [1.0, 0.1, 0.1, 0.1 + 0.9 * 0.25, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.75, 1.0, 1.0])


def test_a_checkpoint_carries_every_part_of_the_monitor_state() -> None:
    """A resumed monitor holds what the interrupted one held: the raise window's spike steps above all (a resume that
    forgot steps 10 and 50 let a third spike at step 60 train on where the uninterrupted run raised)."""
    def monitor():
        return LossSpikeMonitor(actions=["log", "skip", "raise"], raise_after=3, raise_window=100, warmup_steps=3)

    before = monitor()
    for step in (10, 50):
        assert before.window.add(step) is False
    for loss in (2.0, 2.1, 1.9, 2.05):
        before.detector.decide(loss)
    before.excluded, before.num_spikes, before.nonfinite_run, before.cooldown_start = [7, 3], 2, [50], 50
    before.recent_indices.append([1, 2])
    after = monitor()
    after.load_state_dict(before.state_dict())
    assert after.window.steps == [10, 50] and after.window.add(60) is True
    assert after.detector.state_dict() == before.detector.state_dict()
    assert (after.excluded, after.num_spikes, after.nonfinite_run, after.cooldown_start) == ([7, 3], 2, [50], 50)
    assert [list(x) for x in after.recent_indices] == [[1, 2]]


def test_a_rollback_drops_the_snapshots_newer_than_the_one_restored() -> None:
    """Those may hold the update that caused the spike: a second spike soon after the rollback must go back to the
    restored snapshot or older, never forward to one taken after it (the ring kept it, and step 33 went to step 30)."""
    from lit_dtrain.callbacks._snapshots import SnapshotRing

    ring = SnapshotRing(keep=3)
    ring.snapshots.extend({"step": step, "layout": ([[2]], ("w",))} for step in (10, 20, 30))
    snap, old_enough = ring.pick(31, 5, ([[2]], ("w",)))
    assert (snap["step"], old_enough) == (20, True) and [s["step"] for s in ring.snapshots] == [10, 20]
    assert ring.pick(33, 1, ([[2]], ("w",)))[0]["step"] == 20


def test_bad_arguments_fail_loudly() -> None:
    with pytest.raises(ValueError, match="actions"):
        LossSpikeMonitor(actions=["log", "explode"])
    with pytest.raises(ValueError, match="z_threshold and rel_threshold"):
        SpikeDetector(z_threshold=None, rel_threshold=None)
    with pytest.raises(ValueError, match="method"):
        RobustStat("mean")
    with pytest.raises(ValueError, match="grad_z_threshold needs check_grad"):
        LossSpikeMonitor(grad_z_threshold=5.0, check_grad=False)
    # the message names the argument the user passed (it named the internal ``warmup`` / ``max_spikes``)
    with pytest.raises(ValueError, match=r"LossSpikeMonitor: warmup_steps must be >= 2, got 0"):
        LossSpikeMonitor(warmup_steps=0)
    with pytest.raises(ValueError, match=r"LossSpikeMonitor: raise_after must be >= 1, got 0"):
        LossSpikeMonitor(raise_after=0)
    with pytest.raises(ValueError, match=r"LossSpikeMonitor: raise_window must be >= 1, got 0"):
        LossSpikeMonitor(raise_window=0)
    # the statistics' arguments are checked by RobustStat and SpikeDetector, but reported under the callback the
    # user configured and the argument's own name (they said 'RobustStat: method ...', 'RobustStat: warmup ...')
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: decay must be in \(0, 1\), got 1.5$"):
        LossSpikeMonitor(decay=1.5)
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: method must be one of \('ema', 'median'\), got 'mean'$"):
        LossSpikeMonitor(method="mean")
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: warmup_steps \(20\) must be <= window \(10\)"):
        LossSpikeMonitor(method="median", window=10, warmup_steps=20)
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: max_consecutive must be >= 2 or None, got 1$"):
        LossSpikeMonitor(max_consecutive=1)
    # no kept snapshot is ever 4 steps old (snapshots 2 steps apart, 2 kept): every rollback restored a newer one
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: rollback_min_age \(4\) must be < snapshot_every \* "
                                         r"snapshot_keep \(2 \* 2\)"):
        LossSpikeMonitor(actions=["rollback"], snapshot_every=2, snapshot_keep=2, rollback_min_age=4)
    assert LossSpikeMonitor(actions=["rollback"], snapshot_every=2, snapshot_keep=2, rollback_min_age=3)
    assert LossSpikeMonitor(actions=["skip"], snapshot_every=2, snapshot_keep=2, rollback_min_age=4)  # unused
    with pytest.raises(ValueError, match=r"^AdaptiveGradClip: decay must be in \(0, 1\), got 1.5$"):
        AdaptiveGradClip(decay=1.5)
    with pytest.raises(ValueError, match=r"^RobustStat: scale_decay must be in \(0, 1\), got 0.0$"):
        RobustStat(scale_decay=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Lightning integration: a tiny model on a tiny corpus
# ---------------------------------------------------------------------------------------------------------------


def make_module(seed: int = 0):
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.schedules import cosine_scheduler

    torch.manual_seed(seed)
    model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32))
    return LitLLM(model, optimizer=partial(adamw, lr=3e-3), scheduler=partial(cosine_scheduler, total_steps=40,
                                                                              warmup_steps=2))


def make_data(tmp_path: Path, batch_size: int = 4, n_files: int = 6, size: int = 2000):
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.data.corpus import CorpusSource

    corpus = make_corpus(tmp_path / "corpus", n_files=n_files, size=size)
    return LMDataModule(sources=[CorpusSource(name="c", kind="files", paths=[str(corpus)])], block_size=32,
                        batch_size=batch_size, cache_dir=str(tmp_path / "cache"), progress=False, max_val_windows=4)


def make_trainer(tmp_path: Path, callbacks, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(tmp_path), limit_val_batches=0, gradient_clip_val=1.0)


def fit_with_tensorboard(tmp_path: Path, callbacks, max_steps: int, log_every_n_steps: int):
    """Fit ``make_module()`` with a TensorBoard logger; the event files' EventAccumulator, loaded."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks,
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
                        log_every_n_steps=log_every_n_steps, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=0)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


class Inject(L.Callback):
    """At the given steps, multiplies the logits (finite spike) or makes them NaN."""

    def __init__(self, steps: dict[int, str]) -> None:
        self.steps, self._handle = steps, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kind = self.steps.get(trainer.global_step)
        if kind is not None:
            scale = float("nan") if kind == "nan" else 30.0
            self._handle = pl_module.model.register_forward_hook(lambda m, i, out: out * scale)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class InjectAt(Inject):
    """:class:`Inject` with list arguments, for Hydra overrides."""

    def __init__(self, finite: list[int] = (), nan: list[int] = ()) -> None:
        super().__init__({**{int(s): "finite" for s in finite}, **{int(s): "nan" for s in nan}})


def full_state(trainer: L.Trainer) -> dict:
    opt = trainer.optimizers[0]
    return {
        "params": {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()},
        "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())},
        "lrs": [g["lr"] for g in opt.param_groups],
        "sched": dict(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
    }


def assert_identical(a: dict, b: dict, schedule: bool = True) -> None:
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        for k in a["opt"][i]:
            assert torch.equal(a["opt"][i][k], b["opt"][i][k]), (i, k)
    if schedule:
        assert a["lrs"] == b["lrs"]
        assert a["sched"]["last_epoch"] == b["sched"]["last_epoch"]
        assert a["sched"]["_last_lr"] == b["sched"]["_last_lr"]


def assert_schedule_follows_the_step(probe) -> None:
    """Skips and rollbacks do not hold the LR schedule back: after ``s`` steps it has taken ``s`` steps, and
    every param group runs at the scheduler's LR (so a WSD decay always ends on its last value)."""
    for done, state in probe.after.items():
        assert state["sched"]["last_epoch"] == done, done
        assert state["lrs"] == state["sched"]["_last_lr"], done


class Probe(L.Callback):
    """Full training state at the end of every step, and the sample indices of every batch."""

    def __init__(self, full: bool = True) -> None:
        self.full = full
        self.after: dict[int, dict] = {}
        self.indices: dict[int, list[int]] = {}

    def on_train_start(self, trainer, pl_module):
        if self.full:
            self.after[trainer.global_step] = full_state(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.indices[trainer.global_step] = batch["index"].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.full:
            self.after[trainer.global_step] = full_state(trainer)  # keyed by steps completed


@pytest.mark.parametrize("kind", ["finite", "nan"])
def test_skip_leaves_params_optimizer_and_schedule_bit_identical(tmp_path: Path, kind: str) -> None:
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    probe = Probe()
    trainer = make_trainer(tmp_path, [Inject({6: kind}), monitor, probe], max_steps=9)
    dm = make_data(tmp_path)
    trainer.fit(make_module(), datamodule=dm)
    assert [e["step"] for e in monitor.events] == [6]
    assert monitor.events[0]["actions"] == ["log", "skip"]
    # the weights and optimizer state after step 6 are exactly those after step 5: the batch never came
    assert_identical(probe.after[6], probe.after[7], schedule=False)
    # ... and normal steps do change them (the comparison can fail)
    with pytest.raises(AssertionError):
        assert_identical(probe.after[5], probe.after[6], schedule=False)
    assert_schedule_follows_the_step(probe)
    # its samples are excluded from the sampler and recorded in spikes.jsonl
    assert sorted(monitor.excluded) == sorted(set(probe.indices[6]))
    assert bool(dm.sampler.excluded[probe.indices[6]].all())
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [(e["step"], e["index"]) for e in lines] == [(6, probe.indices[6])]
    assert lines[0]["reasons"] == (["nonfinite_loss", "nonfinite_grad"] if kind == "nan" else ["loss"])
    assert all(bool(torch.isfinite(v).all()) for v in probe.after[9]["params"].values())


def test_rollback_restores_exactly_the_snapshot(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=3, snapshot_every=3, rollback_min_age=2)
    probe = Probe()
    trainer = make_trainer(tmp_path, [Inject({10: "finite"}), monitor, probe], max_steps=12)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    (event,) = monitor.events
    # snapshots at 6 and 9 steps; 9 is 1 step old at step 10 (< rollback_min_age=2), so 6 is restored
    assert (event["step"], event["rolled_back_to"]) == (10, 6)
    assert_identical(probe.after[6], probe.after[11], schedule=False)
    with pytest.raises(AssertionError):
        assert_identical(probe.after[9], probe.after[11], schedule=False)
    assert_schedule_follows_the_step(probe)
    assert sorted(monitor.excluded) == sorted(set(probe.indices[10]))


def test_lr_cooldown_scales_the_applied_lr_and_leaves_the_schedule(tmp_path: Path) -> None:
    class LrProbe(L.Callback):
        def __init__(self):
            self.applied, self.scheduled = {}, {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.applied[trainer.global_step] = optimizer.param_groups[0]["lr"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.scheduled[trainer.global_step] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]

    monitor = LossSpikeMonitor(actions=["lr_cooldown"], warmup_steps=3, cooldown_factor=0.1, cooldown_steps=2,
                               cooldown_ramp_steps=1)
    lr_probe = LrProbe()
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor, lr_probe], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [5]
    factors = {s: lr_probe.applied[s] / lr_probe.scheduled[s] for s in range(4, 10)}  # scheduled[s]: LR of step s
    assert factors == pytest.approx({4: 1.0, 5: 0.1, 6: 0.1, 7: 0.55, 8: 1.0, 9: 1.0})


def test_a_batch_skipped_by_the_module_is_ignored(tmp_path: Path) -> None:
    """``training_step`` returning None is Lightning's way to skip a batch: no decision, no crash."""
    module = make_module()
    step = module.training_step
    module.training_step = lambda batch, batch_idx: None if module.trainer.global_step == 5 else step(batch, batch_idx)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [monitor], max_steps=8)
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert trainer.global_step == 8 and monitor.events == []
    assert monitor.detector.loss_stat.count == 7  # the seven steps with a loss, not the skipped batch


def test_state_survives_a_resume_with_retuned_thresholds(tmp_path: Path) -> None:
    """The state key is the class name: retuning a threshold on resume keeps the excluded samples and counts,
    and a checkpoint that stored them under the older argument-built key still loads."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=7)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert monitor.num_spikes == 1 and monitor.excluded
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    raw = torch.load(ckpt, weights_only=False)
    old_key = "LossSpikeMonitor{'actions': ('log', 'skip'), 'z': 6.0, 'rel': 0.2, 'method': 'ema'}"
    raw["callbacks"] = {old_key: raw["callbacks"]["LossSpikeMonitor"]}
    torch.save(raw, tmp_path / "old_key.ckpt")
    for path in (ckpt, tmp_path / "old_key.ckpt"):
        retuned = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, z_threshold=8.0, rel_threshold=0.3)
        again = make_trainer(tmp_path, [retuned], max_steps=8)
        again.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=str(path))
        assert retuned.num_spikes == 1 and retuned.excluded == monitor.excluded, path.name
        assert retuned.detector.loss_stat.count >= monitor.detector.loss_stat.count


def test_raise_after_m_spikes(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["log", "skip", "raise"], warmup_steps=3, raise_after=2, raise_window=10)
    trainer = make_trainer(tmp_path, [Inject({5: "finite", 7: "nan"}), monitor], max_steps=12)
    with pytest.raises(LossSpikeError, match="2 loss spikes within 10 steps"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert trainer.global_step == 8
    assert len((tmp_path / "spikes.jsonl").read_text().splitlines()) == 2


def test_missing_index_key_is_named(tmp_path: Path) -> None:
    class NoIndex(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch.pop("index")

    trainer = make_trainer(tmp_path, [NoIndex(), LossSpikeMonitor(actions=["skip"])], max_steps=2)
    with pytest.raises(KeyError, match="'index'"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))


def test_resume_honours_skipped_indices_and_state_survives_checkpoint(tmp_path: Path) -> None:
    # a small corpus and a wide batch so that, without exclusion, the resumed steps would redraw the samples
    data_kwargs = dict(batch_size=16, n_files=3, size=1200)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    probe = Probe(full=False)
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor, probe], max_steps=8)
    dm = make_data(tmp_path, **data_kwargs)
    trainer.fit(make_module(), datamodule=dm)
    skipped = sorted(set(probe.indices[5]))
    assert sorted(monitor.excluded) == skipped
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)

    raw = torch.load(ckpt, map_location="cpu", weights_only=True)  # plain state only
    (key,) = [k for k in raw["callbacks"] if k.startswith("LossSpikeMonitor")]
    saved = raw["callbacks"][key]
    assert saved["excluded"].tolist() == monitor.excluded and saved["num_spikes"] == 1

    class StateAtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = monitor2.state_dict()

    monitor2 = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    probe2, at_start = Probe(full=False), StateAtStart()
    dm2 = make_data(tmp_path, **data_kwargs)
    trainer2 = make_trainer(tmp_path, [monitor2, probe2, at_start], max_steps=24)
    trainer2.fit(make_module(seed=1), datamodule=dm2, ckpt_path=str(ckpt))
    assert at_start.state["detector"] == monitor.state_dict()["detector"]  # statistics continue, not restart
    assert monitor2.excluded == monitor.excluded and monitor2.num_spikes == 1
    drawn = {i for step, idx in probe2.indices.items() for i in idx}
    assert min(probe2.indices) == 8 and not drawn & set(skipped)
    # without the exclusion the same steps would have drawn some of them (so this test can fail)
    from lit_dtrain.data.samplers import RandomSampler

    plain = RandomSampler()
    plain.setup(dm2.num_train_samples, None, dm2.seed)
    would = {i for s in probe2.indices for i in plain.global_batch(s, 16).tolist()}
    assert would & set(skipped)


def test_a_resume_that_replays_a_spike_keeps_one_record_of_it(tmp_path: Path) -> None:
    """A run killed after a spike but before its next checkpoint replays the spike's step on resume: spikes.jsonl
    had the event twice (and spike/count said 1). The resumed run now moves the records of the steps it replays
    out of spikes.jsonl (into spikes.superseded.jsonl), so the file holds each event of the run's history once."""
    def run(max_steps, ckpt_path=None):
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
        trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=max_steps)
        trainer.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=ckpt_path)
        return trainer, monitor

    trainer, _ = run(4)
    trainer.save_checkpoint(tmp_path / "step4.ckpt")  # the last checkpoint before the spike at step 5
    run(7, tmp_path / "step4.ckpt")  # ... the spike, then the process dies before it checkpoints again
    events = tmp_path / "spikes.jsonl"
    assert [json.loads(line)["step"] for line in events.read_text().splitlines()] == [5]
    _, monitor = run(8, tmp_path / "step4.ckpt")  # resume=auto from the same checkpoint replays step 5
    assert [e["step"] for e in monitor.events] == [5] and monitor.num_spikes == 1
    assert [json.loads(line)["step"] for line in events.read_text().splitlines()] == [5]
    superseded = tmp_path / "spikes.superseded.jsonl"
    assert [json.loads(line)["step"] for line in superseded.read_text().splitlines()] == [5]


def test_a_fresh_start_in_the_run_dir_of_a_run_killed_before_its_first_checkpoint_keeps_one_record(
    tmp_path: Path,
) -> None:
    """``resume=auto`` of a run killed before its first checkpoint starts afresh at step 0 in the same run dir and
    replays every step: the killed attempt's records move to spikes.superseded.jsonl (spikes.jsonl had step 5 twice)."""
    def run(max_steps):
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
        trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=max_steps)
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        return monitor

    run(7)  # the spike, then the process dies before any checkpoint
    monitor = run(8)  # the same run dir, from step 0
    assert [e["step"] for e in monitor.events] == [5]
    events = [json.loads(line) for line in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [5] and events[0]["index"] == monitor.events[0]["index"]
    superseded = tmp_path / "spikes.superseded.jsonl"
    assert [json.loads(line)["step"] for line in superseded.read_text().splitlines()] == [5]


@pytest.mark.parametrize(("kept", "expected"), [(2, [7, 8]), (0, [])])
def test_events_in_memory_stay_bounded_while_spikes_jsonl_has_every_one(tmp_path: Path, monkeypatch, kept,
                                                                         expected) -> None:
    """``events`` kept every event of the fit, one more per spike for as long as the run lasted (196 events after 200
    steps of NaN losses); it keeps the latest ``events_kept``, and spikes.jsonl still has every one. ``events_kept =
    0`` keeps none (``del events[:-0]`` deleted nothing: it kept all 5)."""
    monkeypatch.setattr(LossSpikeMonitor, "events_kept", kept, raising=False)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=None)
    trainer = make_trainer(tmp_path, [Inject({s: "nan" for s in range(4, 9)}), monitor], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path, n_files=1, size=4000))
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == [4, 5, 6, 7, 8] and [e["step"] for e in monitor.events] == expected
    assert monitor.num_spikes == 5


def test_spikes_that_exclude_every_sample_stop_with_the_last_one_recorded(tmp_path: Path) -> None:
    """Once the spikes' samples are all of the data the sampler raises; the error says the monitor's exclusions did it,
    and the spike that excluded the last samples is in spikes.jsonl (its record was written after the exclusion)."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=None)
    trainer = make_trainer(tmp_path, [Inject({s: "nan" for s in range(2, 40)}), monitor], max_steps=40)
    dm = make_data(tmp_path, n_files=1, size=400)  # 11 windows
    with pytest.raises(RuntimeError, match=r"LossSpikeMonitor: excluding the samples of the spike at step \d+ failed"
                                           r".*nothing is left to train on"):
        trainer.fit(make_module(), datamodule=dm)
    last = trainer.global_step - 1  # the step that raised
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == list(range(2, last + 1)) == [e["step"] for e in monitor.events]
    assert monitor.num_spikes == len(lines)
    assert sorted({i for e in lines for i in e["index"]}) == list(range(dm.num_train_samples))


def test_a_lasting_grad_norm_rise_does_not_drop_every_later_step(tmp_path: Path) -> None:
    """grad_z_threshold and a grad norm that is 20x from step 10 on, with a normal loss: every later step was skipped
    (the weights after step 60 were those after step 10, and the run ended with exit 0). Now 9 are, then the new
    level is accepted and recorded."""
    class GradTimes20(L.Callback):
        def __init__(self):
            self.handle = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= 10:
                hook = lambda m, i, out: (out.register_hook(lambda g: g * 20.0), out)[1]  # noqa: E731
                self.handle = pl_module.model.register_forward_hook(hook)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    monitor, probe = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5, grad_z_threshold=4.0), Probe()
    trainer = make_trainer(tmp_path, [GradTimes20(), monitor, probe], max_steps=30)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events if e["actions"]] == list(range(10, 19))
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [(e["step"], e["reasons"]) for e in lines][-1] == (19, ["grad_level_shift"])
    with pytest.raises(AssertionError):  # the steps after the shift train
        assert_identical(probe.after[19], probe.after[30], schedule=False)


def test_state_dict_roundtrip_restores_statistics_exactly(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [Inject({4: "nan"}), monitor], max_steps=7)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    path = tmp_path / "state.pt"
    torch.save(monitor.state_dict(), path)
    other = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    other.load_state_dict(torch.load(path, weights_only=True))
    assert other.detector.state_dict() == monitor.detector.state_dict()
    assert other.excluded == monitor.excluded and other.num_spikes == monitor.num_spikes == 1
    for x in (3.0, 9.0, math.nan):
        assert other.detector.decide(x).reasons == monitor.detector.decide(x).reasons


def test_gradient_accumulation_skips_the_whole_step(tmp_path: Path) -> None:
    class MicroInject(L.Callback):  # spikes the second micro-batch of optimizer step 5 only
        def __init__(self):
            self.micro, self.handle = 0, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2 * 5 + 1:
                self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * 30.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    monitor, probe = LossSpikeMonitor(actions=["skip"], warmup_steps=3), Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, accumulate_grad_batches=2, logger=False,
                        callbacks=[MicroInject(), monitor, probe], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [5]
    assert_identical(probe.after[5], probe.after[6], schedule=False)  # the whole optimizer step was dropped
    assert_schedule_follows_the_step(probe)
    both_micro_batches = sorted(set(monitor.events[0]["index"]))
    assert len(monitor.events[0]["index"]) == 8 and sorted(monitor.excluded) == both_micro_batches


def test_without_a_sampler_steps_holding_excluded_samples_are_skipped(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(16):  # 4 fixed batches of 4, replayed every epoch
        ids = torch.randint(0, 257, (33,), generator=g)
        items.append({"input_ids": ids[:-1], "labels": ids[1:], "index": torch.tensor(i)})
    monitor, probe = LossSpikeMonitor(actions=["skip"], warmup_steps=2), Probe()
    trainer = make_trainer(tmp_path, [Inject({1: "nan"}), monitor, probe], max_steps=10)
    # (it said "the datamodule has no sampler" when there is no datamodule)
    with pytest.warns(UserWarning, match="there is no datamodule, so no sampler with exclude"):
        trainer.fit(make_module(), train_dataloaders=DataLoader(items, batch_size=4, shuffle=False))
    events = [(e["step"], e["reasons"]) for e in monitor.events]
    assert events == [(1, ["nonfinite_loss", "nonfinite_grad"]), (5, ["excluded_sample"]),
                      (9, ["excluded_sample"])]
    assert monitor.excluded == [4, 5, 6, 7] and monitor.num_spikes == 1
    for step in (1, 5, 9):
        assert_identical(probe.after[step], probe.after[step + 1], schedule=False)
    assert_schedule_follows_the_step(probe)


def test_train_cfg_split_run_with_skips_reproduces_the_straight_run(tiny_cfg) -> None:
    """Through Hydra and train(cfg): spikes.jsonl in the run dir, and a resume with skips is bit-exact, also with
    dropout (masks seeded by the step, lit_dtrain.step_rng) and the split right after a skipped step (5) with a
    skip at the resumed run's first step (6)."""
    from lit_dtrain.train import train

    n = 6
    common = ["callbacks=[default,loss_spike]", "sample.max_new_tokens=0", "trainer.val_check_interval=3",
              f"scheduler.total_steps={2 * n}", "callbacks.loss_spike.warmup_steps=2", "model.dropout=0.1",
              "+callbacks.inject._target_=tests.unit.test_loss_spike.InjectAt", "+callbacks.inject.finite=[3,5,6,8]",
              "+callbacks.inject.nan=[10]"]
    _, straight = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", run="straight"))
    train(tiny_cfg(*common, f"trainer.max_steps={n}", run="split"))
    _, resumed = train(tiny_cfg(*common, f"trainer.max_steps={2 * n}", "resume=auto", run="split"))

    def monitor(objects) -> LossSpikeMonitor:
        return next(c for c in objects["trainer"].callbacks if isinstance(c, LossSpikeMonitor))

    a, b = monitor(straight), monitor(resumed)
    assert [e["step"] for e in a.events] == [3, 5, 6, 8, 10]  # skips before, at and after the split
    assert b.excluded == a.excluded and b.num_spikes == a.num_spikes
    run_dir = Path(resumed["trainer"].default_root_dir)
    steps = [json.loads(x)["step"] for x in (run_dir / "spikes.jsonl").read_text().splitlines()]
    assert steps == [e["step"] for e in a.events]  # the first half's events, then the resumed half's
    excluded = resumed["datamodule"].sampler.excluded.nonzero().flatten().tolist()
    assert excluded == sorted(a.excluded)
    sa, sb = straight["module"].model.state_dict(), resumed["module"].model.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_16_mixed_grad_scaler_skip_and_rollback(tmp_path: Path, fused: bool, action: str) -> None:
    """A real GradScaler (fp16 autocast on CPU via an explicit plugin): params, optimizer and scaler exact.

    Fused AdamW unscales inside ``step`` (grads reach the hook still scaled); foreach AdamW is unscaled by
    Lightning first. Both must leave ``scaler.update()`` an inf check, or it raises.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lit_dtrain.optim import adamw

    class ScalerProbe(L.Callback):
        def __init__(self):
            self.states = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.states[trainer.global_step] = dict(trainer.precision_plugin.scaler.state_dict())

    monitor, probe, scaler_probe = LossSpikeMonitor(actions=[action], warmup_steps=3, snapshot_every=2), Probe(), \
        ScalerProbe()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1))
    clip = AdaptiveGradClip(warmup_steps=3)  # also under the scaler: norms measured unscaled
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, plugins=[plugin], logger=False,
                        callbacks=[Inject({6: "finite"}), monitor, clip, probe, scaler_probe],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    module = make_module()
    module.optimizer_factory = partial(adamw, lr=3e-3, fused=fused)
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [6]
    # skip: as after step 5; rollback: snapshot 6 is too new (min age 1), so snapshot 4 is restored
    expected = 6 if action == "skip" else 4
    assert_identical(probe.after[expected], probe.after[7], schedule=False)
    assert_schedule_follows_the_step(probe)
    assert scaler_probe.states[7] == scaler_probe.states[expected]  # scale and growth tracker too
    assert scaler_probe.states[8]["scale"] == 2 * scaler_probe.states[7]["scale"]  # and the scaler carries on
    assert clip.stat.ready and 0.05 < clip.stat.location() < 50  # unscaled norms (the scale reaches 2**16)


def test_a_run_that_is_nan_at_every_step_stops_instead_of_skipping_forever(tmp_path: Path) -> None:
    """Skip drops a NaN step; but if every step is NaN the run cannot recover and must not end as a success."""
    from lit_dtrain.module import NonFiniteError

    nan_from_3 = Inject({s: "nan" for s in range(3, 40)})
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=4)
    trainer = make_trainer(tmp_path, [nan_from_3, monitor], max_steps=30)
    with pytest.raises(NonFiniteError, match=r"4 non-finite \(NaN/inf\) steps in a row, steps 3-6"):
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert trainer.global_step == 7  # steps 3..6 were dropped, not applied, before it stopped
    assert len((tmp_path / "spikes.jsonl").read_text().splitlines()) == 4
    # an isolated NaN step is still just skipped: the count restarts at every finite step
    sparse = Inject({3: "nan", 5: "nan", 7: "nan"})
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=2)
    trainer = make_trainer(tmp_path / "sparse", [sparse, monitor], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path / "sparse"))
    assert trainer.global_step == 10 and monitor.num_spikes == 3 and monitor.nonfinite_run == []


def test_tensorboard_scalars_are_written_at_the_step_they_describe(tmp_path: Path) -> None:
    """Lightning writes step metrics only at its log cadence (after step ``k`` with ``(k + 1) % n == 0``); a value
    self.log-ged at another step was written at the next such step under that step's number. So a spike's z at
    step 7 showed as step 9's, and every later point was the z of 4 steps earlier."""

    class Decisions(L.Callback):
        def __init__(self):
            self.z, self.count = {}, {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - 1  # the step that just ended: Lightning's (and TensorBoard's) x
            self.z[step], self.count[step] = monitor.last_decision.loss_z, float(monitor.num_spikes)

    monitor, decisions = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3), Decisions()
    acc = fit_with_tensorboard(tmp_path, [Inject({7: "finite"}), monitor, decisions], 20, log_every_n_steps=5)
    assert [e["step"] for e in monitor.events] == [7]
    z = {e.step: e.value for e in acc.Scalars("spike/loss_z")}
    count = {e.step: e.value for e in acc.Scalars("spike/count")}
    # the cadence's steps (4, 9, 14, 19) with their own values, and the spike at its own step
    assert z == pytest.approx({s: decisions.z[s] for s in (4, 7, 9, 14, 19)}, rel=1e-6)
    assert z[7] > 6 and all(abs(z[s]) < 6 for s in (4, 9, 14, 19))
    assert count == {s: decisions.count[s] for s in (4, 7, 9, 14, 19)} == {4: 0.0, 7: 1.0, 9: 1.0, 14: 1.0, 19: 1.0}


def test_loss_z_is_logged_from_the_first_step_after_the_warmup(tmp_path: Path) -> None:
    """With warmup_steps=w, steps 0..w-1 fill the statistics and cannot be spikes; their z is not logged. The check
    ran after the decision had added its value, so the z of step w-1 (computed from w-1 values, before the warmup's
    despiking) was written, e.g. a large z of an undetectable warmup spike with no event."""
    monitor = LossSpikeMonitor(actions=["log"], warmup_steps=5)
    acc = fit_with_tensorboard(tmp_path, [Inject({4: "finite"}), monitor], 8, log_every_n_steps=1)
    assert monitor.events == []  # step 4 is still in the warmup: no spike possible
    assert [e.step for e in acc.Scalars("spike/loss_z")] == [5, 6, 7]
    assert [e.step for e in acc.Scalars("spike/count")] == list(range(8))


def test_a_nan_spike_inside_the_warmup_logs_its_loss_z_capped(tmp_path: Path) -> None:
    """docs/loss_spikes.md, the `log` action: `spike/loss_z` is written from the first step after the warmup, and
    also at a spike inside the warmup (only a NaN/inf step can be one there), capped at 1e6; `spike/lr_multiplier`
    only with `lr_cooldown`. (The doc said only "from the first step after the warmup".)"""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5)
    acc = fit_with_tensorboard(tmp_path, [Inject({2: "nan"}), monitor], 7, log_every_n_steps=1)
    assert [e["step"] for e in monitor.events] == [2]
    # the spike's value never enters the statistics, so the 5 warmup values are steps 0, 1, 3, 4, 5: z from step 6
    assert [e.step for e in acc.Scalars("spike/loss_z")] == [2, 6]
    assert acc.Scalars("spike/loss_z")[0].value == 1e6
    assert "spike/lr_multiplier" not in acc.Tags()["scalars"]


def test_rollback_under_the_wsd_callback_keeps_the_lr_of_the_step(tmp_path: Path) -> None:
    """A rollback reloads the optimizer state, whose param groups hold the snapshot's LR. With the WSDScheduler
    callback (no LR scheduler) listed before the monitor, that stale LR stayed in the optimizer until the next
    batch start, where LearningRateMonitor logged it (0.0021 instead of the 0.0027 used at step 8)."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_dtrain.callbacks import WSDScheduler

    class UsedLr(L.Callback):
        def __init__(self):
            self.lr = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lr[trainer.global_step] = optimizer.param_groups[0]["lr"]

    wsd = WSDScheduler(total_steps=12, warmup_steps=10, decay_steps=1)
    monitor = LossSpikeMonitor(actions=["rollback"], warmup_steps=3, snapshot_every=2)
    used = UsedLr()
    module = make_module()
    module.scheduler_factory = None
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, log_every_n_steps=1,
                        callbacks=[LearningRateMonitor(logging_interval="step"), wsd, Inject({7: "finite"}), monitor,
                                   used],
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        limit_val_batches=0)
    trainer.fit(module, datamodule=make_data(tmp_path))
    assert [(e["step"], e["rolled_back_to"]) for e in monitor.events] == [(7, 6)]
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("lr-")]  # one per param group
    expected = {s: 3e-3 * wsd.lr_factor(s) for s in range(12)}
    assert used.lr == pytest.approx(expected, rel=1e-6)
    assert len(tags) == 2
    for tag in tags:  # step 8 too, right after the rollback
        assert {e.step: e.value for e in acc.Scalars(tag)} == pytest.approx(expected, rel=1e-6), tag


def test_log_every_n_steps_zero_writes_only_the_events(tmp_path: Path) -> None:
    """``Trainer(log_every_n_steps=0)`` is Lightning's "no step logging" (its own train/loss and the LR monitor write
    nothing). 3c9b2e8 read 0 as 1, so spike/* and grad_clip/* were written at every step; only the events (the
    spike at 7 and its clip) are."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor, clip = LossSpikeMonitor(actions=["log"], warmup_steps=3), AdaptiveGradClip(warmup_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, callbacks=[Inject({7: "finite"}), clip, monitor],
                        logger=TensorBoardLogger(str(tmp_path), name="tb", version=0), log_every_n_steps=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), limit_val_batches=0)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [7] and clip.clip_events == 1
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("spike/count")] == [7]
    assert [e.step for e in acc.Scalars("grad_clip/clipped")] == [7]
    assert [e.value for e in acc.Scalars("grad_clip/clipped")] == [1.0]


def test_a_short_accumulation_window_at_the_end_of_an_epoch_is_judged_by_its_mean_loss(tmp_path: Path) -> None:
    """A LightningModule of one's own with ``max_epochs`` and ``accumulate_grad_batches=4`` over 5 batches per epoch:
    every epoch ends in an optimizer step of 1 micro-batch, whose loss Lightning still divides by 4 before backward.
    The monitor summed those divided losses, so it saw that step at a quarter of its loss: a 3x spike there read as
    0.75x and was never detected, and every such step pulled the statistics down. The decision must use the mean
    loss of the micro-batches the step had."""
    from torch.utils.data import DataLoader

    class Constant(L.LightningModule):  # every sample has the same loss, and lr=0 keeps it so
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
            self.losses: list[tuple[int, float]] = []  # (optimizer step, unscaled micro-batch loss)
            self.spike_step: int | None = None

        def training_step(self, batch, batch_idx):
            loss = (self.lin(batch["x"]) ** 2).mean() + 1.0
            if self.trainer.global_step == self.spike_step:
                loss = loss * 3.0
            self.losses.append((self.trainer.global_step, float(loss.detach())))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Decisions(L.Callback):  # after the monitor: the loss it decided on, per optimizer step
        def __init__(self, monitor) -> None:
            self.monitor, self.loss = monitor, {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.loss[trainer.global_step] = self.monitor.last_decision.loss

    items = [{"x": torch.ones(4), "index": torch.tensor(i)} for i in range(20)]  # 5 batches of 4
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes.jsonl"))
    decisions = Decisions(monitor)
    module = Constant()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, accumulate_grad_batches=4, logger=False,
                        callbacks=[monitor, decisions], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=4))
    assert trainer.global_step == 8  # 2 optimizer steps per epoch (4 + 1 micro-batches)
    for step in range(8):
        micro = [loss for s, loss in module.losses if s == step]
        assert len(micro) == (4 if step % 2 == 0 else 1)
        assert decisions.loss[step] == pytest.approx(sum(micro) / len(micro), rel=1e-6), step
    module.spike_step = 7  # epoch 3's last optimizer step: its single micro-batch (samples 16-19) at 3x the loss
    monitor2 = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, path=str(tmp_path / "spikes2.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=4, accumulate_grad_batches=4, logger=False,
                        callbacks=[monitor2], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    module.losses.clear()
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=4))
    assert [(e["step"], e["reasons"]) for e in monitor2.events] == [(7, ["loss"])]
    assert monitor2.events[0]["index"] == [16, 17, 18, 19]


@pytest.mark.parametrize("scheduler", ["lambda", "exponential"])
def test_lr_cooldown_survives_a_step_the_grad_scaler_skips(tmp_path: Path, scheduler: str) -> None:
    """Under ``16-mixed`` the GradScaler skips ``optimizer.step`` on an fp16 overflow, and with it the optimizer's
    post-hook that takes the cool-down multiplier out again; Lightning still steps the LR scheduler. The multiplier was
    put in at ``on_before_optimizer_step``, so the scheduler stepped from the cooled LR and the restore at batch end
    then wrote the *previous* step's LR back: the next step ran one scheduler step behind (LambdaLR), and a chainable
    scheduler (ExponentialLR) stayed one step behind for the rest of the run. Every step the optimizer takes must run
    at ``scheduled LR x multiplier``, and the group LR must end on the scheduler's."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    class Own(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 1)
            self.lin.weight.register_hook(lambda g: g * math.inf if self.trainer.global_step == 7 else g)

        def training_step(self, batch, batch_idx):
            loss = (self.lin(batch["x"]) - batch["y"]).square().mean()
            return loss * 30.0 if self.trainer.global_step == 5 else loss  # the spike; step 7 overflows in fp16

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s) if scheduler == "lambda"
                     else torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Applied(L.Callback):  # the LR inside optimizer.step, after every other pre-hook
        def __init__(self) -> None:
            self.lr: dict[int, float] = {}

        def on_train_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_pre_hook(
                lambda opt, args, kwargs: self.lr.__setitem__(trainer.global_step, opt.param_groups[0]["lr"]))

    g = torch.Generator().manual_seed(0)
    items = [{"x": x, "y": x.sum(0, keepdim=True)} for x in torch.randn(48, 4, generator=g)]
    monitor = LossSpikeMonitor(actions=["lr_cooldown"], z_threshold=None, rel_threshold=5.0, warmup_steps=3,
                               cooldown_factor=0.1, cooldown_steps=4, cooldown_ramp_steps=0,
                               path=str(tmp_path / "spikes.jsonl"))
    applied = Applied()
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=11, plugins=[plugin], logger=False,
                        callbacks=[monitor, applied], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Own(), train_dataloaders=DataLoader(items, batch_size=4))
    assert [e["step"] for e in monitor.events] == [5]
    assert sorted(applied.lr) == [s for s in range(11) if s != 7]  # the scaler skipped step 7
    mult = {s: 0.1 if 5 <= s < 9 else 1.0 for s in range(11)}
    for step, lr in applied.lr.items():
        assert lr == pytest.approx(0.01 * 0.9**step * mult[step], rel=1e-9), step
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.9**11, rel=1e-9)


def test_a_reused_monitor_starts_fresh_in_a_new_fit_and_restores_a_checkpoint(tmp_path: Path) -> None:
    """The same callback object in a second ``trainer.fit`` (a sweep loop, staged training): a fit without
    ``ckpt_path`` starts from a fresh state, exactly as a new monitor would; a fit with ``ckpt_path`` continues
    from the checkpoint's state, not from whatever the object held after its last fit."""
    def fit(monitor, max_steps, inject, ckpt_path=None):
        trainer = make_trainer(tmp_path, [Inject(inject), monitor], max_steps=max_steps)
        trainer.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=ckpt_path)
        return trainer

    reused = LossSpikeMonitor(actions=["log", "skip", "lr_cooldown"], warmup_steps=3, exclude_previous_steps=1)
    trainer = fit(reused, 7, {5: "finite"})
    assert reused.num_spikes == 1 and reused.excluded and reused.events
    trainer.save_checkpoint(tmp_path / "seven.ckpt")
    saved = reused.state_dict()

    fresh = LossSpikeMonitor(actions=["log", "skip", "lr_cooldown"], warmup_steps=3, exclude_previous_steps=1)
    fit(fresh, 6, {})
    fit(reused, 6, {})  # a new fit, no checkpoint: nothing of the first fit may carry over
    assert reused.num_spikes == 0 and reused.excluded == [] and reused.events == []
    assert reused.state_dict()["detector"] == fresh.state_dict()["detector"]
    assert reused.cooldown_start == fresh.cooldown_start and reused.window.steps == []
    assert reused.lr_multiplier(6) == 1.0

    fit(reused, 6, {4: "nan"})  # the object now holds another spike...
    assert reused.num_spikes == 1 and reused.events[0]["step"] == 4

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = reused.state_dict()

    at_start = AtStart()
    trainer = make_trainer(tmp_path, [reused, at_start], max_steps=9)
    trainer.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=str(tmp_path / "seven.ckpt"))
    # ... but a fit from the checkpoint starts from the checkpoint's state
    assert at_start.state["detector"] == saved["detector"]
    assert at_start.state["excluded"].tolist() == saved["excluded"].tolist()
    assert at_start.state["num_spikes"] == 1 and at_start.state["cooldown_start"] == saved["cooldown_start"]
    assert [e["step"] for e in reused.events] == []  # the events of this fit (none after step 7)


def test_the_same_trainer_continuing_keeps_the_monitor_state(tmp_path: Path) -> None:
    """``trainer.fit`` again on the same Trainer with a raised max_steps continues the run (global_step goes on from
    7, the weights are the trained ones): the monitor's statistics, spike count and exclusions go on too; only a
    fit that starts at step 0 without a checkpoint starts fresh."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=7)
    module, dm = make_module(), make_data(tmp_path)
    trainer.fit(module, datamodule=dm)
    count, excluded = monitor.detector.loss_stat.count, list(monitor.excluded)
    assert monitor.num_spikes == 1 and excluded
    trainer.fit_loop.epoch_loop.max_steps = 10
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 10
    assert monitor.num_spikes == 1 and monitor.excluded == excluded
    assert monitor.detector.loss_stat.count == count + 3


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
