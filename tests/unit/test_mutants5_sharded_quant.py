"""Gaps found by the fifth hand mutation audit of strategies/sharded_quant.py: results no other test pinned."""

from __future__ import annotations

from lit_dtrain.strategies import ShardedBlockQuantizer
from lit_dtrain.strategies.compressors import segments_from_shapes


def test_one_block_parameters_are_spread_over_the_ranks():
    """A parameter of one block (a bias, a norm's weight) has one owner; the rotation by its name's CRC-32 spreads
    such parameters over the ranks. Without it the last rank owned every one of them (here all 8, 4x the others'
    bytes to decode, quantize again and all-gather)."""
    segments = segments_from_shapes([(f"layers.{i}.ln.bias", (32,)) for i in range(8)])
    shards = ShardedBlockQuantizer(block_size=64).shards(segments, 8 * 32, 4)
    assert [len(s.ranges) for s in shards] == [2, 2, 2, 2]
    assert sorted(name for s in shards for name, *_ in s.ranges) == sorted(s.name for s in segments)
    assert len({s.nbytes for s in shards}) == 1
