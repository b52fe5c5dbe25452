"""A compressor's undo copies (``track_undo``: LossSpikeMonitor under compressed DDP) follow DDP's bucket layouts."""

from __future__ import annotations

import torch

from lit_dtrain.strategies import LoopbackCommunicator, TopK
from lit_dtrain.strategies.compressors import Segment, segments_from_shapes

SEGMENTS = segments_from_shapes([("w1", (64, 32)), ("b1", (64,)), ("w2", (32, 64)), ("emb", (100, 16))])


def test_the_copy_of_a_layout_ddp_rebuilt_away_is_dropped():
    """DDP runs the first step on one bucket and rebuilds its buckets after it: a 2-rank topk run with loss_spike
    kept the first bucket's pre-step copy (955904 values of 'nano', the whole residual once more) to its end."""
    c, comm = TopK(ratio=0.05), LoopbackCommunicator()
    c.track_undo()
    numel = sum(s.numel for s in SEGMENTS)
    c.reduce(torch.randn(numel), SEGMENTS, comm, 0).wait()  # the initial bucket: every parameter
    a, b = SEGMENTS[:2], SEGMENTS[2:]
    na = sum(s.numel for s in a)
    bucket_b = [Segment(s.name, s.offset - na, s.numel, s.shape) for s in b]
    for step in range(1, 4):  # the rebuilt buckets
        g = torch.randn(numel)
        c.reduce(g[:na].clone(), a, comm, step).wait()
        c.reduce(g[na:].clone(), bucket_b, comm, step).wait()
    live = {buffer.data_ptr() for buffer in c._flat_residuals.values()}
    assert set(c._undo_copies) <= live
    assert sum(copy.numel() for copy in c._undo_copies.values()) == numel  # one copy of the residual, not two
    before = {name: r.clone() for name, r in c.residuals.items()}
    c.reduce(torch.randn(na) * 1e4, a, comm, 4).wait()
    c.reduce(torch.randn(numel - na) * 1e4, bucket_b, comm, 4).wait()
    assert c.undo_step()
    assert all(torch.equal(c.residuals[name], r) for name, r in before.items())
