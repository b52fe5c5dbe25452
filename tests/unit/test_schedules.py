"""LR schedules: exact factors at every phase boundary, LambdaLR adapters, resume/branch/extend, bad args."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_dtrain.schedules import (
    DECAY_TYPES,
    constant_lr_factor,
    constant_scheduler,
    cosine_lr_factor,
    cosine_scheduler,
    resolve_decay_steps,
    wsd_lr_factor,
    wsd_scheduler,
)

# total_steps=10, warmup_steps=2, decay_steps=4, min_lr_factor=0.1:
#   warmup 0..1, stable 2..5, decay 6..9 with p = 1/4, 2/4, 3/4, 1, after 10..
# Decay values computed by hand (m = 0.1):
#   linear      1 - p*0.9                  -> 0.775, 0.55, 0.325, 0.1
#   cosine      0.1 + 0.45*(1 + cos(pi p)) -> 0.1 + 0.45*1.70710678, 0.55, 0.1 + 0.45*0.29289322, 0.1
#   1-sqrt      0.1 + 0.9*(1 - sqrt(p))    -> 0.55, 0.1 + 0.9*0.29289322, 0.1 + 0.9*0.13397460, 0.1
#   exponential 0.1 ** p                   -> 0.56234133, 0.31622777, 0.17782794, 0.1
HAND = {
    "linear": [0.775, 0.55, 0.325, 0.1],
    "cosine": [0.86819805, 0.55, 0.23180195, 0.1],
    "1-sqrt": [0.55, 0.36360390, 0.22057714, 0.1],
    "exponential": [0.56234133, 0.31622777, 0.17782794, 0.1],
}
ARGS = dict(total_steps=10, warmup_steps=2, decay_steps=4, min_lr_factor=0.1)


@pytest.mark.parametrize("decay_type", DECAY_TYPES)
def test_wsd_exact_values_at_every_phase_boundary(decay_type):
    f = [wsd_lr_factor(s, decay_type=decay_type, **ARGS) for s in range(13)]
    assert f[0] == 0.5 and f[1] == 1.0  # warmup: (step + 1) / warmup_steps, ends at exactly 1
    assert f[2:6] == [1.0] * 4  # stable: first (2) and last (5) stable step
    assert f[6:10] == pytest.approx(HAND[decay_type], abs=1e-8)  # decay, first step p = 1/4
    assert f[9] == 0.1  # the last step reaches min_lr_factor exactly
    assert f[10:] == [0.1] * 3  # after the decay


@pytest.mark.parametrize("decay_type", DECAY_TYPES)
def test_wsd_min_lr_factor_reached_exactly_for_awkward_values(decay_type):
    for m in (0.1, 0.3, 1 / 3, 0.7, 0.01):
        assert wsd_lr_factor(99, total_steps=100, decay_steps=37, decay_type=decay_type, min_lr_factor=m) == m


def test_wsd_to_zero_and_degenerate_phases():
    # min_lr_factor 0 (the default), no warmup: step 0 is already stable
    assert wsd_lr_factor(0, total_steps=10, decay_steps=5) == 1.0
    assert wsd_lr_factor(9, total_steps=10, decay_steps=5) == 0.0
    assert wsd_lr_factor(5, total_steps=10, decay_steps=5, decay_type="linear") == pytest.approx(0.8)
    # no decay: stable through the last step, min_lr_factor after it
    seq = [wsd_lr_factor(s, total_steps=4, decay_steps=0, min_lr_factor=0.2) for s in range(6)]
    assert seq == [1, 1, 1, 1, 0.2, 0.2]
    # no stable phase: warmup then straight into the decay
    seq = [wsd_lr_factor(s, total_steps=4, warmup_steps=2, decay_steps=2, decay_type="linear") for s in range(4)]
    assert seq == pytest.approx([0.5, 1.0, 0.5, 0.0])
    # decay over the whole run: the first step is already p = 1/total
    assert wsd_lr_factor(0, total_steps=4, decay_steps=4, decay_type="linear") == pytest.approx(0.75)


def test_decay_fraction_rounds_like_python():
    assert resolve_decay_steps(10, decay_fraction=0.4) == 4
    assert resolve_decay_steps(5, decay_fraction=0.5) == 2  # round(2.5) == 2 (half to even)
    assert resolve_decay_steps(1000, decay_fraction=0.2) == 200
    assert resolve_decay_steps(7, decay_fraction=0.5) == 4  # round(3.5) == 4: rounds, does not truncate
    assert resolve_decay_steps(10, decay_fraction=0.37) == 4  # round(3.7) == 4
    assert resolve_decay_steps(10, decay_fraction=0.33) == 3  # round(3.3) == 3
    # the decimal value as written, exactly: 0.35 * 90 is 31.499999999999996 in floats (31), 31.5 exactly (32)
    assert resolve_decay_steps(90, decay_fraction=0.35) == 32
    assert resolve_decay_steps(150, decay_fraction=0.07) == 10  # 10.500000000000002 in floats (11), 10.5 exactly
    assert resolve_decay_steps(170, decay_fraction=0.35) == 60  # 59.49999999999999 in floats (59), 59.5 exactly
    a = [wsd_lr_factor(s, total_steps=10, warmup_steps=2, decay_fraction=0.4, min_lr_factor=0.1) for s in range(11)]
    b = [wsd_lr_factor(s, total_steps=10, warmup_steps=2, decay_steps=4, min_lr_factor=0.1) for s in range(11)]
    assert a == b


def test_a_decay_fraction_that_rounds_to_no_decay_steps_warns_once(caplog):
    """``trainer.max_steps=2`` with the default ``decay_fraction=0.2`` (round(0.4) = 0), or ``decay_fraction=0.01``
    of 40 steps: the schedule had no decay, its last step ran at the peak LR, not ``min_lr_factor``, and nothing said
    so. The WSD constructors warn now, naming both values and the rounding; a run that short (a smoke test) is not
    refused, and ``decay_fraction=0`` (no decay, as asked) does not warn."""
    from lit_dtrain.callbacks import WSDScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING", logger="lit_dtrain.schedules.lr"):
        sched = wsd_scheduler(opt, total_steps=2, decay_fraction=0.2, min_lr_factor=0.1)
        factors = [sched.lr_lambdas[0](s) for s in range(2)]
        WSDScheduler(total_steps=40, decay_fraction=0.01)
        wsd_scheduler(opt, total_steps=40, decay_fraction=0.0)
        wsd_scheduler(opt, total_steps=5, decay_fraction=0.2)  # 1 decay step
    assert factors == [1.0, 1.0]  # what the warning is about: no step at min_lr_factor
    assert [r.getMessage().split(":")[1] for r in caplog.records] == [
        " decay_fraction=0.2 of total_steps=2 rounds to 0 decay steps (round(0.4) = 0)",
        " decay_fraction=0.01 of total_steps=40 rounds to 0 decay steps (round(0.4) = 0)",
    ]


def test_cosine_exact_values():
    # total 10, warmup 2, m 0.1: the cosine decays over steps 2..9, p = (step - 1) / 8
    f = [cosine_lr_factor(s, total_steps=10, warmup_steps=2, min_lr_factor=0.1) for s in range(12)]
    assert f[:2] == [0.5, 1.0]
    assert f[2] == pytest.approx(0.1 + 0.45 * (1 + 0.92387953), abs=1e-8)  # cos(pi/8) = 0.92387953
    assert f[5] == pytest.approx(0.55, abs=1e-12)  # p = 1/2
    assert f[9] == 0.1 and f[10:] == [0.1, 0.1]
    # it is WSD with decay_steps = total - warmup and a cosine decay: one definition
    assert f == [wsd_lr_factor(s, decay_type="cosine", **{**ARGS, "decay_steps": 8}) for s in range(12)]
    assert cosine_lr_factor(0, total_steps=4) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))


def test_constant_exact_values():
    assert [constant_lr_factor(s, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert constant_lr_factor(0) == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(step=-1), "step"),
        (dict(step=1.5), "step"),
        (dict(total_steps=0), "total_steps"),
        (dict(total_steps=-5), "total_steps"),
        (dict(total_steps=10.5), "total_steps must be an integer, got 10.5"),
        (dict(total_steps=float("nan")), "total_steps must be an integer, got nan"),
        (dict(total_steps=float("inf")), "total_steps must be an integer, got inf"),
        (dict(total_steps=True), "total_steps must be an integer, got True"),
        (dict(total_steps="10"), "total_steps must be an integer, got '10'"),
        (dict(warmup_steps=1.5), "warmup_steps must be an integer, got 1.5"),
        (dict(decay_steps=2.5), "decay_steps must be an integer, got 2.5"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(decay_steps=-1), "decay_steps"),
        (dict(warmup_steps=7, decay_steps=4), "warmup_steps \\+ decay_steps"),
        (dict(decay_steps=11), "warmup_steps \\+ decay_steps"),
        (dict(min_lr_factor=-0.1), "min_lr_factor"),
        (dict(min_lr_factor=1.5), "min_lr_factor"),
        (dict(min_lr_factor=float("nan")), "min_lr_factor"),
        (dict(decay_type="sqrt"), "decay_type"),
        (dict(decay_type="exponential", min_lr_factor=0.0), "min_lr_factor"),
        (dict(decay_steps=None, decay_fraction=-0.1), "decay_fraction"),
        (dict(decay_steps=None, decay_fraction=1.5), "decay_fraction"),
        (dict(decay_fraction=0.2), "exactly one of decay_steps and decay_fraction"),
        (dict(decay_steps=None), "exactly one of decay_steps and decay_fraction"),
        (dict(decay_steps=None, decay_fraction=0.9, warmup_steps=2), "warmup_steps \\+ decay_steps"),
    ],
)
def test_wsd_invalid_arguments_raise_naming_the_argument(kwargs, match):
    args = dict(step=0, total_steps=10, warmup_steps=0, decay_steps=2, decay_type="1-sqrt", min_lr_factor=0.1)
    args.update(kwargs)
    step = args.pop("step")
    with pytest.raises(ValueError, match=match):
        wsd_lr_factor(step, **args)
    if kwargs.keys() != {"step"}:  # the adapter validates at construction, not at the first step
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        with pytest.raises(ValueError, match=match):
            wsd_scheduler(opt, **args)


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (cosine_lr_factor, dict(total_steps=0), "total_steps"),
        (cosine_lr_factor, dict(total_steps=5, warmup_steps=6), "warmup_steps"),
        (cosine_lr_factor, dict(total_steps=5, warmup_steps=-1), "warmup_steps"),
        (cosine_lr_factor, dict(total_steps=5, min_lr_factor=2.0), "min_lr_factor"),
        (constant_lr_factor, dict(warmup_steps=-3), "warmup_steps"),
    ],
)
def test_cosine_and_constant_invalid_arguments(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(0, **kwargs)
    with pytest.raises(ValueError, match="step must be >= 0"):
        fn(-1, **({"total_steps": 5} if fn is cosine_lr_factor else {}))


def test_integral_floats_are_integers():
    """total_steps=1000.0 (``1e3``, a horizon computed as ``0.5 * steps``) was refused as 'not an integer'; a float
    that is exactly an integer is that integer now, in every schedule and the adapters (fractions stay refused)."""
    wsd = dict(warmup_steps=10, decay_steps=200, min_lr_factor=0.1)
    steps = [0, 5, 10, 500, 799, 800, 900, 999, 1000, 1200]
    assert [wsd_lr_factor(s, total_steps=1000.0, **wsd) for s in steps] == [
        wsd_lr_factor(s, total_steps=1000, **wsd) for s in steps]
    as_floats = dict(warmup_steps=10.0, decay_steps=200.0, min_lr_factor=0.1)
    assert [wsd_lr_factor(float(s), total_steps=1e3, **as_floats) for s in steps] == [
        wsd_lr_factor(s, total_steps=1000, **wsd) for s in steps]
    assert resolve_decay_steps(1000.0, decay_fraction=0.2) == 200
    assert [cosine_lr_factor(s, total_steps=1000.0, warmup_steps=10.0) for s in steps] == [
        cosine_lr_factor(s, total_steps=1000, warmup_steps=10) for s in steps]
    assert [constant_lr_factor(s, warmup_steps=4.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    for make, extra in ((wsd_scheduler, dict(decay_fraction=0.2)), (cosine_scheduler, {})):
        a, b = _opt(2.0), _opt(2.0)
        floats = _lrs(make(a, total_steps=20.0, warmup_steps=2.0, **extra), a, 25)
        assert floats == _lrs(make(b, total_steps=20, warmup_steps=2, **extra), b, 25)


def _lrs(scheduler, optimizer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _opt(lr: float = 2.0):
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


@pytest.mark.parametrize("decay_type", DECAY_TYPES)
def test_scheduler_lr_is_base_times_factor_at_every_step(decay_type):
    opt = _opt(2.0)
    sched = wsd_scheduler(opt, decay_type=decay_type, **ARGS)
    assert _lrs(sched, opt, 12) == [2.0 * wsd_lr_factor(s, decay_type=decay_type, **ARGS) for s in range(12)]
    opt = _opt(2.0)
    sched = cosine_scheduler(opt, total_steps=10, warmup_steps=2)
    assert _lrs(sched, opt, 11) == [2.0 * cosine_lr_factor(s, total_steps=10, warmup_steps=2) for s in range(11)]
    opt = _opt(2.0)
    assert _lrs(constant_scheduler(opt, warmup_steps=2), opt, 3) == [1.0, 2.0, 2.0]


def test_schedulers_check_their_arguments_once_not_at_every_step(monkeypatch):
    """The WSD and cosine schedulers re-checked every argument at every step, for every param group (~40 us each,
    the default run's largest lit_dtrain cost outside the model and the gradient norm); the factors are the same."""
    import lit_dtrain.schedules.lr as lr

    checks = []
    real = lr.check_wsd_args
    monkeypatch.setattr(lr, "check_wsd_args", lambda **kw: checks.append(1) or real(**kw))
    for build in (lambda o: wsd_scheduler(o, **ARGS), lambda o: cosine_scheduler(o, total_steps=10, warmup_steps=2)):
        opt = _opt(2.0)
        sched = build(opt)
        built = len(checks)
        _lrs(sched, opt, 12)
        assert len(checks) == built


def _resume(sched_kwargs: dict, old_opt, old_sched):
    """A fresh optimizer + scheduler that load the old ones' state, in Lightning's order (optimizer first)."""
    opt = _opt(2.0)
    opt.load_state_dict(old_opt.state_dict())
    sched = wsd_scheduler(opt, **sched_kwargs)
    sched.load_state_dict(old_sched.state_dict())
    return opt, sched


@pytest.mark.parametrize("decay_type", DECAY_TYPES)
def test_resume_mid_decay_continues_the_same_sequence(decay_type):
    kw = dict(total_steps=20, warmup_steps=3, decay_steps=8, decay_type=decay_type, min_lr_factor=0.05)
    opt = _opt()
    straight = _lrs(wsd_scheduler(opt, **kw), opt, 20)
    opt = _opt()
    sched = wsd_scheduler(opt, **kw)
    first = _lrs(sched, opt, 15)  # steps 0..14; the decay runs over 12..19
    opt2, sched2 = _resume(kw, opt, sched)
    assert first + _lrs(sched2, opt2, 5) == straight


def test_branch_first_lr_is_the_first_decay_value():
    # a stable run planned for 100 steps (decay 20), checkpointed at step 40 ...
    opt = _opt(2.0)
    sched = wsd_scheduler(opt, total_steps=100, warmup_steps=5, decay_steps=20)
    assert _lrs(sched, opt, 40)[-1] == 2.0
    # ... branches into a 10-step decay: total 50, decay 10. Step 40 has p = 1/10.
    opt2, sched2 = _resume(dict(total_steps=50, warmup_steps=5, decay_steps=10), opt, sched)
    branch = _lrs(sched2, opt2, 11)
    assert branch[0] == pytest.approx(2.0 * (1 - 0.31622777), abs=1e-7)  # 1 - sqrt(1/10)
    assert branch[9] == 0.0 and branch[10] == 0.0  # step 49 is the last decay step
    assert sched2.last_epoch == 51


def test_extend_keeps_the_peak_without_rewarmup():
    opt = _opt(2.0)
    sched = wsd_scheduler(opt, total_steps=100, warmup_steps=10, decay_fraction=0.2)
    _lrs(sched, opt, 50)
    opt2, sched2 = _resume(dict(total_steps=400, warmup_steps=10, decay_fraction=0.2), opt, sched)
    assert _lrs(sched2, opt2, 300)[:1] == [2.0]  # step 50: still the peak, no warmup
    assert opt2.param_groups[0]["lr"] == 2.0 * wsd_lr_factor(350, total_steps=400, warmup_steps=10, decay_steps=80)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 400),
    warmup_share=st.floats(0, 1),
    decay_share=st.floats(0, 1),
    decay_type=st.sampled_from(DECAY_TYPES),
    m=st.floats(0, 1),
    data=st.data(),
)
def test_property_factor_within_bounds_and_monotone(total, warmup_share, decay_share, decay_type, m, data):
    warmup = int(warmup_share * total)
    decay = int(decay_share * (total - warmup))
    if decay_type == "exponential" and m == 0.0:
        m = 1e-3
    kw = dict(total_steps=total, warmup_steps=warmup, decay_steps=decay, decay_type=decay_type, min_lr_factor=m)
    step = data.draw(st.integers(0, total + 5))
    f = wsd_lr_factor(step, **kw)
    assert 0.0 < f <= 1.0 or (f == 0.0 and m == 0.0 and step >= total - decay)
    if step >= warmup:
        assert m <= f <= 1.0  # past the warmup the factor lies within [min_lr_factor, 1]
        assert wsd_lr_factor(step + 1, **kw) <= f  # and never increases
    else:
        assert f == (step + 1) / warmup
    if decay > 0:
        assert wsd_lr_factor(total - 1, **kw) == m
    assert wsd_lr_factor(total, **kw) == m
    c = cosine_lr_factor(step, total_steps=total, warmup_steps=warmup, min_lr_factor=m)
    assert (m <= c <= 1.0) if step >= warmup else c == (step + 1) / warmup


def test_the_config_check_leaves_the_no_decay_warning_to_the_runs_own_schedule(tmp_path, caplog):
    """``train.py trainer.max_steps=2``: train.log held the warning twice, once from the config check's build of
    the schedule on a dummy optimizer and once from the run's own; it is the run's only."""
    from hydra.utils import instantiate

    from lit_dtrain.config_checks import check_config
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["trainer.max_steps=2"], tmp_path)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING", logger="lit_dtrain.schedules.lr"):
        check_config(cfg)
        instantiate(cfg.scheduler)(opt)
    expected = "WSD: decay_fraction=0.2 of total_steps=2 rounds to 0 decay steps"
    assert [r.getMessage()[: len(expected)] for r in caplog.records] == [expected]


def test_a_warmup_and_decay_past_the_horizon_says_what_to_change():
    """`experiment=cpt_replay init_from=... trainer.max_steps=20` (a smoke test) stopped at 'warmup_steps + decay_steps
    must be <= total_steps, got warmup_steps=50 + decay_steps=4 > total_steps=20': the experiment's warmup, never
    typed, and no word of what to change. The error now names the fix."""
    with pytest.raises(ValueError) as refused:
        wsd_lr_factor(0, total_steps=20, warmup_steps=50, decay_steps=4, decay_type="1-sqrt", min_lr_factor=0.0)
    assert str(refused.value) == (
        "warmup_steps + decay_steps must be <= total_steps, got warmup_steps=50 + decay_steps=4 > total_steps=20: "
        "shorten warmup_steps or the decay (decay_steps, decay_fraction), or raise total_steps (in train.py "
        "scheduler.total_steps, by default trainer.max_steps)")


def test_a_cosine_warmup_past_the_horizon_says_what_to_change():
    """``experiment=cpt_replay scheduler=cosine '~scheduler.decay_fraction' trainer.max_steps=20`` stopped at
    'warmup_steps must be <= total_steps, got warmup_steps=50 > 20': the experiment's warmup, never typed, and no word
    of what to change, where WSD's error for the same run names the fix."""
    with pytest.raises(ValueError) as refused:
        cosine_lr_factor(0, total_steps=20, warmup_steps=50)
    assert str(refused.value) == (
        "warmup_steps must be <= total_steps, got warmup_steps=50 > total_steps=20: shorten warmup_steps or raise "
        "total_steps (in train.py scheduler.total_steps, by default trainer.max_steps)")


def test_a_cosine_that_is_all_warmup_warns(caplog):
    """``scheduler=cosine scheduler.warmup_steps=10 trainer.max_steps=10`` trained its 10 steps at 0.1 .. 1.0 of the
    peak, ending at the peak with no cosine at all, without a word (WSD warns where its decay rounds to none)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING", logger="lit_dtrain.schedules.lr"):
        sched = cosine_scheduler(opt, total_steps=4, warmup_steps=4, min_lr_factor=0.1)
        cosine_scheduler(opt, total_steps=5, warmup_steps=4)  # one decay step: quiet
        cosine_scheduler(opt, total_steps=4, warmup_steps=4, min_lr_factor=1.0)  # nothing to decay to: quiet
    assert [sched.lr_lambdas[0](s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [r.getMessage() for r in caplog.records] == [
        "cosine: warmup_steps=4 equals total_steps=4: the schedule is all warmup, its LR reaches the peak on the last "
        "step and never decays toward min_lr_factor=0.1; shorten warmup_steps (or raise total_steps) for a cosine "
        "decay"]
