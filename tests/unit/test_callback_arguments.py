"""A bad argument to a callback (or the statistics behind it) is a ValueError naming the class and the argument.

``RobustStat``'s errors other than ``decay`` named the argument only ('window must be >= 3, got 2'), and a value of
the wrong type failed inside the check with Python's own words: ``FourierSamplerCallback(log_every_n_steps="abc")``
was "invalid literal for int() with base 10: 'abc'", ``AdaptiveGradClip(z_threshold="abc")`` "'>' not supported
between instances of 'str' and 'int'" (what a Hydra override ``callbacks.x.y=abc`` gives), naming neither."""

from __future__ import annotations

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
    (RobustStat, {"window": 2}, "window", ">= 3, got 2"),
    (RobustStat, {"window": "abc"}, "window", ">= 3, got 'abc'"),
    (RobustStat, {"warmup": 1}, "warmup", ">= 2, got 1"),
    (RobustStat, {"clip_z": 0}, "clip_z", "> 0 or None, got 0"),
    (RobustStat, {"clip_z": "abc"}, "clip_z", "> 0 or None, got 'abc'"),
    (RobustStat, {"min_rel_scale": -0.5}, "min_rel_scale", ">= 0, got -0.5"),
    (RobustStat, {"min_scale": -1.0}, "min_scale", ">= 0, got -1.0"),
    (RobustStat, {"decay": "abc"}, "decay", r"in \(0, 1\), got 'abc'"),
    (SpikeDetector, {"z_threshold": "abc"}, "z_threshold", "> 0 or None, got 'abc'"),
    (SpikeDetector, {"max_consecutive": 1}, "max_consecutive", ">= 2 or None, got 1"),
    (SpikeDetector, {"warmup_steps": 1}, "warmup_steps", ">= 2, got 1"),  # named RobustStat's ``warmup``
    (SpikeWindow, {"max_spikes": 0}, "max_spikes", ">= 1, got 0"),
    (SpikeWindow, {"window_steps": "abc"}, "window_steps", ">= 1, got 'abc'"),
    (FourierSamplerCallback, {"log_every_n_steps": "abc"}, "log_every_n_steps", "positive, got 'abc'"),
    (AdaptiveGradClip, {"z_threshold": "abc"}, "z_threshold", "> 0, got 'abc'"),
    (AdaptiveGradClip, {"max_norm": "abc"}, "max_norm", "> 0 or None, got 'abc'"),
    (AdaptiveGradClip, {"warmup_steps": "abc"}, "warmup_steps", "an integer >= 2, got 'abc'"),
    (AdaptiveGradClip, {"log_every_n_steps": "abc"}, "log_every_n_steps", "an integer >= 1 or None, got 'abc'"),
    # a fraction was cut to an integer: OptimizerDiagnostics(every_n_steps=2.5) logged every 2 steps, without a word
    (AdaptiveGradClip, {"warmup_steps": 2.5}, "warmup_steps", "an integer >= 2, got 2.5"),
    (AdaptiveGradClip, {"log_every_n_steps": 1.5}, "log_every_n_steps", "an integer >= 1 or None, got 1.5"),
    (OptimizerDiagnostics, {"every_n_steps": 2.5}, "every_n_steps", "an integer >= 1, got 2.5"),
    # int(inf) raised OverflowError, naming neither the class nor the argument
    (OptimizerDiagnostics, {"every_n_steps": float("inf")}, "every_n_steps", "an integer >= 1, got inf"),
    (AdaptiveGradClip, {"log_every_n_steps": float("inf")}, "log_every_n_steps", "an integer >= 1 or None, got inf"),
    (LossSpikeMonitor, {"snapshot_every": "abc"}, "snapshot_every", ">= 1, got 'abc'"),
    (LossSpikeMonitor, {"rollback_min_age": "abc"}, "rollback_min_age", ">= 0, got 'abc'"),
    (LossSpikeMonitor, {"warmup_steps": "abc"}, "warmup_steps", ">= 2, got 'abc'"),
    (LossSpikeMonitor, {"max_nonfinite": "abc"}, "max_nonfinite", ">= 1 or None, got 'abc'"),
    (LossSpikeMonitor, {"cooldown_factor": "abc"}, "cooldown_factor", r"in \(0, 1\], got 'abc'"),
    (OptimizerDiagnostics, {"every_n_steps": "abc"}, "every_n_steps", "an integer >= 1, got 'abc'"),
    (SelectiveCheckpointing, {"policy": "some"}, "policy", "one of .*, got 'some'"),
    (SelectiveCheckpointing, {"policy": "every_k", "every_k": "abc"}, "every_k", ">= 1, got 'abc'"),
    (SelectiveCheckpointing, {"policy": "budget", "memory_budget": "abc"}, "memory_budget", r"in \(0, 1\], got 'abc'"),
    (SelectiveCheckpointing, {"probe_batch_size": "abc"}, "probe_batch_size", ">= 1, got 'abc'"),
    (SelectiveCheckpointing, {"probe_seq_len": "abc"}, "probe_seq_len", ">= 1 or None, got 'abc'"),
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
    assert SelectiveCheckpointing("every_k", every_k="3").every_k == 3  # int() of a string was accepted and still is


def test_numpy_numbers_are_taken_where_a_number_is_asked():
    """token_throughput_monitor(window_size=np.int64(50)), a value read from an array, was refused ('must be an
    integer >= 2 (steps averaged), got np.int64(50)'); the other callbacks took numpy numbers already, and still do."""
    import numpy as np

    monitor = token_throughput_monitor(window_size=np.int64(5))
    assert monitor.kwargs["window_size"] == 5 and type(monitor.kwargs["window_size"]) is int
    with pytest.raises(ValueError, match=r"window_size must be an integer >= 2 \(steps averaged\), got np.float64"):
        token_throughput_monitor(window_size=np.float64(5))
    assert FourierSamplerCallback(log_every_n_steps=np.int64(2)).log_every_n_steps == 2
    assert AdaptiveGradClip(warmup_steps=np.int64(2), max_norm=np.float32(1.0)).max_norm == 1.0
    assert LossSpikeMonitor(snapshot_every=np.int64(10), cooldown_factor=np.float32(0.5)).cooldown[0] == 0.5
    assert OptimizerDiagnostics(every_n_steps=np.int64(3)).every_n_steps == 3
    assert SelectiveCheckpointing("every_k", every_k=np.int64(3)).every_k == 3
