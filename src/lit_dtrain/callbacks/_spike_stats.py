"""Pure statistics behind loss-spike detection and adaptive gradient clipping (no torch, no Lightning).

Everything here works on Python floats, so it is testable on synthetic sequences and, under DDP, gives
bit-identical decisions on every rank as long as every rank feeds it the same (all-reduced) values.

- :class:`RobustStat`: a running location/scale of a scalar series, either an exponential moving average
  and an EMA of squared one-step forecast errors (as in ZClip and OLMo's grad-norm clipping, made robust to
  the falling trend of a loss curve), or median and MAD of first differences over a window. Values are only
  added when they were not a spike, and (EMA) clipped to ``location + clip_z * scale`` first, so one
  outlier that slips under the threshold cannot inflate the scale much.
- :class:`SpikeDetector`: the decision for one optimizer step from the loss (and optionally grad norm).
- :class:`SpikeWindow`: "M spikes within W steps" for the ``raise`` action.
- :func:`cooldown_factor`: the LR multiplier of the ``lr_cooldown`` action.

Checked first: Lightning's ``SpikeDetection`` keeps a running mean with an rtol/atol test and no scale
estimate, so it has no z-score, no warmup of the scale and no grad-norm test; torchmetrics has no EMA
variance. Hence this small hand-written module.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from lit_dtrain.callbacks._args import check_arg, finite_number, whole_at_least

METHODS = ("ema", "median")
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
LOSS_SPIKE = "loss"
GRAD_SPIKE = "grad_norm"

_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation


class RobustStat:
    """Running location and scale of a scalar series with a warmup, robust to a trending series.

    A training loss falls steadily, so the plain variance of recent values mostly measures the trend. Both
    methods therefore take the scale from one-step changes, not from the spread around the location:

    - ``"ema"``: location = EMA of the values (``decay``); scale = sqrt of an EMA (``scale_decay``) of the
      squared one-step forecast errors ``x - location_before``, the error of predicting the next value by
      the current location (Holt-style; a lag of ``decay/(1-decay)`` steps behind the trend adds little);
    - ``"median"``: location = median of the last ``max(3, window // 10)`` values; scale =
      ``1.4826 * median(|x_t - x_(t-1)|) / sqrt(2)`` over ``window`` values (MAD of first differences).

    Args:
        method: ``"ema"`` or ``"median"``.
        decay: EMA decay of the location (``"ema"``); early values are averaged equally until ``1/(1-decay)``.
        scale_decay: EMA decay of the squared forecast errors (``"ema"``; None: ``decay``).
        window: values kept (``"median"``).
        warmup: values needed before :attr:`ready` (before that, nothing can be a spike).
        clip_z: (``"ema"``) values are clipped to ``location + clip_z * scale`` before they are added once
            ready, so one outlier under the detection threshold cannot inflate the scale; None: off. During
            the warmup nothing can be clipped yet, so when the warmup ends its values are despiked (a value
            more than ``clip_z`` robust noise scales above the median of its 10 neighbours is replaced by that
            median) and the EMA is recomputed from them: a spike inside the warmup would otherwise inflate
            the scale for hundreds of steps.
        min_rel_scale: the scale is at least this fraction of ``|location|`` (a plateau never gives z = inf).
        min_scale: an absolute lower bound of the scale.
        owner: the name bad arguments are reported under (the callback the user configured, not this class).
        warmup_name: the name ``warmup`` has where the user gave it (``warmup_steps`` in the callbacks).
    """

    def __init__(
        self,
        method: str = "ema",
        decay: float = 0.9,
        scale_decay: float | None = 0.98,
        window: int = 200,
        warmup: int = 50,
        clip_z: float | None = 3.0,
        min_rel_scale: float = 0.01,
        min_scale: float = 1e-8,
        *,
        owner: str = "RobustStat",
        warmup_name: str = "warmup",
    ) -> None:
        check_arg(owner, "method", method, lambda v: v in METHODS, f"one of {METHODS}")
        scale_decay = decay if scale_decay is None else scale_decay
        for name, value in (("decay", decay), ("scale_decay", scale_decay)):
            check_arg(owner, name, value, lambda v: 0.0 < v < 1.0, "in (0, 1)")
        check_arg(owner, "window", window, whole_at_least(3), "an integer >= 3")
        check_arg(owner, warmup_name, warmup, whole_at_least(2), "an integer >= 2")
        if method == "median" and int(warmup) > int(window):  # as numbers: a whole float (2.0) is taken
            raise ValueError(f"{owner}: {warmup_name} ({warmup}) must be <= window ({window}) for method='median'")
        check_arg(owner, "clip_z", clip_z, finite_number(lambda v: v > 0, none_ok=True), "a finite number > 0 or None")
        for name, value in (("min_rel_scale", min_rel_scale), ("min_scale", min_scale)):
            check_arg(owner, name, value, finite_number(lambda v: v >= 0), "a finite number >= 0")
        self.method, self.decay, self.scale_decay = method, float(decay), float(scale_decay)
        self.window, self.warmup = int(window), int(warmup)
        self.clip_z, self.min_rel_scale, self.min_scale = clip_z, float(min_rel_scale), float(min_scale)
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self.values: deque[float] = deque(maxlen=self.window)
        self.warm: list[float] = []  # ("ema") the warmup's values, despiked when the warmup ends

    @property
    def ready(self) -> bool:
        """True once ``warmup`` values have been added."""
        return self.count >= self.warmup

    def location(self) -> float:
        """The EMA or the median of the most recent values."""
        if self.method == "median":
            recent = list(self.values)[-max(3, self.window // 10):]
            return _median(recent) if recent else 0.0
        return self.mean

    def raw_scale(self) -> float:
        """The scale estimate before the floors."""
        if self.method == "median":
            v = list(self.values)
            diffs = [abs(b - a) for a, b in zip(v[:-1], v[1:])]
            return _MAD_TO_STD * _median(diffs) / math.sqrt(2.0) if diffs else 0.0
        return math.sqrt(max(self.var, 0.0))

    def scale(self) -> float:
        """The scale, floored by ``min_rel_scale * |location|`` and ``min_scale``."""
        return max(self.raw_scale(), self.min_rel_scale * abs(self.location()), self.min_scale)

    def zscore(self, x: float) -> float:
        """``(x - location) / scale``; +inf for a non-finite ``x``."""
        if not math.isfinite(x):
            return math.inf
        return (x - self.location()) / self.scale()

    def add(self, x: float) -> None:
        """Add a (finite, non-spike) value."""
        if not math.isfinite(x):
            raise ValueError(f"RobustStat.add got a non-finite value {x}")
        if self.ready and self.clip_z is not None and self.method == "ema":
            x = min(x, self.location() + self.clip_z * self.scale())
        self.count += 1
        if self.method == "median":
            self.values.append(float(x))
            return
        self._ema_update(float(x), self.count)
        # the first max(warmup, DESPIKE_MIN) values since the start (none after a reseed), despiked at the warmup's
        # end and, for a shorter warmup, again at DESPIKE_MIN values, the fewest that tell one spike from noise
        span = max(self.warmup, DESPIKE_MIN)
        if self.count <= span and len(self.warm) == self.count - 1:
            self.warm.append(float(x))
            if self.count in (self.warmup, span):
                self._end_warmup(final=self.count == span)

    def _ema_update(self, x: float, count: int) -> None:
        if count == 1:
            self.mean, self.var = x, 0.0
            return
        # equal weights while count is small, then the EMA; the error is measured before the update
        error = x - self.mean
        alpha = max(1.0 - self.decay, 1.0 / count)
        alpha_scale = max(1.0 - self.scale_decay, 1.0 / (count - 1))
        self.mean += alpha * error
        self.var += alpha_scale * (error * error - self.var)

    def _end_warmup(self, final: bool = True) -> None:
        """Recompute the EMA from the despiked warmup values (see ``clip_z``); a no-op when none is a spike. Not
        ``final`` (a warmup shorter than :data:`DESPIKE_MIN`): the values are kept for the despiking at that many."""
        warm = self.warm
        if final:
            self.warm = []
        if self.clip_z is None:
            return
        cleaned = despike(warm, self.clip_z)
        if cleaned != warm:
            for i, v in enumerate(cleaned, start=1):
                self._ema_update(v, i)

    def reseed(self, values: list[float]) -> None:
        """Restart the statistics from ``values`` (a new level), immediately :attr:`ready`."""
        self.count, self.mean, self.var = 0, 0.0, 0.0
        self.values.clear()
        clip_z, self.clip_z = self.clip_z, None
        for v in values:
            self.add(v)
        self.clip_z = clip_z
        self.count = max(self.count, self.warmup)
        self.warm = []

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var, "values": list(self.values),
                "warm": list(self.warm)}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.var = int(state["count"]), float(state["mean"]), float(state["var"])
        self.values = deque((float(v) for v in state["values"]), maxlen=self.window)
        self.warm = [float(v) for v in state.get("warm", [])]  # absent in checkpoints before it existed


# the fewest values whose despiking finds one spike among them: a spike makes two large one-step differences, and
# the noise scale (the median of the differences) stays that of the noise only while most of them are small
DESPIKE_MIN = 6


def despike(values: list[float], z: float, half_width: int = 5) -> list[float]:
    """``values`` with every upward outlier replaced by the median of its ``2 * half_width`` neighbours.

    An outlier lies more than ``z`` noise scales above that median; the noise scale is the MAD of first
    differences (robust to the series' trend and to a few spikes). A series with no outlier comes back equal.
    """
    if len(values) < 3:
        return list(values)
    diffs = [abs(b - a) for a, b in zip(values[:-1], values[1:])]
    scale = _MAD_TO_STD * _median(diffs) / math.sqrt(2.0)
    out = list(values)
    for i, x in enumerate(values):
        med = _median(values[max(0, i - half_width) : i] + values[i + 1 : i + 1 + half_width])
        if x - med > z * scale:
            out[i] = med
    return out


def relative_rise(x: float, location: float) -> float:
    """``(x - location) / |location|``: ``x / location - 1`` for a positive location, and for a negative one (a loss
    that can be negative: a Gaussian NLL, an ELBO) still positive when ``x`` rose (it was 0 for every location <= 0, so
    with ``rel_threshold`` set no loss spike could be found: a 300x rise at location -1.9 was trained on)."""
    if not math.isfinite(x):
        return math.inf
    if location != 0:
        return (x - location) / abs(location)
    return math.copysign(math.inf, x) if x != 0 else 0.0


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass
class SpikeDecision:
    """The outcome for one step: ``reasons`` is empty when the step is normal."""

    loss: float
    loss_z: float
    loss_rel: float
    grad_norm: float | None = None
    grad_z: float | None = None
    reasons: list[str] = field(default_factory=list)
    level_shift: bool = False  # this step ended a run of max_consecutive loss spikes: accepted as the new level
    grad_level_shift: bool = False  # ... of max_consecutive grad-norm spikes: the grad norm's new level is accepted

    @property
    def is_spike(self) -> bool:
        return bool(self.reasons)


class SpikeDetector:
    """Decides per step whether the loss (or grad norm) spiked; updates its statistics only on normal steps.

    A step is a spike when:

    - the loss or the grad norm is non-finite (always, even during warmup);
    - the loss statistics are ready and the loss exceeds the thresholds that are set: ``z_threshold``
      (z-score against the running location/scale) and ``rel_threshold`` (``(loss - location) / |location|``); when both
      are set both must hold, so a statistically unusual but tiny rise is not a spike;
    - ``grad_z_threshold`` is set, the grad-norm statistics are ready and the grad norm's z-score exceeds it.

    Lower-than-usual values are never spikes. After ``max_consecutive`` loss spikes in a row the raised
    level is taken to be real (a data-mixture change, or damage that skipping cannot undo): that step is
    not a spike, the loss statistics restart from the run's values, and :attr:`SpikeDecision.level_shift`
    is set. Without this, ``skip`` would drop every later step of a run whose loss level moved for good.
    Grad-norm spikes likewise (:attr:`SpikeDecision.grad_level_shift`): a grad norm that rose for good (an LR
    or batch change) was otherwise a spike at every later step. A non-finite step inside such a run neither counts
    toward it nor ends it: it says nothing about the level (ending the run there, a level whose steps turn NaN now
    and then was never accepted).
    """

    def __init__(
        self,
        z_threshold: float | None = 6.0,
        rel_threshold: float | None = 0.2,
        grad_z_threshold: float | None = None,
        method: str = "ema",
        decay: float = 0.9,
        scale_decay: float | None = 0.98,
        window: int = 200,
        warmup_steps: int = 50,
        clip_z: float | None = 3.0,
        min_rel_scale: float = 0.01,
        max_consecutive: int | None = 10,
        *,
        owner: str = "SpikeDetector",
    ) -> None:
        if z_threshold is None and rel_threshold is None:
            raise ValueError(f"{owner}: set at least one of z_threshold and rel_threshold")
        for name, value in (("z_threshold", z_threshold), ("rel_threshold", rel_threshold),
                            ("grad_z_threshold", grad_z_threshold)):
            check_arg(owner, name, value, finite_number(lambda v: v > 0, none_ok=True), "a finite number > 0 or None")
        check_arg(owner, "max_consecutive", max_consecutive, whole_at_least(2, none_ok=True),
                  "an integer >= 2 or None")
        self.z_threshold, self.rel_threshold, self.grad_z_threshold = z_threshold, rel_threshold, grad_z_threshold
        self.max_consecutive = None if max_consecutive is None else int(max_consecutive)
        self.consecutive: list[float] = []  # losses of the current run of consecutive loss spikes
        self.grad_consecutive: list[float] = []  # grad norms of the current run of consecutive grad-norm spikes
        kwargs = dict(method=method, decay=decay, scale_decay=scale_decay, window=window, warmup=warmup_steps,
                      clip_z=clip_z, owner=owner, warmup_name="warmup_steps")
        self.loss_stat = RobustStat(min_rel_scale=min_rel_scale, **kwargs)
        self.grad_stat = RobustStat(min_rel_scale=min_rel_scale, **kwargs)

    def decide(self, loss: float, grad_norm: float | None = None, *, update: bool = True) -> SpikeDecision:
        """The decision for this step; with ``update`` the statistics absorb the values of a normal step."""
        loss = float(loss)
        loss_z = self.loss_stat.zscore(loss)
        loc = self.loss_stat.location()
        loss_rel = relative_rise(loss, loc)
        d = SpikeDecision(loss=loss, loss_z=loss_z, loss_rel=loss_rel, grad_norm=grad_norm)
        if not math.isfinite(loss):
            d.reasons.append(NONFINITE_LOSS)
        if grad_norm is not None and not math.isfinite(grad_norm):
            d.reasons.append(NONFINITE_GRAD)
        if math.isfinite(loss) and self.loss_stat.ready:
            z_hit = self.z_threshold is None or loss_z > self.z_threshold
            rel_hit = self.rel_threshold is None or loss_rel > self.rel_threshold
            if z_hit and rel_hit:
                d.reasons.append(LOSS_SPIKE)
        if update and LOSS_SPIKE in d.reasons:
            d.level_shift = self._accept_level(d, LOSS_SPIKE, self.consecutive, self.loss_stat, loss)
        elif update and math.isfinite(loss):
            self.consecutive = []
        if grad_norm is not None and math.isfinite(grad_norm):
            d.grad_z = self.grad_stat.zscore(grad_norm)
            if self.grad_z_threshold is not None and self.grad_stat.ready and d.grad_z > self.grad_z_threshold:
                d.reasons.append(GRAD_SPIKE)
            if update and GRAD_SPIKE in d.reasons:
                d.grad_level_shift = self._accept_level(d, GRAD_SPIKE, self.grad_consecutive, self.grad_stat,
                                                        grad_norm)
            elif update:
                self.grad_consecutive = []
        if update and not d.is_spike:
            if not d.level_shift:
                self.loss_stat.add(loss)
            if grad_norm is not None and not d.grad_level_shift:
                self.grad_stat.add(grad_norm)
        return d

    def _accept_level(self, d: SpikeDecision, reason: str, run: list[float], stat: RobustStat, value: float) -> bool:
        """Count ``value`` into ``run``, the current run of consecutive ``reason`` spikes. After ``max_consecutive`` of
        them the new level is taken to be real: the step is not a spike, ``stat`` restarts from the run's values, and
        True is returned."""
        run.append(value)
        if self.max_consecutive is None or len(run) < self.max_consecutive:
            return False
        d.reasons.remove(reason)
        stat.reseed(list(run))
        run.clear()
        return True

    def state_dict(self) -> dict:
        return {"loss_stat": self.loss_stat.state_dict(), "grad_stat": self.grad_stat.state_dict(),
                "consecutive": list(self.consecutive), "grad_consecutive": list(self.grad_consecutive)}

    def load_state_dict(self, state: dict) -> None:
        self.loss_stat.load_state_dict(state["loss_stat"])
        self.grad_stat.load_state_dict(state["grad_stat"])
        self.consecutive = [float(v) for v in state.get("consecutive", [])]
        self.grad_consecutive = [float(v) for v in state.get("grad_consecutive", [])]  # absent in older checkpoints


class SpikeWindow:
    """Counts spikes in a sliding window of steps: :meth:`add` returns True once ``max_spikes`` fall in it."""

    def __init__(self, max_spikes: int = 3, window_steps: int = 1000) -> None:
        for name, value in (("max_spikes", max_spikes), ("window_steps", window_steps)):
            check_arg("SpikeWindow", name, value, whole_at_least(1), "an integer >= 1")
        self.max_spikes, self.window_steps = int(max_spikes), int(window_steps)
        self.steps: list[int] = []

    def add(self, step: int) -> bool:
        self.steps = [s for s in self.steps if s > step - self.window_steps] + [int(step)]
        return len(self.steps) >= self.max_spikes


def cooldown_factor(steps_since: int, factor: float, hold_steps: int, ramp_steps: int) -> float:
    """LR multiplier ``steps_since`` steps after a spike: ``factor`` for ``hold_steps``, then linear back to 1."""
    if steps_since < 0:
        return 1.0
    if steps_since < hold_steps:
        return factor
    if steps_since < hold_steps + ramp_steps:
        frac = (steps_since - hold_steps + 1) / (ramp_steps + 1)
        return factor + (1.0 - factor) * frac
    return 1.0


def zclip_threshold(stat: RobustStat, z_threshold: float) -> float | None:
    """ZClip's clip value ``mean + z * std`` of the grad-norm statistics, or None while warming up."""
    if not stat.ready:
        return None
    return stat.location() + z_threshold * stat.scale()
