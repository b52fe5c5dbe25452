"""Pure spectral core of the :class:`~lit_dtrain.data.samplers.FourierSampler` (no Lightning, no collectives).

Everything here is a plain function of tensors, so it is tested on synthetic signals:

* :func:`compute_bands` gives the brief's exponential band edges, :func:`band_lower_bins` maps them onto the
  rfft bins of the actual sequence length ``T`` (``max_freq`` corresponds to the Nyquist bin ``T // 2``);
* :func:`band_energies` splits each sample's token-loss variance over the bands (the spectral profile);
* :func:`adaptive_band_weights` / :func:`frequency_score` / :func:`time_score` / :func:`mix_schedule` build the
  per-sample score; :func:`stage_at` is the staged schedule;
* :func:`update_moments` / :func:`importance` / :func:`sampling_probabilities` turn score moments into a
  sampling distribution with a uniform floor.

Band layout. ``compute_bands(max_freq, n)`` returns ``n`` edges ``max_freq * 2**-i`` (``i = n .. 1``). We read
them as the *lower* edges of ``n`` octave bands: band ``k`` covers bins ``[edge_k, edge_{k+1})``, the top band
runs to Nyquist, and the lowest band is extended down to bin 1, so every non-DC bin belongs to exactly one band.
The DC bin (the mean loss) is the time score and belongs to no band. With ``max_freq=256, num_bands=8`` at
``T=512`` these are exact octaves ``[1,2), [2,4), ..., [128,256]``; fewer bands merge the lowest octaves, so
the profile of ``n`` bands is a merge of the profile of ``F >= n`` bands (:func:`merge_bands`). Edges that
coincide after mapping (short ``T``, many bands) give empty bands with zero energy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from lit_dtrain.utils.args import as_written, is_number, type_name

VARIANTS = ("moment_ratio", "magnitude")


def compute_bands(max_freq: int, num_bands: int) -> list[int]:
    """The brief's exponential band edges: ``[int(max_freq * 2**-i) for i in range(num_bands, 0, -1)]``."""
    if int(max_freq) <= 0:
        raise ValueError(f"max_freq must be a positive integer, got {max_freq}")
    if int(num_bands) <= 0:
        raise ValueError(f"num_bands must be a positive integer, got {num_bands}")
    return [int(max_freq * (2 ** (-i))) for i in range(num_bands, 0, -1)]


def default_band_config(seq_len: int) -> tuple[int, int]:
    """The brief's ``(max_freq, num_bands)`` for a sequence length: (256, 4) up to 512, (1024, 6) from 2048.

    The brief says nothing for lengths in between; we use (512, 5) there (the midpoint in octaves).
    """
    if seq_len <= 512:
        return 256, 4
    if seq_len >= 2048:
        return 1024, 6
    return 512, 5


def band_lower_bins(max_freq: int, num_bands: int, seq_len: int) -> torch.Tensor:
    """Lower rfft bin of each band for sequences of ``seq_len`` tokens (non-decreasing, first is 1).

    Edge ``e`` maps to bin ``floor(e * (seq_len // 2) / max_freq)`` clamped to ``[1, seq_len // 2]``.
    """
    if seq_len < 2:
        raise ValueError(f"token_loss needs at least 2 positions for a spectrum, got T={seq_len}")
    nyquist = seq_len // 2
    edges = compute_bands(max_freq, num_bands)
    bins = [min(max(e * nyquist // max_freq, 1), nyquist) for e in edges]
    bins[0] = 1  # the lowest band reaches down to the first non-DC bin
    return torch.tensor(bins, dtype=torch.long)


@functools.lru_cache(maxsize=64)
def bin_to_band(max_freq: int, num_bands: int, seq_len: int) -> torch.Tensor:
    """Band index of every rfft bin ``0 .. seq_len // 2`` (``-1`` for the DC bin). Cached: do not modify."""
    lower = band_lower_bins(max_freq, num_bands, seq_len)
    bins = torch.arange(seq_len // 2 + 1)
    band = torch.searchsorted(lower, bins, right=True) - 1
    band[0] = -1
    return band


@functools.lru_cache(maxsize=64)
def _bin_to_band_on(max_freq: int, num_bands: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """:func:`bin_to_band` kept on ``device``: a GPU step does not wait for a host-to-device copy of it."""
    return bin_to_band(max_freq, num_bands, seq_len).to(device)


def band_energies(token_loss: torch.Tensor, max_freq: int, num_bands: int) -> torch.Tensor:
    """Spectral profile ``[B, num_bands]`` (fp32) of each row of ``token_loss [B, T]``.

    Band energy is the one-sided power ``|rfft|**2`` of the band's bins, scaled by Parseval so that the bands
    of a row sum to the population variance of that row: the profile splits a sample's loss fluctuation by
    scale (low bands: slow, long-range changes; high bands: token-to-token noise).
    """
    B, T = token_loss.shape
    power = power_spectrum(token_loss)
    band = _bin_to_band_on(max_freq, num_bands, T, power.device)
    out = torch.zeros(B, num_bands, device=power.device)
    out.index_add_(1, band[1:], power[:, 1:])
    return out


def power_spectrum(token_loss: torch.Tensor) -> torch.Tensor:
    """One-sided power ``[B, T//2 + 1]`` (fp32) of each row's rfft, scaled so that bins ``1..T//2`` sum to the
    row's population variance (Parseval); bin 0 holds ``mean**2``."""
    if token_loss.dim() != 2:
        raise ValueError(f"token_loss must be [B, T], got shape {tuple(token_loss.shape)}")
    T = token_loss.shape[1]
    x = token_loss.detach().float()
    spec = torch.fft.rfft(x, dim=-1)  # (B, T//2 + 1)
    scale = torch.full((T // 2 + 1,), 2.0, device=x.device)
    scale[0] = 1.0
    if T % 2 == 0:
        scale[-1] = 1.0  # the Nyquist bin has no mirror image
    return (spec.real.square() + spec.imag.square()) * scale / float(T * T)


def merge_bands(profile: torch.Tensor, num_bands: int) -> torch.Tensor:
    """Merge a fine profile ``[B, F]`` into ``num_bands <= F`` bands (same ``max_freq``): the lowest
    ``F - num_bands + 1`` fine bands form the coarse lowest band, the others are unchanged."""
    fine = profile.shape[-1]
    if not 1 <= num_bands <= fine:
        raise ValueError(f"cannot merge {fine} bands into {num_bands}")
    if num_bands == fine:
        return profile
    low = profile[..., : fine - num_bands + 1].sum(-1, keepdim=True)
    return torch.cat([low, profile[..., fine - num_bands + 1 :]], dim=-1)


def adaptive_band_weights(local_band_sum: torch.Tensor, global_energy: torch.Tensor | float) -> torch.Tensor:
    """The brief's ``local / (sqrt(global_energy) + 1e-6)``, where ``global_energy`` is the all-reduced
    ``sum(local**2)`` over ranks (on one rank: ``local`` scaled to unit norm)."""
    g = torch.as_tensor(global_energy, dtype=local_band_sum.dtype, device=local_band_sum.device)
    return local_band_sum / (g.sqrt() + 1e-6)


def frequency_score(profile: torch.Tensor, weights: torch.Tensor, world_size: int = 1) -> torch.Tensor:
    """Weighted band energy of each sample, normalized to loss units: ``sqrt(sqrt(W) * profile @ weights)``.

    ``weights`` have norm ``~1/sqrt(W)`` over ``W`` ranks, so ``sqrt(W)`` keeps the score independent of the
    world size; the square root turns an energy (nats^2) into an amplitude (nats), commensurate with the
    time score that it is mixed with.
    """
    projected = profile.float() @ weights.float().to(profile.device) * math.sqrt(world_size)
    return projected.clamp_min(0.0).sqrt()


def time_score(token_loss: torch.Tensor) -> torch.Tensor:
    """The time-domain score: each sample's mean token loss ``[B]``."""
    return token_loss.detach().float().mean(dim=-1)


def mix_schedule(step: int, initial: float = 0.3, final: float = 0.7, decay_steps: int = 10000) -> float:
    """The brief's cosine mixing factor: ``final + 0.5*(initial-final)*(1+cos(pi*min(step/decay_steps, 1)))``."""
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be positive, got {decay_steps}")
    progress = min(max(step, 0) / decay_steps, 1.0)
    return final + 0.5 * (initial - final) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Stage:
    """One row of the staged schedule; ``start`` is in step units."""

    name: str
    start: float
    bands: int
    mix: float
    lr_mult: float


DEFAULT_STAGES = (
    Stage("warmup", 0, 4, 0.3, 0.1),
    Stage("ramp", 5, 6, 0.5, 0.5),
    Stage("stable", 20, 8, 0.7, 1.0),
)


STAGE_FIELDS = ("name", "start", "bands", "mix", "lr_mult")


def parse_stages(table) -> tuple[Stage, ...]:
    """Stages from a list of ``[name, start_units, bands, mix, lr_mult]`` rows (or dicts); None: the brief's.

    A malformed table is a ``ValueError`` that names ``stage_table``, the row's index and what is wrong (a row of the
    wrong length, a string where a number belongs, starts out of order), not the dataclass's bare ``TypeError``."""
    if table is None:
        return DEFAULT_STAGES
    if isinstance(table, (str, bytes, Mapping)) or not isinstance(table, Iterable):
        raise ValueError(f"stage_table must be a list of [name, start_units, bands, mix, lr_mult] rows (or null for "
                         f"the brief's stages), got {table!r}")
    stages = [_stage_row(i, row) for i, row in enumerate(table)]
    if not stages:
        raise ValueError("stage_table is empty: give at least one row [name, 0, bands, mix, lr_mult], or null for "
                         "the brief's stages")
    if stages[0].start != 0:
        raise ValueError(f"stage_table row 0 ({stages[0].name!r}) must start at 0, got {stages[0].start:g}")
    for i, (a, b) in enumerate(zip(stages, stages[1:]), start=1):
        if not b.start > a.start:
            raise ValueError(f"stage_table row {i} ({b.name!r}) starts at {b.start:g}, not after row {i - 1} "
                             f"({a.name!r}) at {a.start:g}: the rows must be in increasing order of start")
    return tuple(stages)


def _stage_row(i: int, row) -> Stage:
    """Row ``i`` of a ``stage_table``, checked field by field."""
    where = f"stage_table row {i} ({_plain(row)!r})"
    if isinstance(row, Mapping):  # also a Hydra DictConfig
        keys = [str(key) for key in row.keys()]
        missing = [key for key in STAGE_FIELDS if key not in keys]
        unknown = [key for key in keys if key not in STAGE_FIELDS]
        if missing or unknown:
            problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unknown {', '.join(unknown)}"] if unknown else [])
            raise ValueError(f"{where}: {'; '.join(problems)} (the keys are {', '.join(STAGE_FIELDS)})")
        values = [row[key] for key in STAGE_FIELDS]
    elif isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
        raise ValueError(f"{where}: a row must be a list [name, start_units, bands, mix, lr_mult] (or a mapping with "
                         f"those keys), got {type(row).__name__}")
    else:
        values = list(row)
        if len(values) != len(STAGE_FIELDS):
            raise ValueError(f"{where}: has {len(values)} fields, needs {len(STAGE_FIELDS)}: "
                             "[name, start_units, bands, mix, lr_mult]")
    name, start, bands, mix, lr_mult = values
    for field, value in zip(STAGE_FIELDS[1:], values[1:]):
        if not is_number(value) or not math.isfinite(value):
            raise ValueError(f"{where}: {field} must be a finite number, got {value!r} ({type_name(value)})")
    if start < 0:
        raise ValueError(f"{where}: start must be >= 0 (in step units), got {start!r}")
    if not (bands > 0 and float(bands).is_integer()):
        raise ValueError(f"{where}: bands must be a positive integer, got {bands!r}")
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"{where}: mix must be in [0, 1], got {mix!r}")
    if not lr_mult > 0:
        raise ValueError(f"{where}: lr_mult must be > 0, got {lr_mult!r}")
    return Stage(str(name), float(start), int(bands), float(mix), float(lr_mult))


def _plain(row):
    """A Hydra ListConfig/DictConfig row as a plain list/dict (for the message)."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(row) if OmegaConf.is_config(row) else row
    except ImportError:
        return row


def stage_at(step: int, step_unit: float, stages: tuple[Stage, ...] = DEFAULT_STAGES) -> Stage:
    """The stage active at ``step``: the last one with ``start * step_unit <= step``, in the exact product of the
    numbers as written (a start of 0.07 units of 100 steps begins at step 7; the float product 7.000000000000001 put
    it at step 8)."""
    if step_unit <= 0:
        raise ValueError(f"step_unit must be positive, got {step_unit}")
    current = stages[0]
    for stage in stages:
        if as_written(stage.start) * as_written(step_unit) <= step:
            current = stage
    return current


def update_moments(
    m1: torch.Tensor, m2: torch.Tensor, score: torch.Tensor, momentum: float = 0.9, beta: float = 0.99
) -> tuple[torch.Tensor, torch.Tensor]:
    """The brief's EMAs: ``m1 = momentum*m1 + (1-momentum)*score``, ``m2 = beta*m2 + (1-beta)*score**2``."""
    return momentum * m1 + (1 - momentum) * score, beta * m2 + (1 - beta) * score.square()


def importance(
    m1: torch.Tensor,
    m2: torch.Tensor,
    visits: torch.Tensor,
    variant: str = "moment_ratio",
    *,
    momentum: float = 0.9,
    min_prob: float = 1e-4,
    max_prob: float = 1.0,
    magnitude_cap: float = 10.0,
    prior: float = 1.0,
    eps: float = 1e-8,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unnormalized sampling weight of every sample (float64); unseen samples (``visits == 0``) get ``prior``.

    * ``moment_ratio`` (the brief's): ``clamp(|m1| / (sqrt(m2) + eps), min_prob, max_prob)``. This ratio is
      scale-free: for a positive, steady score it is ~1 whatever the score's size, so it ranks samples by the
      *stability* of their score, not by how large it is.
    * ``magnitude``: the bias-corrected EMA ``|m1| / (1 - momentum**visits)`` relative to its mean over seen
      samples, ``clamp(., min_prob, magnitude_cap)``: samples with a persistently high score are drawn more.
      (``|m1_hat| = ratio * rms``, i.e. the brief's ratio times the score's magnitude.)
      ``excluded`` samples (a skipped loss spike's) are left out of that mean; their own weight is zeroed
      by :func:`sampling_probabilities`.

    It is :func:`importance_finish` of :func:`importance_elementwise`; the sampler keeps the elementwise part
    and refreshes it only where the table changed.
    """
    elem = importance_elementwise(
        m1, m2, visits, variant, momentum=momentum, min_prob=min_prob, max_prob=max_prob, prior=prior, eps=eps
    )
    return importance_finish(elem, visits == 0, variant, min_prob=min_prob, magnitude_cap=magnitude_cap,
                             prior=prior, eps=eps, excluded=excluded)


def importance_elementwise(
    m1: torch.Tensor,
    m2: torch.Tensor,
    visits: torch.Tensor,
    variant: str = "moment_ratio",
    *,
    momentum: float = 0.9,
    min_prob: float = 1e-4,
    max_prob: float = 1.0,
    prior: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """The per-sample part of :func:`importance` (float64): the final weight for ``moment_ratio``,
    ``|m1_hat|`` (0 when unseen) for ``magnitude``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    m1, seen = m1.double(), visits > 0
    if variant == "moment_ratio":
        raw = (m1.abs() / (m2.double().sqrt() + eps)).clamp(min_prob, max_prob)
        return raw.masked_fill(~seen, float(prior))
    debias = 1.0 - torch.pow(torch.tensor(momentum, dtype=torch.float64), visits.double())
    return (m1.abs() / debias.clamp_min(1e-12)).masked_fill(~seen, 0.0)


def importance_finish(
    elem: torch.Tensor,
    unseen: torch.Tensor,
    variant: str = "moment_ratio",
    *,
    min_prob: float = 1e-4,
    magnitude_cap: float = 10.0,
    prior: float = 1.0,
    eps: float = 1e-8,
    mean: float | None = None,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """The global part of :func:`importance` (identity for ``moment_ratio``; for ``magnitude`` the division
    by the mean over seen, non-``excluded`` samples, the clamp and the prior). ``unseen`` is ``visits == 0``.
    ``mean``: that mean when ``elem`` is only a subset (the sampler passes the one its blocks keep)."""
    if variant == "moment_ratio":
        return elem
    if mean is None and excluded is None:
        n_seen = elem.numel() - int(unseen.sum())
        mean = float(elem.sum()) / n_seen if n_seen else 1.0
    elif mean is None:
        counted = ~unseen & ~excluded
        n_seen = int(counted.sum())
        mean = float(torch.where(counted, elem, 0.0).sum()) / n_seen if n_seen else 1.0
    return (elem / max(mean, eps)).clamp_(min_prob, magnitude_cap).masked_fill_(unseen, float(prior))


def sampling_probabilities(
    raw: torch.Tensor,
    uniform_floor: float = 0.1,
    excluded: torch.Tensor | None = None,
    base_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(1 - floor) * normalize(raw * base) + floor * normalize(base)`` over non-excluded samples (float64).

    ``base`` is the mixture prior (uniform when None); every non-excluded sample gets at least
    ``floor * base_i`` (``floor / N_active`` when uniform), excluded ones exactly 0. Sums to 1.
    """
    if not 0.0 <= uniform_floor <= 1.0:
        raise ValueError(f"uniform_floor must be in [0, 1], got {uniform_floor}")
    base = torch.ones_like(raw, dtype=torch.float64) if base_weights is None else base_weights.double().clone()
    if excluded is not None:
        base = base.masked_fill(excluded, 0.0)
    total = base.sum()
    if not total > 0:
        raise RuntimeError("no sample is left to draw (all excluded or zero base weight)")
    base = base / total
    weighted = raw.double() * base
    weighted = weighted / weighted.sum()
    return (1.0 - uniform_floor) * weighted + uniform_floor * base


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy (nats) of a distribution; ``log(N)`` for uniform over ``N``."""
    p = probs[probs > 0].double()
    return float(-(p * p.log()).sum())
