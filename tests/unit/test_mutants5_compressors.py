"""A compressor's undo, from the fifth hand mutation audit: ``undo_step`` must also put back the call count, which
seeds the stochastic rounding of a buffer whose segments do not tile it; an undo that left the count passed the four
compressor test files (their stochastic buffers are tiled, seeded per parameter name)."""

from __future__ import annotations

import torch

from lit_dtrain.strategies import BlockQuantizer, LoopbackCommunicator
from lit_dtrain.strategies.compressors import Segment


def test_an_undone_step_draws_the_same_stochastic_rounding_again_on_an_untiled_buffer():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    segments = [Segment("a", 0, 60, (60,))]  # the last 40 values belong to no parameter: flat blocks, one draw a call
    codec = BlockQuantizer(bits=4, block_size=16, stochastic_rounding=True)
    codec.track_undo()
    codec.reduce(x.clone(), segments, LoopbackCommunicator(), 0).wait()
    first = codec.reduce(x.clone(), segments, LoopbackCommunicator(), 1).wait()
    assert codec.num_calls == 2 and codec.undo_step() and codec.num_calls == 1
    assert torch.equal(codec.reduce(x.clone(), segments, LoopbackCommunicator(), 1).wait(), first)
