"""Step-indexed samplers: the global batch of step ``s`` is a pure function of (seed, s, sampler state).

Every rank calls :meth:`IndexSampler.global_batch` with the same arguments, gets the same global batch
and takes its own contiguous shard, so DDP needs no coordination and a resume replays exactly.
"""

from __future__ import annotations

import logging

import torch

from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.samplers")  # a sampler's lines: facts of the run, rank 0's, in train.log

_MIX_A = 6364136223846793005
_MIX_B = 1442695040888963407


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, step, stream)."""
    g = torch.Generator()
    g.manual_seed((seed * _MIX_A + step * _MIX_B + stream * 0x9E3779B97F4A7C15) % (2**63 - 1))
    return g


def target_distribution(
    num_samples: int,
    excluded: torch.Tensor | None,
    base_weights: torch.Tensor | None,
    source_offsets: list[int] | None = None,
):
    """The mixture prior (uniform when None) over the non-excluded samples, normalized (float64).

    ``source_offsets`` (``[0, n_0, n_0 + n_1, ..., num_samples]``: the sources' windows are consecutive) makes
    exclusions renormalize within each source, so that every source keeps its share of the prior; a source
    with no window left has no share, and the others share its mass in proportion to theirs. Without it the
    exclusions renormalize over every window left, which moves the sources' shares (half of a 0.5/0.3/0.2
    mixture's first source excluded: 0.33/0.40/0.27).
    """
    base = torch.ones(num_samples, dtype=torch.float64) if base_weights is None else base_weights.double().clone()
    if excluded is not None:
        kept = base.masked_fill(excluded, 0.0)
        if source_offsets is not None and len(source_offsets) > 2:
            for start, stop in zip(source_offsets[:-1], source_offsets[1:]):
                left = kept[start:stop].sum()
                if left > 0:
                    kept[start:stop] *= base[start:stop].sum() / left
        base = kept
    return base / base.sum()


def draw_from_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: for ``u`` in [0, 1], the index ``i`` with ``cdf[i-1] <= u * total < cdf[i]``.

    ``cdf`` is a non-decreasing float64 prefix sum. ``u * total`` is kept strictly below the total, so
    ``u = 1`` (which a rescaled ``u`` can round to) never returns an index past the last sample of positive
    weight.
    """
    total, u = cdf[-1], u.to(cdf.dtype)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros((), dtype=total.dtype)))
    return torch.searchsorted(cdf, x, right=True)


class IndexSampler:
    """Base class: draws window indices in ``[0, num_samples)`` for each step.

    Subclasses override :meth:`probabilities` (or :meth:`global_batch`). Excluded indices (for example
    batches that caused a loss spike) are never drawn again; the exclusion set is part of the state.
    """

    min_block_size = 1  # the fewest tokens per window (data.block_size) it can learn from; LMDataModule checks it
    min_block_size_reason = ""  # why, for the error message

    def __init__(self) -> None:
        self.num_samples = 0
        self.seed = 0
        self.base_weights: torch.Tensor | None = None
        self.excluded = torch.zeros(0, dtype=torch.bool)
        self.num_excluded = 0
        self.source_offsets: list[int] | None = None  # window boundaries of the mixture's sources (None: one)
        self.source_names: list[str] = []
        self._exhausted: set[int] = set()  # sources (of positive share) whose every window is excluded
        self._target_cdf: torch.Tensor | None = None  # cached CDF of target_distribution(); None: stale
        self.dataset_key: str | None = None  # which windows the per-window state indexes (see setup)

    def setup(
        self,
        num_samples: int,
        base_weights: torch.Tensor | None = None,
        seed: int = 0,
        source_offsets: list[int] | None = None,
        source_names: list[str] | None = None,
        dataset_key: str | None = None,
    ) -> None:
        """Bind to a dataset of ``num_samples`` windows; ``base_weights`` (optional) is a mixture prior.

        ``source_offsets`` (``[0, ..., num_samples]``, the window boundaries of the mixture's sources) and
        ``source_names`` (for messages) make exclusions keep every source's share of the prior (see
        :func:`target_distribution`). ``dataset_key`` names the windows (``LMDataModule``: a hash of the token
        caches' keys); it is saved with the state, and a state of another dataset is refused on load."""
        if num_samples <= 0:
            raise ValueError(f"sampler needs at least one sample, got num_samples={num_samples}")
        if base_weights is not None and base_weights.shape != (num_samples,):
            raise ValueError(f"base_weights has shape {tuple(base_weights.shape)}, expected ({num_samples},)")
        if source_offsets is not None:
            source_offsets = [int(o) for o in source_offsets]
            if (
                source_offsets[0] != 0
                or source_offsets[-1] != num_samples
                or any(a > b for a, b in zip(source_offsets, source_offsets[1:]))
            ):
                raise ValueError(f"source_offsets must rise from 0 to num_samples={num_samples}, got {source_offsets}")
        self.source_offsets = source_offsets
        count = 0 if source_offsets is None else len(source_offsets) - 1
        self.source_names = list(source_names) if source_names is not None else [str(i) for i in range(count)]
        if len(self.source_names) != count:
            raise ValueError(f"{len(self.source_names)} source_names for {count} sources")
        self._exhausted = set()
        self.num_samples, self.seed, self.dataset_key = int(num_samples), int(seed), dataset_key
        self.base_weights = None if base_weights is None else base_weights.double() / base_weights.sum()
        if self.excluded.numel() != num_samples:
            self.excluded = torch.zeros(num_samples, dtype=torch.bool)
        self._exclusions_changed()

    def exclude(self, indices) -> None:
        """Never draw these sample indices again (they persist through ``state_dict``)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        bad = idx[(idx < 0) | (idx >= self.num_samples)]
        if len(bad):  # -1 excluded the last sample (Python indexing), silently
            raise ValueError(f"exclude: sample index {int(bad[0])} is out of range for {self.num_samples} samples")
        self.excluded[idx] = True
        self._exclusions_changed()
        left = self.num_samples - self.num_excluded
        if left and self.base_weights is not None:  # windows of a weight-0 (validation-only) source don't count
            left = int((self.base_weights > 0).logical_and_(~self.excluded).sum())
        if not left:
            raise RuntimeError("every training sample has been excluded; nothing is left to train on")

    def _exclusions_changed(self) -> None:
        self.num_excluded = int(self.excluded.sum())  # O(N), but only when the set changes, never per step
        self._target_cdf = None
        self._warn_exhausted_sources()

    def _warn_exhausted_sources(self) -> None:
        """Warn once per source of positive share whose every window is now excluded: its share goes to the
        other sources (in proportion to theirs), so the mixture is no longer the configured one."""
        if self.source_offsets is None or len(self.source_offsets) < 3 or not self.num_excluded:
            return
        base = self.base_weights
        bounds = zip(self.source_offsets[:-1], self.source_offsets[1:])
        for source, (start, stop) in enumerate(bounds):
            share = (stop - start) / self.num_samples if base is None else float(base[start:stop].sum())
            if source in self._exhausted or stop == start or not share > 0 or not bool(self.excluded[start:stop].all()):
                continue
            self._exhausted.add(source)
            if share < 1.0:  # a lone source excluded in full is the "nothing is left" error, not a warning
                log_once(  # every rank excludes the same windows: a fact of the run, in train.log
                    log, logging.WARNING,
                    "data source %r: every training window of it is excluded (the loss-spike monitor skipped them): "
                    "its share %.4g of the mixture goes to the other sources in proportion to their weights",
                    self.source_names[source], share,
                )

    def target_distribution(self) -> torch.Tensor:
        """:func:`target_distribution` of this sampler's prior and exclusions (O(N): not cached)."""
        excluded = self.excluded if self.num_excluded else None
        return target_distribution(self.num_samples, excluded, self.base_weights, self.source_offsets)

    def target_cdf(self, target: torch.Tensor | None = None) -> torch.Tensor:
        """Prefix sums of :meth:`target_distribution` (cached until the exclusions or the prior change).

        A caller that has just computed the distribution passes it as ``target`` to save a second O(N) pass.
        """
        if self._target_cdf is None:
            self._target_cdf = (self.target_distribution() if target is None else target).cumsum(0)
        return self._target_cdf

    def probabilities(self, step: int) -> torch.Tensor | None:
        """Sampling distribution over samples (float64, sums to 1), or None for uniform."""
        return self.base_weights

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        """The ``size`` sample indices of step ``step`` (with replacement), identical on every rank.

        Uniform with no exclusions: ``randint``. The mixture prior or exclusions: inverse-CDF draws from the
        cached :meth:`target_cdf`, O(size log N) per step. A distribution that a subclass computes per step:
        ``multinomial``.
        """
        if self.num_samples == 0:
            raise RuntimeError(f"{type(self).__name__}.setup() was not called")
        g = step_generator(self.seed, step)
        probs = self.probabilities(step)
        if probs is None and not self.num_excluded:
            return torch.randint(self.num_samples, (size,), generator=g)
        if probs is None or probs is self.base_weights:
            return draw_from_cdf(self.target_cdf(), torch.rand(size, generator=g, dtype=torch.float64))
        probs = probs.masked_fill(self.excluded, 0.0)
        return torch.multinomial(probs.float(), size, replacement=True, generator=g)

    def state_dict(self) -> dict:
        state = {"excluded": self.excluded.nonzero().flatten().clone(), "num_samples": int(self.num_samples)}
        if self.dataset_key is not None:
            state["dataset_key"] = self.dataset_key
        return state

    def check_dataset(self, state: dict, what: str) -> None:
        """Refuse a state whose per-window data (``what``) indexes the windows of another dataset: another corpus
        of the same size would otherwise take it silently. Checkpoints without a key (older ones) pass."""
        saved = state.get("dataset_key")
        if saved is not None and self.dataset_key is not None and saved != self.dataset_key:
            raise ConfigError(
                f"the checkpoint's sampler {what} indexes the windows of dataset {saved}, and this run's is "
                f"{self.dataset_key}: the checkpoint belongs to another corpus (other files or file contents), "
                "block_size or data.val_fraction, so its per-window state would be applied to other text. Resume "
                "on the data it was trained on, or start from its weights with init_from=<checkpoint>"
            )

    def load_state_dict(self, state: dict) -> None:
        excluded = torch.as_tensor(state.get("excluded", []), dtype=torch.long).reshape(-1)
        if len(excluded):  # window indices: they name other windows in a dataset of another size
            self.check_dataset(state, "state 'excluded'")
            saved = state.get("num_samples")  # absent in checkpoints from before it was recorded
            if saved is not None and int(saved) != self.num_samples:
                raise ConfigError(
                    f"sampler state 'excluded' covers {int(saved)} samples but the dataset has {self.num_samples}: "
                    "the checkpoint belongs to another corpus or block_size"
                )
            bad = excluded[(excluded < 0) | (excluded >= self.num_samples)]
            if len(bad):
                raise ConfigError(
                    f"sampler state: excluded sample index {int(bad[0])} is out of range for {self.num_samples} "
                    "samples: the checkpoint belongs to another corpus or block_size"
                )
        self.excluded = torch.zeros(max(self.num_samples, 0), dtype=torch.bool)
        self.excluded[excluded] = True
        self._exclusions_changed()


class RandomSampler(IndexSampler):
    """Uniform sampling with replacement (weighted by the mixture prior when there is one)."""

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "m1" in state and "visits" in state:  # a FourierSampler's state: this sampler keeps only the exclusions
            seen = int((torch.as_tensor(state["visits"]) > 0).sum())
            log_once(
                log, logging.WARNING,
                "the checkpoint's sampler state was written by FourierSampler (its table: %d samples seen); this "
                "run's RandomSampler keeps the excluded samples, and the table is dropped: a later resume with "
                "data/sampler=fourier starts it over", seen,
            )
