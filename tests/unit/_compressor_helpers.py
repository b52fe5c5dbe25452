"""Helpers shared by the test_compressors_*.py files."""

from __future__ import annotations

import torch

from lit_dtrain.strategies import (
    LoopbackCommunicator,
)
from lit_dtrain.strategies.compressors import segments_from_shapes

SHAPES = [("w1", (48, 40)), ("b1", (40,)), ("w2", (40, 24)), ("emb", (13, 8, 3))]
SEGMENTS = segments_from_shapes(SHAPES)
NUMEL = sum(s.numel for s in SEGMENTS)


def grad(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUMEL, generator=g) * scale


def payload_bytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)

# --- local updates --------------------------------------------------------------------------------------
class TwoRankComm(LoopbackCommunicator):
    """Pretends to be rank 0 of 2: the other rank's contribution to each all-reduce comes from ``other``."""

    def __init__(self, other) -> None:
        super().__init__()
        self.other = other  # callable(tensor) -> the other rank's tensor

    @property
    def world_size(self) -> int:
        return 2

    def all_reduce_sum_async(self, tensor):
        fut = super().all_reduce_sum_async(tensor)
        tensor.add_(self.other(tensor))
        return fut


class TwoRankGatherComm(TwoRankComm):
    """Rank 0 of 2 for all-gather codecs too: the other rank's packed payload comes from ``other``."""

    def all_gather_async(self, tensor):
        fut = super().all_gather_async(tensor)
        return fut.then(lambda f: torch.stack([f.value()[0], self.other(f.value()[0])]))


def make_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(6, 4, generator=g)), ("b", torch.randn(5, generator=g))]
