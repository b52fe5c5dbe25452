"""The argument checks of :class:`~lit_dtrain.data.samplers.fourier.FourierSampler`, run when it is built."""

from __future__ import annotations

import math

from lit_dtrain.callbacks._args import check_arg
from lit_dtrain.data.samplers import spectral
from lit_dtrain.utils.args import check_int, is_flag, is_number

SCORES = ("mixed", "time", "frequency")


def check_args(*, max_freq, num_bands, score, mix_initial, mix_final, decay_steps, momentum, beta, variant, min_prob,
               max_prob, magnitude_cap, eps, prior, uniform_floor, importance_weights, stages, step_unit, stage_bands,
               stage_mix, stage_lr, async_op, require_updates, lag) -> tuple[int | None, int | None]:
    """Raise ``ValueError`` naming the first bad argument; returns ``(max_freq, num_bands)`` as integers (None: auto,
    the brief's default for the sequence length)."""
    # True passed the range checks as 1.0, "0.5" failed in a bare comparison; bool("false") kept stages on
    for name, value in {"mix_initial": mix_initial, "mix_final": mix_final, "decay_steps": decay_steps,
                        "momentum": momentum, "beta": beta, "min_prob": min_prob, "max_prob": max_prob,
                        "magnitude_cap": magnitude_cap, "eps": eps, "prior": prior, "uniform_floor": uniform_floor,
                        "step_unit": step_unit}.items():
        check_arg("FourierSampler", name, value, is_number, "a number")
    for name, value in {"importance_weights": importance_weights, "stages": stages, "stage_bands": stage_bands,
                        "stage_mix": stage_mix, "stage_lr": stage_lr, "async_op": async_op,
                        "require_updates": require_updates}.items():
        check_arg("FourierSampler", name, value, is_flag, "True or False")
    if score not in SCORES:
        raise ValueError(f"FourierSampler score must be one of {SCORES}, got {score!r}")
    if variant not in spectral.VARIANTS:
        raise ValueError(f"FourierSampler variant must be one of {spectral.VARIANTS}, got {variant!r}")
    for name, value in {"momentum": momentum, "beta": beta}.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"FourierSampler {name} must be in [0, 1), got {value}")
    if not 0.0 < min_prob <= max_prob:
        raise ValueError(f"FourierSampler needs 0 < min_prob <= max_prob, got {min_prob}, {max_prob}")
    if not magnitude_cap >= min_prob:  # else clamp(min_prob, cap) returns cap: zero or negative weights
        raise ValueError(f"FourierSampler needs magnitude_cap >= min_prob, got {magnitude_cap}, {min_prob}")
    if is_flag(lag) or lag not in (0, 1):  # True == 1: lag=True was taken as a lag of one step
        raise ValueError(f"FourierSampler lag must be 0 or 1 (steps between an update and the draws it "
                         f"reaches), got {lag!r}")
    if not prior > 0:
        raise ValueError(f"FourierSampler prior must be > 0, got {prior}")
    if not eps > 0:  # eps=0: a sample whose score was 0 gets 0/0, a NaN probability
        raise ValueError(f"FourierSampler eps must be > 0, got {eps}")
    for name, value in {"prior": prior, "eps": eps, "min_prob": min_prob}.items():
        if not math.isfinite(value):  # prior=inf: an infinite total, NaN probabilities and a NaN CDF
            raise ValueError(f"FourierSampler {name} must be a finite number, got {value}")
    for name, value in {"mix_initial": mix_initial, "mix_final": mix_final}.items():
        if not 0.0 <= value <= 1.0:  # as a stage_table row's mix: the weight of the frequency score
            raise ValueError(f"FourierSampler {name} must be in [0, 1], got {value}")
    if not 0.0 <= uniform_floor <= 1.0:
        raise ValueError(f"FourierSampler uniform_floor must be in [0, 1], got {uniform_floor}")
    if not step_unit > 0 or not decay_steps > 0:
        raise ValueError(f"FourierSampler step_unit and decay_steps must be > 0, got {step_unit}, {decay_steps}")
    if not math.isfinite(step_unit):  # inf kept every run in the warmup stage (its LR multiplier) for good
        raise ValueError(f"FourierSampler step_unit must be finite (stages=false turns the schedule off), "
                         f"got {step_unit}")
    bands = {"max_freq": max_freq, "num_bands": num_bands}
    for name, value in bands.items():  # None (not 0) picks the brief's default for T; 2.5 is not truncated to 2
        try:
            bands[name] = None if value is None else check_int(name, value, minimum=1)
        except ValueError:
            raise ValueError(f"FourierSampler {name} must be a positive integer or null (auto), "
                             f"got {value!r}") from None
    return bands["max_freq"], bands["num_bands"]
