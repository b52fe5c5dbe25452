"""The sampling distribution of a :class:`FourierSampler`'s table, kept as a two-level CDF, and draws from it.

A sample's sampling weight is its importance (:func:`.spectral.importance_elementwise` of its moments, then
:func:`.spectral.importance_finish`), times the mixture prior when there is one; a share ``uniform_floor`` of the
draws comes from the target distribution (the mixture prior over the samples not excluded). The samples are cut
into blocks of ``BLOCK``, and a step rescans only the blocks that its update touched: see
:meth:`TwoLevelCDF._distribution`.

:class:`TwoLevelCDF` is the drawing half of :class:`.fourier.FourierSampler`, which inherits it; it reads the
sampler's table (``m1``, ``m2``, ``visits``), its importance settings (``variant``, ``momentum``, ``min_prob``,
``max_prob``, ``magnitude_cap``, ``prior``, ``eps``, ``uniform_floor``) and the prior and exclusions of
:class:`.base.IndexSampler`. The sampler tells it which samples its update changed (:meth:`TwoLevelCDF._refresh`)
and when the prior, the exclusions or the whole table changed (:meth:`TwoLevelCDF._touch`).
"""

from __future__ import annotations

import torch

from lit_dtrain.data.samplers import spectral
from lit_dtrain.data.samplers.base import draw_from_cdf


class TwoLevelCDF:
    """Sampling weights, probabilities and inverse-CDF draws of a per-sample importance table (a mixin of
    :class:`.fourier.FourierSampler`, before :class:`.base.IndexSampler` in its bases)."""

    BLOCK = 256  # samples per block of the two-level sampling CDF

    def __init__(self) -> None:
        super().__init__()
        self._version = self._target_version = 0
        self._elem: torch.Tensor | None = None  # per-sample part of the importance (float64), kept up to date
        self._unseen: torch.Tensor | None = None  # visits == 0, kept up to date (magnitude only)
        self._dirty: list[torch.Tensor] = []  # samples updated since the CDF was last rebuilt
        self._cache: dict = {}

    def _touch(self, target: bool = False, raw: bool = False) -> None:
        """Invalidate the cached distribution (and the target distribution / all raw importances)."""
        self._version += 1
        if target:
            self._target_version += 1
        if raw:
            self._elem = None
            self._dirty = []

    def _refresh(self, uniq: torch.Tensor) -> None:
        """The table rows ``uniq`` (unique sample indices) were just updated: refresh their importance and mark
        their blocks for a rescan at the next draw."""
        if self._elem is not None:  # refresh only the updated entries
            self._elem[uniq] = self._elementwise(uniq)
            if self._unseen is not None:
                self._unseen[uniq] = False
            self._dirty.append(uniq)
        self._touch()

    def _elementwise(self, sel=slice(None)) -> torch.Tensor:
        return spectral.importance_elementwise(
            self.m1[sel], self.m2[sel], self.visits[sel], self.variant, momentum=self.momentum,
            min_prob=self.min_prob, max_prob=self.max_prob, prior=self.prior, eps=self.eps,
        )

    def _distribution(self) -> dict:
        """The two-level sampling CDF, brought up to date in O(B * BLOCK + N / BLOCK) per step.

        The sampling weight of a sample is its importance, times the mixture prior when there is one. The
        samples are cut into blocks of ``BLOCK``; the cache keeps one total per block, and ``top``, the prefix
        sums of those totals. An update dirties only the blocks of the samples it touched, so a step rescans
        those blocks and the N / BLOCK totals, never all N samples. A draw picks a block from ``top`` and
        builds the prefix sums of just that block (:meth:`_block_rows`).

        ``magnitude`` divides every sample by the mean over seen samples, which moves at every step. Its
        weights are therefore kept as ``e / mean`` (``e = |m1_hat|``) with per-block sums of ``e`` over the
        samples inside the clamp ``[min_prob, magnitude_cap]`` and of the constant weights of the clamped and
        unseen ones, so a block's total is ``S / mean + C``. A block is rescanned only when it was updated or
        when the new mean moves one of its samples across a clamp edge, which four per-block extremes tell
        exactly (float division is monotone).

        Every per-block value is a sequential ``cumsum`` along the block's row, so it does not depend on which
        other blocks were rescanned with it: a resumed sampler, which rescans everything, draws bit-identically
        to an uninterrupted one (tested).
        """
        cache = self._cache
        if cache.get("version") == self._version:
            return cache
        n, k = self.num_samples, self.BLOCK
        nb = -(-n // k)
        full = False
        if cache.get("target_version") != self._target_version:
            uniform = self.base_weights is None and not self.num_excluded
            # uniform: the target is 1/N everywhere, so no per-sample target arrays (16 B/sample) are kept
            target = None if uniform else self.target_distribution()
            cache.clear()
            cache.update(target=target, target_cdf=None if uniform else self.target_cdf(target), uniform=uniform,
                         target_version=self._target_version)
            full = True
        if self._elem is None:  # padded to whole blocks with zeros
            self._elem = torch.zeros(nb * k, dtype=torch.float64)
            self._elem[:n] = self._elementwise()
            self._unseen = (self.visits == 0) if self.variant == "magnitude" else None
            full = True
        if full or not self._dirty:
            sel, dirty = torch.arange(nb), None
        else:
            dirty = torch.cat(self._dirty)
            sel = torch.unique(dirty // k)
        self._dirty = []
        if self.variant == "moment_ratio":
            if cache["uniform"]:
                cache["w"] = self._elem  # the importance is the weight: no copy
            elif full or "w" not in cache:
                cache["w"] = torch.zeros(nb * k, dtype=torch.float64)
                torch.mul(self._elem[:n], cache["target"], out=cache["w"][:n])
            else:
                cache["w"][dirty] = self._elem[dirty] * cache["target"][dirty]
            if "block_total" not in cache:
                cache["block_total"] = torch.empty(nb, dtype=torch.float64)
            cache["block_total"][sel] = cache["w"].view(nb, k)[sel].cumsum(1)[:, -1]
            block_total = cache["block_total"]
        else:
            block_total = self._magnitude_totals(cache, sel, nb)
        top = block_total.cumsum(0)
        cache.update(version=self._version, top=top, total=float(top[-1]))
        return cache

    def _magnitude_totals(self, cache: dict, sel: torch.Tensor, nb: int) -> torch.Tensor:
        """Per-block totals of the ``magnitude`` weights, rescanning the blocks ``sel`` and any block whose
        clamp classes the new mean changes."""
        keys = ("seen_sum", "seen_count", "mid_sum", "const_sum", "low_max", "mid_min", "mid_max", "high_min")
        if "seen_sum" not in cache:
            cache.update({key: torch.zeros(nb, dtype=torch.float64) for key in keys})
        pos, valid, e, seen = self._block_samples(sel)
        cache["seen_sum"][sel] = torch.where(seen, e, 0.0).cumsum(1)[:, -1]
        cache["seen_count"][sel] = seen.sum(1, dtype=torch.float64)
        n_seen = float(cache["seen_count"].sum())
        mean = max(float(cache["seen_sum"].sum()) / n_seen if n_seen else 1.0, self.eps)
        lo, cap = self.min_prob, self.magnitude_cap
        stale = ~((cache["low_max"] / mean < lo) & (cache["mid_min"] / mean >= lo)
                  & (cache["mid_max"] / mean <= cap) & (cache["high_min"] / mean > cap))
        if bool(stale.any()):
            extra = stale.nonzero().squeeze(1)
            sel = torch.unique(torch.cat([sel, extra]))
            pos, valid, e, seen = self._block_samples(sel)
        x = e / mean
        low, high = seen & (x < lo), seen & (x > cap)
        mid = seen & ~low & ~high
        t = 1.0 if cache["uniform"] else torch.where(valid, cache["target"][pos.clamp(max=self.num_samples - 1)], 0.0)
        unseen = valid & ~seen
        const = torch.zeros_like(e).masked_fill_(low, lo).masked_fill_(high, cap).masked_fill_(unseen, self.prior) * t
        cache["mid_sum"][sel] = (torch.where(mid, e, 0.0) * t).cumsum(1)[:, -1]
        cache["const_sum"][sel] = const.cumsum(1)[:, -1]
        inf = float("inf")
        cache["low_max"][sel] = torch.where(low, e, -inf).amax(1)
        cache["mid_min"][sel] = torch.where(mid, e, inf).amin(1)
        cache["mid_max"][sel] = torch.where(mid, e, -inf).amax(1)
        cache["high_min"][sel] = torch.where(high, e, inf).amin(1)
        cache["mean"] = mean
        return cache["mid_sum"] / mean + cache["const_sum"]

    def _block_positions(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample positions ``(len(blocks), BLOCK)`` of the given blocks, and which of them are real samples."""
        pos = blocks[:, None] * self.BLOCK + torch.arange(self.BLOCK)
        return pos, pos < self.num_samples

    def _block_samples(self, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """For ``magnitude``: positions, real-sample mask, ``|m1_hat|`` and seen mask of the given blocks.

        An excluded sample counts as not seen: the samples of a batch that a loss-spike monitor skipped (it
        excludes them; ``FourierSamplerCallback`` no longer scores such a step, but another caller of :meth:`observe`
        may have, often at a spike's loss) must not enter the mean that
        every other sample is divided by. Its weight is 0 either way (its target is 0). Without exclusions
        this is the plain seen mask, so nothing changes bit for bit when no step is skipped.
        """
        pos, valid = self._block_positions(blocks)
        safe = pos.clamp(max=self.num_samples - 1)
        seen = ~self._unseen[safe] & valid
        if self.num_excluded:  # exclusions invalidate the target, so every block is rescanned with this mask
            seen &= ~self.excluded[safe]
        return pos, valid, self._elem[pos], seen

    def _weights_at(self, pos: torch.Tensor) -> torch.Tensor:
        """Sampling weights (unnormalized, float64) at sample positions ``pos`` (0 past the last sample)."""
        c = self._distribution()
        if self.variant == "moment_ratio":
            return c["w"][pos]
        valid = pos < self.num_samples
        safe = pos.clamp(max=self.num_samples - 1)
        w = spectral.importance_finish(self._elem[pos], self._unseen[safe], self.variant, min_prob=self.min_prob,
                                       magnitude_cap=self.magnitude_cap, prior=self.prior, eps=self.eps,
                                       mean=c["mean"])
        if not c["uniform"]:
            w = w * c["target"][safe]
        return w.masked_fill_(~valid, 0.0)

    def _block_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Prefix sums of the weights inside each of ``blocks``: ``(len(blocks), BLOCK)``."""
        return self._weights_at(self._block_positions(blocks)[0]).cumsum(1)

    def _probs_at(self, idx: torch.Tensor) -> torch.Tensor:
        c = self._distribution()
        scale = (1.0 - self.uniform_floor) / c["total"]
        return scale * self._weights_at(idx) + self.uniform_floor * self._target_at(idx)

    def distribution_stats(self) -> dict:
        """The table's distribution as it is (no flush, as :meth:`entropy`), in numbers one can read: ``entropy``
        (nats), and ``prob_max_ratio`` / ``prob_min_ratio``, the most and least likely drawable sample's probability
        over its share of the target (the mixture prior over the samples not excluded): 1 and 1 while it is that
        target, uniform for one source. O(N)."""
        everything = torch.arange(self.num_samples)
        probs, target = self._probs_at(everything), self._target_at(everything)
        drawable = target > 0
        ratio = probs[drawable] / target[drawable]
        return {"entropy": spectral.entropy(probs), "prob_max_ratio": float(ratio.max()),
                "prob_min_ratio": float(ratio.min())}

    def _target_at(self, idx: torch.Tensor) -> torch.Tensor:
        """The target distribution (mixture prior over non-excluded samples) at ``idx``."""
        c = self._distribution()
        if c["uniform"]:
            return torch.full(idx.shape, 1.0 / self.num_samples, dtype=torch.float64)
        return c["target"][idx]

    def _draw(self, u: torch.Tensor) -> torch.Tensor:
        """Sample indices for the uniform variates ``u`` (float64 in [0, 1), one per draw): inverse-CDF draws from
        the current distribution."""
        c = self._distribution()
        # p = (1 - f) * w / total + f * target: u < f draws from the floor (the target), the rest from w.
        f = self.uniform_floor
        v = ((u - f) / (1.0 - f)).clamp_(min=0.0) if f < 1.0 else torch.zeros_like(u)
        top = c["top"]
        zero = torch.zeros((), dtype=torch.float64)
        x = torch.minimum(v * c["total"], torch.nextafter(top[-1], zero))  # rounding: below the total
        block = torch.searchsorted(top, x, right=True).clamp_(max=len(top) - 1)
        x = x - torch.where(block > 0, top[(block - 1).clamp(min=0)], 0.0)  # offset inside the block
        row = self._block_rows(block)  # (len(u), BLOCK) prefix sums
        x = torch.minimum(x, torch.nextafter(row[:, -1], zero)).unsqueeze(1)  # rounding: stay inside the block
        idx = block * self.BLOCK + torch.searchsorted(row, x, right=True).squeeze(1)
        if f > 0.0:
            if c["uniform"]:
                floor_idx = (u * (self.num_samples / f)).long()
            else:
                floor_idx = draw_from_cdf(c["target_cdf"], u / f)
            idx = torch.where(u < f, floor_idx, idx)
        return idx.clamp_(max=self.num_samples - 1)
