"""Step-indexed samplers: the global batch of step ``s`` is a pure function of (seed, s, sampler state).

Every rank calls :meth:`IndexSampler.global_batch` with the same arguments, gets the same global batch
and takes its own contiguous shard, so DDP needs no coordination and a resume replays exactly.
"""

from __future__ import annotations

import torch

_MIX_A = 6364136223846793005
_MIX_B = 1442695040888963407


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, step, stream)."""
    g = torch.Generator()
    g.manual_seed((seed * _MIX_A + step * _MIX_B + stream * 0x9E3779B97F4A7C15) % (2**63 - 1))
    return g


class IndexSampler:
    """Base class: draws window indices in ``[0, num_samples)`` for each step.

    Subclasses override :meth:`probabilities` (or :meth:`global_batch`). Excluded indices (for example
    batches that caused a loss spike) are never drawn again; the exclusion set is part of the state.
    """

    def __init__(self) -> None:
        self.num_samples = 0
        self.seed = 0
        self.base_weights: torch.Tensor | None = None
        self.excluded = torch.zeros(0, dtype=torch.bool)

    def setup(self, num_samples: int, base_weights: torch.Tensor | None = None, seed: int = 0) -> None:
        """Bind to a dataset of ``num_samples`` windows; ``base_weights`` (optional) is a mixture prior."""
        if num_samples <= 0:
            raise ValueError(f"sampler needs at least one sample, got num_samples={num_samples}")
        if base_weights is not None and base_weights.shape != (num_samples,):
            raise ValueError(f"base_weights has shape {tuple(base_weights.shape)}, expected ({num_samples},)")
        self.num_samples, self.seed = int(num_samples), int(seed)
        self.base_weights = None if base_weights is None else base_weights.double() / base_weights.sum()
        if self.excluded.numel() != num_samples:
            self.excluded = torch.zeros(num_samples, dtype=torch.bool)

    def exclude(self, indices) -> None:
        """Never draw these sample indices again (they persist through ``state_dict``)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        self.excluded[idx] = True
        if bool(self.excluded.all()):
            raise RuntimeError("every training sample has been excluded; nothing is left to train on")

    def probabilities(self, step: int) -> torch.Tensor | None:
        """Sampling distribution over samples (float64, sums to 1), or None for uniform."""
        return self.base_weights

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        """The ``size`` sample indices of step ``step`` (with replacement), identical on every rank."""
        if self.num_samples == 0:
            raise RuntimeError(f"{type(self).__name__}.setup() was not called")
        g = step_generator(self.seed, step)
        probs = self.probabilities(step)
        if probs is None and not bool(self.excluded.any()):
            return torch.randint(self.num_samples, (size,), generator=g)
        if probs is None:
            probs = torch.ones(self.num_samples, dtype=torch.float64)
        probs = probs.masked_fill(self.excluded, 0.0)
        return torch.multinomial(probs.float(), size, replacement=True, generator=g)

    def state_dict(self) -> dict:
        return {"excluded": self.excluded.nonzero().flatten().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.excluded = torch.zeros(max(self.num_samples, 0), dtype=torch.bool)
        if len(state.get("excluded", [])):
            self.excluded[torch.as_tensor(state["excluded"], dtype=torch.long)] = True


class RandomSampler(IndexSampler):
    """Uniform sampling with replacement (weighted by the mixture prior when there is one)."""
