"""A bad argument to a callback (or the statistics behind it) is a ValueError naming the class and the argument.

``RobustStat``'s errors other than ``decay`` named the argument only ('window must be >= 3, got 2'), and a value of
the wrong type failed inside the check with Python's own words: ``FourierSamplerCallback(log_every_n_steps="abc")``
was "invalid literal for int() with base 10: 'abc'", ``AdaptiveGradClip(z_threshold="abc")`` "'>' not supported
between instances of 'str' and 'int'" (what a Hydra override ``callbacks.x.y=abc`` gives), naming neither."""

from __future__ import annotations

import numbers
import re

import pytest

from lit_dtrain.callbacks._spike_stats import RobustStat, SpikeDetector, SpikeWindow
from lit_dtrain.callbacks.adaptive_grad_clip import AdaptiveGradClip
from lit_dtrain.callbacks.fourier_sampler import FourierSamplerCallback
from lit_dtrain.callbacks.loss_spike import LossSpikeMonitor
from lit_dtrain.callbacks.optimizer_diagnostics import OptimizerDiagnostics
from lit_dtrain.callbacks.preemption import PreemptionCheckpoint
from lit_dtrain.callbacks.selective_checkpointing import SelectiveCheckpointing
from lit_dtrain.callbacks.throughput import token_throughput_monitor

CASES = [
    (RobustStat, {"method": "mean"}, "method", r"one of \('ema', 'median'\), got 'mean'"),
    (RobustStat, {"window": 2}, "window", "an integer >= 3, got 2"),
    (RobustStat, {"window": "abc"}, "window", "an integer >= 3, got 'abc'"),
    (RobustStat, {"warmup": 1}, "warmup", "an integer >= 2, got 1"),
    (RobustStat, {"clip_z": 0}, "clip_z", "a finite number > 0 or None, got 0"),
    (RobustStat, {"clip_z": "abc"}, "clip_z", "a finite number > 0 or None, got 'abc'"),
    (RobustStat, {"min_rel_scale": -0.5}, "min_rel_scale", "a finite number >= 0, got -0.5"),
    (RobustStat, {"min_scale": -1.0}, "min_scale", "a finite number >= 0, got -1.0"),
    (RobustStat, {"decay": "abc"}, "decay", r"in \(0, 1\), got 'abc'"),
    (SpikeDetector, {"z_threshold": "abc"}, "z_threshold", "a finite number > 0 or None, got 'abc'"),
    (SpikeDetector, {"max_consecutive": 1}, "max_consecutive", "an integer >= 2 or None, got 1"),
    (SpikeDetector, {"warmup_steps": 1}, "warmup_steps", "an integer >= 2, got 1"),  # named RobustStat's ``warmup``
    (SpikeWindow, {"max_spikes": 0}, "max_spikes", "an integer >= 1, got 0"),
    (SpikeWindow, {"window_steps": "abc"}, "window_steps", "an integer >= 1, got 'abc'"),
    (FourierSamplerCallback, {"log_every_n_steps": "abc"}, "log_every_n_steps", "an integer >= 1 or None, got 'abc'"),
    (AdaptiveGradClip, {"z_threshold": "abc"}, "z_threshold", "a finite number > 0, got 'abc'"),
    (AdaptiveGradClip, {"max_norm": "abc"}, "max_norm", "a finite number > 0 or None, got 'abc'"),
    (AdaptiveGradClip, {"warmup_steps": "abc"}, "warmup_steps", "an integer >= 2, got 'abc'"),
    (AdaptiveGradClip, {"log_every_n_steps": "abc"}, "log_every_n_steps", "an integer >= 1 or None, got 'abc'"),
    # a fraction was cut to an integer: OptimizerDiagnostics(every_n_steps=2.5) logged every 2 steps, without a word
    (AdaptiveGradClip, {"warmup_steps": 2.5}, "warmup_steps", "an integer >= 2, got 2.5"),
    (AdaptiveGradClip, {"warmup_steps": 1}, "warmup_steps", "an integer >= 2, got 1"),
    (AdaptiveGradClip, {"log_every_n_steps": 1.5}, "log_every_n_steps", "an integer >= 1 or None, got 1.5"),
    (OptimizerDiagnostics, {"every_n_steps": 2.5}, "every_n_steps", "an integer >= 1, got 2.5"),
    # int(inf) raised OverflowError, naming neither the class nor the argument
    (OptimizerDiagnostics, {"every_n_steps": float("inf")}, "every_n_steps", "an integer >= 1, got inf"),
    (AdaptiveGradClip, {"log_every_n_steps": float("inf")}, "log_every_n_steps", "an integer >= 1 or None, got inf"),
    (LossSpikeMonitor, {"snapshot_every": "abc"}, "snapshot_every", "an integer >= 1, got 'abc'"),
    (LossSpikeMonitor, {"rollback_min_age": "abc"}, "rollback_min_age", "an integer >= 0, got 'abc'"),
    (LossSpikeMonitor, {"warmup_steps": "abc"}, "warmup_steps", "an integer >= 2, got 'abc'"),
    (LossSpikeMonitor, {"max_nonfinite": "abc"}, "max_nonfinite", "an integer >= 1 or None, got 'abc'"),
    (LossSpikeMonitor, {"cooldown_factor": "abc"}, "cooldown_factor", r"in \(0, 1\], got 'abc'"),
    (OptimizerDiagnostics, {"every_n_steps": "abc"}, "every_n_steps", "an integer >= 1, got 'abc'"),
    (SelectiveCheckpointing, {"policy": "some"}, "policy", "one of .*, got 'some'"),
    (SelectiveCheckpointing, {"policy": "every_k", "every_k": "abc"}, "every_k", "an integer >= 1, got 'abc'"),
    (SelectiveCheckpointing, {"policy": "budget", "memory_budget": "abc"}, "memory_budget", r"in \(0, 1\], got 'abc'"),
    (SelectiveCheckpointing, {"probe_batch_size": "abc"}, "probe_batch_size", "an integer >= 1, got 'abc'"),
    (SelectiveCheckpointing, {"probe_seq_len": "abc"}, "probe_seq_len", "an integer >= 1 or None, got 'abc'"),
    # a string was split into characters: "save_ops entry 'a' is not 'namespace.op[.overload]'"
    (SelectiveCheckpointing, {"save_ops": "aten.mm"}, "save_ops",
     r"a list of op names such as \[aten.mm, aten.bmm\] or None, got 'aten.mm'"),
    # callbacks.preemption.dirpath=null failed only when SIGTERM came (os.path.join(None, ...)), saving nothing
    (PreemptionCheckpoint, {"dirpath": None}, "dirpath", r"a directory path \(where SIGTERM saves\), got None"),
    (PreemptionCheckpoint, {"dirpath": ""}, "dirpath", r"a directory path \(where SIGTERM saves\), got ''"),
    (PreemptionCheckpoint, {"dirpath": "c", "filename": None}, "filename", "a file name such as 'last.ckpt', got None"),
    (PreemptionCheckpoint, {"dirpath": "c", "resume_hint": 3}, "resume_hint", "a string, got 3"),
    # Lightning's Throughput asserted window_size > 1 inside fit: a bare AssertionError
    (token_throughput_monitor, {"window_size": 1}, "window_size", r"an integer >= 2 \(steps averaged\), got 1"),
    (token_throughput_monitor, {"window_size": "abc"}, "window_size", r"an integer >= 2 \(steps averaged\), got 'abc'"),
]


@pytest.mark.parametrize(("cls", "kwargs", "name", "requirement"), CASES, ids=lambda c: getattr(c, "__name__", None))
def test_an_argument_error_names_the_class_and_the_argument(cls, kwargs, name, requirement):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {name} must be {requirement}$"):
        cls(**kwargs)


def test_the_values_the_checks_accept_are_unchanged():
    stat = RobustStat("median", window=3, warmup=2, clip_z=None, min_rel_scale=0.0, min_scale=0.0)
    assert (stat.method, stat.window, stat.warmup, stat.clip_z) == ("median", 3, 2, None)
    assert SpikeWindow(1, 1).window_steps == 1
    assert FourierSamplerCallback(log_every_n_steps=None).log_every_n_steps is None
    assert FourierSamplerCallback(log_every_n_steps=2).log_every_n_steps == 2
    assert AdaptiveGradClip(warmup_steps=2, max_norm=1.0, log_every_n_steps=1).max_norm == 1.0
    assert LossSpikeMonitor(cooldown_factor=1.0, rollback_min_age=0, max_nonfinite=None).max_nonfinite is None
    assert OptimizerDiagnostics(every_n_steps=1).every_n_steps == 1
    assert OptimizerDiagnostics(every_n_steps=2.0).every_n_steps == 2  # 2e0 from YAML: exactly 2
    assert AdaptiveGradClip(warmup_steps=3.0, log_every_n_steps=4.0).log_every_n_steps == 4
    assert SelectiveCheckpointing("budget", memory_budget=1.0, probe_seq_len=None).policy == "budget"


def test_numpy_numbers_are_taken_where_a_number_is_asked():
    """token_throughput_monitor(window_size=np.int64(50)), a value read from an array, was refused ('must be an
    integer >= 2 (steps averaged), got np.int64(50)'); the other callbacks took numpy numbers already, and still do."""
    import numpy as np

    monitor = token_throughput_monitor(window_size=np.int64(5))
    assert monitor.kwargs["window_size"] == 5 and type(monitor.kwargs["window_size"]) is int
    with pytest.raises(ValueError, match=r"window_size must be an integer >= 2 \(steps averaged\), got np.float64"):
        token_throughput_monitor(window_size=np.float64(5.5))
    assert token_throughput_monitor(window_size=np.float64(5)).kwargs["window_size"] == 5  # as every other count
    assert FourierSamplerCallback(log_every_n_steps=np.int64(2)).log_every_n_steps == 2
    assert AdaptiveGradClip(warmup_steps=np.int64(2), max_norm=np.float32(1.0)).max_norm == 1.0
    assert LossSpikeMonitor(snapshot_every=np.int64(10), cooldown_factor=np.float32(0.5)).cooldown[0] == 0.5
    assert OptimizerDiagnostics(every_n_steps=np.int64(3)).every_n_steps == 3
    assert SelectiveCheckpointing("every_k", every_k=np.int64(3)).every_k == 3


# every count argument: (callable, other arguments, name, least value, None allowed)
COUNTS = [
    (RobustStat, {}, "window", 3, False),
    (RobustStat, {}, "warmup", 2, False),
    (SpikeDetector, {}, "window", 3, False),
    (SpikeDetector, {}, "warmup_steps", 2, False),
    (SpikeDetector, {}, "max_consecutive", 2, True),
    (SpikeWindow, {}, "max_spikes", 1, False),
    (SpikeWindow, {}, "window_steps", 1, False),
    *((LossSpikeMonitor, {}, name, least, name in ("max_consecutive", "max_nonfinite")) for name, least in (
        ("window", 3), ("warmup_steps", 2), ("max_consecutive", 2), ("snapshot_every", 1), ("snapshot_keep", 1),
        ("rollback_min_age", 0), ("exclude_previous_steps", 0), ("cooldown_steps", 1), ("cooldown_ramp_steps", 0),
        ("raise_after", 1), ("raise_window", 1), ("max_nonfinite", 1))),
    (SelectiveCheckpointing, {"policy": "every_k"}, "every_k", 1, False),
    (SelectiveCheckpointing, {"policy": "full"}, "every_k", 1, False),  # kept under any policy
    (SelectiveCheckpointing, {}, "probe_batch_size", 1, False),
    (SelectiveCheckpointing, {}, "probe_seq_len", 1, True),
    (SelectiveCheckpointing, {}, "max_replans", 0, False),
    (FourierSamplerCallback, {}, "log_every_n_steps", 1, True),
    (AdaptiveGradClip, {}, "warmup_steps", 2, False),
    (AdaptiveGradClip, {}, "log_every_n_steps", 1, True),
    (OptimizerDiagnostics, {}, "every_n_steps", 1, False),
    (token_throughput_monitor, {}, "window_size", 2, False),
]


@pytest.mark.parametrize(("cls", "kwargs", "name", "least", "none_ok"), COUNTS,
                         ids=[f"{c[0].__name__}.{c[2]}" for c in COUNTS])
def test_a_count_is_a_whole_number_not_a_fraction_nor_a_flag(cls, kwargs, name, least, none_ok):
    """A fraction was cut to an integer without a word: ``SelectiveCheckpointing(policy="every_k", every_k=2.5)``
    checkpointed every 2nd block of 6 (3 of them), ``RobustStat(window=3.5)`` kept 3 values, ``LossSpikeMonitor(
    snapshot_every=2.5)`` snapshotted every 2 steps; ``True`` counted as 1 (``every_k=True`` checkpointed all 6
    blocks); ``inf`` was an ``OverflowError``. A whole float (``2.0``, YAML's ``2e0``) and numpy's integers are
    still taken, as that integer."""
    import numpy as np

    requirement = rf"an integer >= {least}{' or None' if none_ok else ''}( \(.*\))?"
    for bad in (least + 0.5, least - 1, True, np.True_, float("inf"), float("nan"), str(least + 3)):
        message = rf"^{cls.__name__}: {name} must be {requirement}, got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match=message):
            cls(**kwargs, **{name: bad})
    for good in (float(least + 3), np.int64(least + 3), least + 3):
        built = cls(**kwargs, **{name: good})
        value = built.kwargs[name] if name in getattr(built, "kwargs", {}) else getattr(built, name, None)
        if isinstance(value, numbers.Number):  # where the object keeps it under its name
            assert value == least + 3 and type(value) is int, (good, value)


def test_a_count_given_as_a_string_is_refused_as_in_a_config():
    """A count given as a string passed whole_at_least (int("10")) and was taken as its number in Python, while the
    same value in a config was refused ('callbacks.selective_ckpt.every_k must be an integer, got '3' (str)') and a
    number argument given as a string (``z_threshold="3.0"``) was refused in Python too: a count is refused now,
    naming the class, the argument and the value."""
    with pytest.raises(ValueError, match=r"^SelectiveCheckpointing: every_k must be an integer >= 1, got '3'$"):
        SelectiveCheckpointing("every_k", every_k="3")
    with pytest.raises(ValueError, match=r"^RobustStat: window must be an integer >= 3, got '10'$"):
        RobustStat("median", window="10", warmup=9)
    with pytest.raises(ValueError, match=r"^LossSpikeMonitor: window must be an integer >= 3, got '200'$"):
        LossSpikeMonitor(method="median", window="200")


def test_selective_checkpointings_every_k_and_memory_budget_are_checked_under_any_policy():
    """Both are kept whatever the policy (``int(every_k)``, ``float(memory_budget)``), but were checked only under
    their own: ``SelectiveCheckpointing(policy="full", every_k=None)`` was a bare ``TypeError: int() argument must be
    ... not 'NoneType'`` naming neither, and ``memory_budget=None`` the same from ``float()``."""
    with pytest.raises(ValueError, match=r"^SelectiveCheckpointing: every_k must be an integer >= 1, got None$"):
        SelectiveCheckpointing(policy="full", every_k=None)
    with pytest.raises(ValueError, match=r"^SelectiveCheckpointing: memory_budget must be in \(0, 1\], got None$"):
        SelectiveCheckpointing(policy="every_k", memory_budget=None)


@pytest.mark.parametrize(("cls", "name"), [(LossSpikeMonitor, "check_grad"),
                                           (FourierSamplerCallback, "apply_lr_multiplier")])
def test_a_flag_given_as_a_string_is_refused(cls, name):
    """In a project of one's own ``LossSpikeMonitor(check_grad="false")`` kept the grad check on and
    ``FourierSamplerCallback(apply_lr_multiplier="false")`` scaled the LR: a non-empty string is truthy. (train.py's
    type checks refused ``callbacks.loss_spike.check_grad=off`` already.) A flag is Python's or numpy's bool."""
    import numpy as np

    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {name} must be True or False, got 'false'$"):
        cls(**{name: "false"})
    assert getattr(cls(**{name: np.False_}), name) is False


FLAGS_AND_INFINITIES = [
    # True passed `v > 0` as 1: AdaptiveGradClip(z_threshold=True, max_norm=True) clipped at z 1 and at norm 1.0
    (AdaptiveGradClip, "z_threshold", True), (AdaptiveGradClip, "max_norm", True),
    (AdaptiveGradClip, "z_threshold", float("inf")), (LossSpikeMonitor, "z_threshold", True),
    (LossSpikeMonitor, "rel_threshold", float("inf")), (LossSpikeMonitor, "cooldown_factor", True),
    (RobustStat, "clip_z", True), (RobustStat, "min_scale", float("inf")),
    # float("0.5") and float(True) were taken: memory_budget="0.5", True (the whole budget)
    (SelectiveCheckpointing, "memory_budget", True), (SelectiveCheckpointing, "memory_budget", "0.5"),
    # float("abc") was "could not convert string to float"; True and inf were taken as FLOP/s
    (token_throughput_monitor, "available_flops", "abc"), (token_throughput_monitor, "available_flops", True),
    (token_throughput_monitor, "available_flops", float("inf")),
]


@pytest.mark.parametrize(("cls", "name", "value"), FLAGS_AND_INFINITIES,
                         ids=[f"{c.__name__}.{n}={v!r}" for c, n, v in FLAGS_AND_INFINITIES])
def test_a_real_number_argument_refuses_a_flag_a_string_and_inf(cls, name, value):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {name} must be .*, got {re.escape(repr(value))}$"):
        cls(**{name: value})


@pytest.mark.parametrize(("kwargs", "name"), [({"duration": 10}, "duration"), ({"verbose": "false"}, "verbose"),
                                              ({"interval": "steps"}, "interval")])
def test_step_end_timers_arguments_are_named(kwargs, name):
    """StepEndTimer(duration=10) (seconds) failed with "'int' object has no attribute 'total_seconds'" inside
    Lightning's Timer; verbose="false" was taken as true; interval="steps" was Lightning's error naming `Timer`."""
    from lit_dtrain.callbacks import StepEndTimer

    with pytest.raises(ValueError, match=rf"^StepEndTimer: {name} must be .*, got {re.escape(repr(kwargs[name]))}$"):
        StepEndTimer(**{"duration": "00:00:01:00", **kwargs})
    assert StepEndTimer(duration={"minutes": 1}, verbose=False)._duration == 60.0


def test_step_end_timers_duration_mapping_takes_numpy_integers_and_refuses_flags():
    """StepEndTimer(duration={'hours': np.int64(1)}) (a value read from an array) was refused, though the callbacks'
    count arguments take numpy integers and timedelta takes numpy floats; {'hours': True} was an hour, where
    trainer.max_time's {hours: true} is refused. Now an hour, and refused, as the shared checks do."""
    import numpy as np

    from lit_dtrain.callbacks import StepEndTimer

    assert StepEndTimer(duration={"hours": np.int64(1), "minutes": np.uint8(30)})._duration == 5400.0
    assert StepEndTimer(duration={"hours": np.float64(0.5)})._duration == 1800.0
    for flag in (True, np.True_):
        with pytest.raises(ValueError, match=r"^StepEndTimer: duration must be .*, got \{'hours': "):
            StepEndTimer(duration={"hours": flag})


@pytest.mark.parametrize("duration", [{"hours": -1}, {"minutes": 1, "seconds": -61}, "timedelta(seconds=-1)"])
def test_step_end_timer_refuses_a_negative_duration(duration):
    """StepEndTimer(duration={'hours': -1}) (or a negative timedelta) stopped the fit before its first step, without
    a word: a 5-step fit trained 0 steps. trainer.max_time refuses it, Lightning a negative 'DD:HH:MM:SS'; so does
    the timer now."""
    from datetime import timedelta

    from lit_dtrain.callbacks import StepEndTimer

    duration = timedelta(seconds=-1) if duration == "timedelta(seconds=-1)" else duration
    shown = re.escape(repr(duration))
    with pytest.raises(ValueError, match=rf"^StepEndTimer: duration must be a time >= 0, got {shown}$"):
        StepEndTimer(duration=duration)
    assert StepEndTimer(duration={"hours": 0})._duration == 0.0  # no time: a limit all the same


def test_step_end_timers_duration_from_a_config_is_taken():
    """A callback config's ``duration: {hours: ${h}}`` reached StepEndTimer as a DictConfig (Hydra's instantiate):
    Lightning's Timer takes a dict only and failed with "Missing key total_seconds"; ``{hour: 1}`` was timedelta's
    "'hour' is an invalid keyword argument for __new__()"."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.create({"h": 2, "timer": {"_target_": "lit_dtrain.callbacks.StepEndTimer",
                                               "duration": {"hours": "${h}", "minutes": 1}}})
    assert instantiate(node.timer)._duration == 7260.0
    with pytest.raises(Exception, match=r"StepEndTimer: duration must be .*, got \{'hour': 1\}"):
        instantiate({"_target_": "lit_dtrain.callbacks.StepEndTimer", "duration": {"hour": 1}})


@pytest.mark.parametrize(("cls", "name", "value"), [(LossSpikeMonitor, "path", 5), (LossSpikeMonitor, "path", 0),
                                                    (OptimizerDiagnostics, "prefix", 3),
                                                    (OptimizerDiagnostics, "prefix", "")])
def test_a_path_or_prefix_that_is_not_text_is_refused(cls, name, value):
    """LossSpikeMonitor(path=5) appended its events to file descriptor 5, path=0 (falsy) to the default file;
    OptimizerDiagnostics(prefix=3) logged '3/decay/grad_rms'."""
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {name} must be .*, got {value!r}$"):
        cls(**{name: value})
    assert LossSpikeMonitor(path="events.jsonl").path == "events.jsonl"


@pytest.mark.parametrize(("name", "value"), [("every_n_train_steps", 2.5), ("every_n_train_steps", "3"),
                                             ("every_n_epochs", True), ("save_top_k", "abc"), ("verbose", "false"),
                                             ("save_last", "yes")])
def test_model_checkpoints_counts_and_flags_are_checked(tmp_path, name, value):
    """Lightning's own checks let ModelCheckpoint(every_n_train_steps=2.5) save at steps 5 and 10 (global_step % 2.5)
    and every_n_epochs=True count as 1; save_top_k="abc" was "'<' not supported between instances of 'str' and
    'int'"; verbose="false" was true. The signature stays Lightning's (the config's argument check reads it)."""
    import inspect

    from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

    from lit_dtrain.callbacks import ModelCheckpoint

    with pytest.raises(ValueError, match=rf"^ModelCheckpoint: {name} must be .*, got {re.escape(repr(value))}$"):
        ModelCheckpoint(dirpath=tmp_path, **{name: value})
    assert inspect.signature(ModelCheckpoint) == inspect.signature(LightningModelCheckpoint)
    kept = ModelCheckpoint(tmp_path, None, None, False, "link", -1, every_n_train_steps=3)
    assert (kept.save_last, kept.save_top_k, kept._every_n_train_steps) == ("link", -1, 3)
