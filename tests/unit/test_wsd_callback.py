"""WSDScheduler callback: same LR sequence as the LambdaLR scheduler, on any LightningModule; resume; branch."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.callbacks import WSDScheduler
from lit_dtrain.schedules import DECAY_TYPES, wsd_lr_factor, wsd_scheduler

BASE = (0.1, 0.05)  # two param groups with different peak LRs


class Toy(L.LightningModule):
    """A foreign LightningModule: two param groups, optionally its own LambdaLR."""

    def __init__(self, schedule: dict | None = None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)
        self.schedule = schedule

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.a(x) + self.b(x) - y) ** 2).mean()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g)), 4)

    def configure_optimizers(self):
        opt = torch.optim.SGD(
            [{"params": self.a.parameters(), "lr": BASE[0]}, {"params": self.b.parameters(), "lr": BASE[1]}]
        )
        if self.schedule is None:
            return opt
        sched = wsd_scheduler(opt, **self.schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LRRecorder(L.Callback):
    """Records each group's LR when a batch starts (placed first, before the WSD callback) and at the step."""

    def __init__(self) -> None:
        self.at_batch_start: list[tuple[int, list[float]]] = []
        self.at_step: list[tuple[int, list[float]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at_batch_start.append((trainer.global_step, [g["lr"] for g in trainer.optimizers[0].param_groups]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.at_step.append((trainer.global_step, [g["lr"] for g in optimizer.param_groups]))


def fit(module, callbacks, max_steps, ckpt_path=None, root: Path | None = None, accumulate=1) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        accumulate_grad_batches=accumulate, default_root_dir=root,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def expected(steps, **kw) -> list[tuple[int, list[float]]]:
    return [(s, [b * wsd_lr_factor(s, **kw) for b in BASE]) for s in steps]


@pytest.mark.parametrize("decay_type", DECAY_TYPES)
def test_callback_and_scheduler_give_identical_lr_sequences(decay_type):
    kw = dict(total_steps=12, warmup_steps=3, decay_steps=5, decay_type=decay_type, min_lr_factor=0.1)
    rec_sched, rec_cb = LRRecorder(), LRRecorder()
    fit(Toy(schedule=kw), [rec_sched], max_steps=14)
    fit(Toy(), [rec_cb, WSDScheduler(**kw)], max_steps=14)  # recorder first: order must not matter
    assert rec_cb.at_step == rec_sched.at_step == expected(range(14), **kw)
    # what a LearningRateMonitor sees at batch start is already the LR of that step
    assert rec_cb.at_batch_start == rec_sched.at_batch_start == expected(range(14), **kw)


def test_a_reused_callback_reads_the_new_fits_peak_lrs():
    """One callback object for two fits (a sweep loop): the second fit's configured LRs are its peaks."""
    kw = dict(total_steps=6, warmup_steps=0, decay_steps=2)
    callback, first, second = WSDScheduler(**kw), LRRecorder(), LRRecorder()
    fit(Toy(), [first, callback], max_steps=6)
    halved = Toy()
    halved.configure_optimizers = lambda: torch.optim.SGD(
        [{"params": halved.a.parameters(), "lr": BASE[0] / 2}, {"params": halved.b.parameters(), "lr": BASE[1] / 2}])
    fit(halved, [second, callback], max_steps=6)
    assert first.at_step == expected(range(6), **kw)
    assert second.at_step == [(s, [lr / 2 for lr in lrs]) for s, lrs in expected(range(6), **kw)]


def test_gradient_accumulation_uses_one_lr_per_optimizer_step():
    kw = dict(total_steps=8, warmup_steps=2, decay_fraction=0.5)
    rec_sched, rec_cb = LRRecorder(), LRRecorder()
    fit(Toy(schedule=kw), [rec_sched], max_steps=8, accumulate=2)
    fit(Toy(), [rec_cb, WSDScheduler(**kw)], max_steps=8, accumulate=2)
    assert rec_cb.at_step == rec_sched.at_step == expected(range(8), total_steps=8, warmup_steps=2, decay_steps=4)
    assert rec_cb.at_batch_start == rec_sched.at_batch_start  # micro-batches of one step share its LR
    assert len(rec_cb.at_batch_start) == 16


@pytest.mark.parametrize("decay_type", ["1-sqrt", "cosine"])
def test_resume_mid_decay_continues_the_same_sequence(tmp_path, decay_type):
    kw = dict(total_steps=14, warmup_steps=2, decay_steps=6, decay_type=decay_type)
    straight = LRRecorder()
    fit(Toy(), [straight, WSDScheduler(**kw)], max_steps=14)
    first, cb = LRRecorder(), WSDScheduler(**kw)
    trainer = fit(Toy(), [first, cb], max_steps=10, root=tmp_path)  # decay runs over steps 8..13
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=True)["callbacks"]  # plain state, loadable without code
    assert state["WSDScheduler"]["base_lrs"] == [list(BASE)]
    second = LRRecorder()
    fit(Toy(), [second, WSDScheduler(**kw)], max_steps=14, ckpt_path=ckpt)
    assert first.at_step + second.at_step == straight.at_step == expected(range(14), **kw)
    # the restored optimizer held a decayed LR; the peak came from the callback's state, not from it
    assert second.at_step[0] == (10, [b * wsd_lr_factor(10, **kw) for b in BASE])


def test_decay_branch_first_lr_is_the_first_decay_value(tmp_path):
    stable = dict(total_steps=100, warmup_steps=2, decay_fraction=0.2)
    trainer = fit(Toy(), [WSDScheduler(**stable)], max_steps=6, root=tmp_path)
    ckpt = tmp_path / "stable.ckpt"
    trainer.save_checkpoint(ckpt)
    branch, rec = WSDScheduler(total_steps=10, warmup_steps=2, decay_steps=4, min_lr_factor=0.0), LRRecorder()
    t2 = fit(Toy(), [rec, branch], max_steps=10, ckpt_path=ckpt)
    assert t2.global_step == 10 and [s for s, _ in rec.at_step] == [6, 7, 8, 9]
    first = rec.at_step[0][1]
    assert first == pytest.approx([b * 0.5 for b in BASE], abs=1e-12)  # 1 - sqrt(1/4) = 0.5 on step 6
    assert rec.at_step[-1][1] == [0.0, 0.0]


@pytest.mark.parametrize("form", ["callback", "scheduler"])
def test_decay_branch_from_a_fully_decayed_scheduler_checkpoint_uses_the_configured_peak(tmp_path, form):
    """A scheduler-form checkpoint holds no WSDScheduler state and its optimizer LR is 0 after a full decay.
    The callback took that restored LR as its peak and trained the whole branch at LR 0; both forms must run
    the branch's decay from the configured peak (BASE), the scheduler form from its restored base_lrs."""
    done = fit(Toy(schedule=dict(total_steps=6, warmup_steps=1, decay_steps=3)), [], max_steps=6, root=tmp_path)
    ckpt = tmp_path / "decayed.ckpt"
    done.save_checkpoint(ckpt)
    assert [g["lr"] for g in torch.load(ckpt, weights_only=True)["optimizer_states"][0]["param_groups"]] == [0.0, 0.0]
    branch, rec = dict(total_steps=10, warmup_steps=1, decay_steps=4), LRRecorder()
    if form == "callback":
        fit(Toy(), [rec, WSDScheduler(**branch)], max_steps=10, ckpt_path=ckpt)
    else:
        fit(Toy(schedule=branch), [rec], max_steps=10, ckpt_path=ckpt)
    assert rec.at_step == expected(range(6, 10), **branch)
    assert rec.at_step[0][1] == pytest.approx([b * 0.5 for b in BASE], abs=1e-12)  # 1 - sqrt(1/4) on step 6


@pytest.mark.parametrize("form", ["callback", "scheduler"])
def test_decay_branch_warns_when_its_checkpoint_is_already_decayed(tmp_path, form, caplog):
    """apply_decay_branch warns when the source's LR is below the branch's first LR (the source was decaying and
    the branch raises the LR again); a stable-phase source is quiet."""
    from omegaconf import OmegaConf

    from lit_dtrain.schedules.workflows import apply_decay_branch

    kw = dict(total_steps=6, warmup_steps=1, decay_steps=3)
    paths = {}
    at = {"stable": 2, "decayed": 6}  # the source decays over steps 3..5
    for name, steps in at.items():
        module, callbacks = (Toy(), [WSDScheduler(**kw)]) if form == "callback" else (Toy(schedule=kw), [])
        trainer = fit(module, callbacks, max_steps=steps, root=tmp_path)
        paths[name] = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(paths[name])
    warnings = {}
    for name, path in paths.items():
        cfg = OmegaConf.create({
            "decay_branch": {"ckpt": str(path), "steps": 4}, "trainer": {"max_steps": 6},
            "paths": {"output_dir": str(tmp_path / f"branch_{name}"), "checkpoint_dir": str(tmp_path / "none")},
            "scheduler": {"_target_": "lit_dtrain.schedules.wsd_scheduler", **kw},
        })
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.schedules.workflows"):
            assert apply_decay_branch(cfg) == at[name]
        warnings[name] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings["stable"] == []
    assert len(warnings["decayed"]) == 1
    assert "is below its peak LR (in its warmup or decay): its LR for step 6 is [0, 0] (peak [0.1, 0.05]), below " \
           "the branch's first LR [0.05, 0.025]" in warnings["decayed"][0]


def test_decay_branch_from_inside_the_source_runs_longer_warmup_warns_as_a_warmup_too(tmp_path, caplog):
    """The branch refuses a checkpoint inside *its own* warmup; the checkpoint does not record the source run's. A
    source with a longer warmup (50 steps, branched at 30 with the branch's default warmup of 5) was accepted, and
    the jump-up warning called the checkpoint 'in its decay'."""
    from omegaconf import OmegaConf

    from lit_dtrain.schedules.workflows import apply_decay_branch

    source = dict(total_steps=10, warmup_steps=4, decay_steps=2)  # step 1: half way up
    trainer = fit(Toy(schedule=source), [], max_steps=1, root=tmp_path)
    path = tmp_path / "warmup.ckpt"
    trainer.save_checkpoint(path)
    cfg = OmegaConf.create({
        "decay_branch": {"ckpt": str(path), "steps": 16}, "trainer": {"max_steps": 17},
        "paths": {"output_dir": str(tmp_path / "branch"), "checkpoint_dir": str(tmp_path / "none")},
        "scheduler": {"_target_": "lit_dtrain.schedules.wsd_scheduler", "total_steps": 10, "warmup_steps": 1,
                      "decay_steps": 2},
    })
    with caplog.at_level("WARNING", logger="lit_dtrain.schedules.workflows"):
        assert apply_decay_branch(cfg) == 1
    [message] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "is below its peak LR (in its warmup or decay): its LR for step 1 is [0.05, 0.025]" in message
    assert "below the branch's first LR [0.075, 0.0375]" in message  # 1 - sqrt(1/16) of the peak
    assert "re-warmup" in message


def test_callback_resuming_a_scheduler_checkpoint_takes_the_peak_not_the_scheduled_lr(tmp_path):
    """A checkpoint written with the LambdaLR scheduler holds no WSDScheduler state, and its optimizer holds the
    scheduled (here: decayed) LR; the peak is the scheduler's ``initial_lr``. Switching to the callback form
    (extend, or a decay branch, from that checkpoint) must continue from the peak, not from the decayed LR."""
    kw = dict(total_steps=10, warmup_steps=2, decay_steps=4)
    trainer = fit(Toy(schedule=kw), [], max_steps=8, root=tmp_path)  # ends inside the decay: LR < peak
    ckpt = tmp_path / "sched.ckpt"
    trainer.save_checkpoint(ckpt)
    assert trainer.optimizers[0].param_groups[0]["lr"] < BASE[0]
    extend = dict(total_steps=20, warmup_steps=2, decay_steps=4)  # steps 8..15 are stable again
    rec = LRRecorder()
    fit(Toy(), [rec, WSDScheduler(**extend)], max_steps=12, ckpt_path=ckpt)
    assert rec.at_step == expected(range(8, 12), **extend) == [(s, list(BASE)) for s in range(8, 12)]


def test_callback_refuses_a_module_that_has_its_own_scheduler():
    kw = dict(total_steps=5, decay_steps=1)
    with pytest.raises(RuntimeError, match="also configures LR scheduler"):
        fit(Toy(schedule=kw), [WSDScheduler(**kw)], max_steps=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(total_steps=0, decay_steps=0), "total_steps"),
        (dict(total_steps=10, decay_steps=11), "warmup_steps \\+ decay_steps"),
        (dict(total_steps=10, warmup_steps=-1, decay_steps=1), "warmup_steps"),
        (dict(total_steps=10, decay_steps=2, min_lr_factor=2.0), "min_lr_factor"),
        (dict(total_steps=10, decay_steps=2, decay_type="step"), "decay_type"),
        (dict(total_steps=10), "^WSDScheduler: give the decay's length, decay_steps=<steps> or decay_fraction="),
    ],
)
def test_callback_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WSDScheduler(**kwargs)


def test_callback_takes_an_integral_float_and_refuses_a_fraction():
    """WSDScheduler(total_steps=1000.0) was refused as 'total_steps must be an integer'; a float that is exactly an
    integer is that integer, and the schedule is the same. A fraction, a bool, nan and inf stay refused, by name."""
    floats = WSDScheduler(total_steps=1000.0, warmup_steps=10.0, decay_steps=200.0)
    ints = WSDScheduler(total_steps=1000, warmup_steps=10, decay_steps=200)
    assert (floats.total_steps, floats.warmup_steps, floats.decay_steps) == (1000, 10, 200)
    assert all(isinstance(v, int) for v in (floats.total_steps, floats.warmup_steps, floats.decay_steps))
    assert [floats.lr_factor(s) for s in range(0, 1100, 7)] == [ints.lr_factor(s) for s in range(0, 1100, 7)]
    assert WSDScheduler(total_steps=1e3, decay_fraction=0.2).decay_steps == 200
    for bad in (1000.5, True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"^WSDScheduler: total_steps must be an integer, got {bad!r}$"):
            WSDScheduler(total_steps=bad, decay_fraction=0.2)
    with pytest.raises(ValueError, match=r"^WSDScheduler: warmup_steps must be an integer, got 2\.5$"):
        WSDScheduler(total_steps=10, warmup_steps=2.5, decay_steps=2)


def test_callback_state_roundtrip_and_missing_key():
    cb = WSDScheduler(total_steps=10, decay_steps=2)
    cb.base_lrs, cb.last_step = [[0.3, 0.1]], 4
    other = WSDScheduler(total_steps=20, decay_steps=4)
    other.load_state_dict(cb.state_dict())
    assert other.base_lrs == [[0.3, 0.1]] and other.last_step == 4
    assert other.total_steps == 20  # the constructor's schedule wins (extend / branch)
    with pytest.raises(KeyError, match="base_lrs"):
        other.load_state_dict({"last_step": 3})


def test_both_decay_arguments_name_the_arguments_and_the_config_check_names_the_keys(tmp_path):
    """``WSDScheduler(decay_steps=50, decay_fraction=0.2)`` in another Lightning project told its user to fix
    ``conf/callbacks/wsd.yaml`` (``callbacks.wsd.decay_fraction=null``), a file of lit_dtrain's, and with neither
    argument it advised setting ``decay_fraction=null``. The schedule's errors name its arguments; lit_dtrain's config
    check names the keys of the form in use (the scheduler's, or the callback's after '~scheduler')."""
    from lit_dtrain.config_checks import check_config
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.schedules import check_wsd_args
    from tests.conftest import compose_cfg

    for kw in (dict(decay_steps=50, decay_fraction=0.2), {}):
        with pytest.raises(ValueError, match=r"^WSDScheduler: give exactly one of decay_steps and decay_fraction, "
                                             r"got decay_steps=\w+, decay_fraction=[\w.]+$" if kw else
                           r"^WSDScheduler: give the decay's length, .* there is no default$"):
            WSDScheduler(total_steps=100, **kw)
        with pytest.raises(ValueError, match=r"^give exactly one of decay_steps and decay_fraction, got [^(]*$"):
            check_wsd_args(total_steps=100, **kw)
    for form, key in [([], "scheduler"), (["~scheduler", "callbacks=[default,wsd]"], "callbacks.wsd")]:
        cfg = compose_cfg([*form, f"{key}.decay_steps=3"], tmp_path / key, tiny=False)
        with pytest.raises(ConfigError, match=rf"^{key}.decay_steps=3 and {key}.decay_fraction=0.2 are both set .*"
                                              rf"{key}.decay_steps=3 {key}.decay_fraction=null$"):
            check_config(cfg)


def test_callback_and_scheduler_resolve_an_exact_half_decay_fraction_alike():
    """decay_fraction=0.35 of 90 steps is 31.5 exactly, 31.499999999999996 in floats: round() gave 31. The decimal
    value as written is rounded (half to even): 32 decay steps, in both forms."""
    kw = dict(total_steps=90, warmup_steps=3, decay_fraction=0.35, min_lr_factor=0.1)
    exact = dict(kw, decay_fraction=None, decay_steps=32)
    assert WSDScheduler(**kw).decay_steps == 32
    rec_sched, rec_cb = LRRecorder(), LRRecorder()
    fit(Toy(schedule=kw), [rec_sched], max_steps=90)
    fit(Toy(), [rec_cb, WSDScheduler(**kw)], max_steps=90)
    assert rec_cb.at_step == rec_sched.at_step == expected(range(90), **exact)
    assert [lrs for _, lrs in rec_sched.at_step[57:59]] == [list(BASE), [b * wsd_lr_factor(58, **exact) for b in BASE]]


@pytest.mark.parametrize("form", ["scheduler", "callback"])
def test_a_resume_whose_grown_default_warmup_lowers_the_lr_warns_with_both_lrs(tmp_path, form, caplog):
    """`trainer.max_steps=100` stopped at step 7 (default warmup 10: LR 0.8 of the peak for step 7), resumed with
    `resume=auto trainer.max_steps=500`: the default warmup became 50 and step 7 ran at 0.16 of the peak, 5x lower,
    without a word (only an LR jumping up warned). It warns now, naming both LRs and the key; a resume with the
    checkpoint's own schedule (inside its warmup, or its decay) does not."""
    from omegaconf import OmegaConf

    from lit_dtrain.schedules.workflows import warn_if_the_resume_moves_the_lr

    kw = dict(total_steps=20, warmup_steps=4, decay_steps=4)
    paths = {}
    for steps in (2, 18):  # inside the warmup (LR 3/4 of the peak for step 2), inside the decay
        module, callbacks = (Toy(), [WSDScheduler(**kw)]) if form == "callback" else (Toy(schedule=kw), [])
        trainer = fit(module, callbacks, max_steps=steps, root=tmp_path)
        paths[steps] = tmp_path / f"{steps}.ckpt"
        trainer.save_checkpoint(paths[steps])

    def warnings(steps: int, schedule: dict) -> list[str]:
        node = {"_target_": "lit_dtrain.schedules.wsd_scheduler", **schedule}
        cfg = OmegaConf.create({"trainer": {"max_steps": schedule["total_steps"]}, "scheduler": node})
        if form == "callback":
            node["_target_"] = "lit_dtrain.callbacks.WSDScheduler"
            cfg = OmegaConf.create({"trainer": cfg.trainer, "callbacks": {"wsd": node}})
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.schedules.workflows"):
            warn_if_the_resume_moves_the_lr(cfg, paths[steps], steps)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    assert warnings(2, kw) == warnings(18, kw) == []
    from lit_dtrain.config_resolvers import register

    register()  # the configs' derived default warmup, min(100, max(1, max_steps // 10)) = 10 for 100 steps
    [message] = warnings(2, dict(total_steps=100, warmup_steps="${lit.warmup:${trainer.max_steps}}", decay_steps=20))
    key = "scheduler" if form == "scheduler" else "callbacks.wsd"
    assert f"its LR for step 2 is [0.075, 0.0375] (peak [0.1, 0.05]), this run's is [0.03, 0.015]: " \
           f"{key}.warmup_steps=10 (the default min(100, max(1, max_steps // 10)), which follows trainer.max_steps) " \
           "lies past the step, so the resumed steps warm up again from a lower LR" in message
