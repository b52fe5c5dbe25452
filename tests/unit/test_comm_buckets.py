"""``lit_dtrain.strategies.comm``'s pieces that need no process group: the segments of a DDP bucket, read from where
each gradient view sits in its flat buffer, and the communication time of overlapping collectives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_dtrain.strategies.comm import _union_seconds, bucket_segments


def _bucket(buffer, grads, params):
    return SimpleNamespace(buffer=lambda: buffer, gradients=lambda: grads, parameters=lambda: params)


def test_a_buckets_segments_are_where_its_gradient_views_sit():
    memory = torch.zeros(16)
    buffer, params = memory[:8], [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(4))]
    names = {id(params[0]): "w", id(params[1]): "b"}
    segments = bucket_segments(_bucket(buffer, [buffer[4:8], buffer[:4].view(2, 2)], params[::-1]), names)
    assert [(s.name, s.offset, s.numel, s.shape) for s in segments] == [("b", 4, 4, (4,)), ("w", 0, 4, (2, 2))]


def test_a_parameter_of_zero_elements_sits_where_the_one_before_it_ends():
    """DDP's gradient of a zero-element parameter (a layer of width 0) holds no data (data_ptr 0, not in the buffer):
    every codec's and local update's fit of such a model (which plain DDP trains) failed with 'not a view into the
    bucket buffer'. It is an empty segment where the one before it ends, so the segments still tile the buffer."""
    memory = torch.zeros(16)
    buffer = memory[:8]
    params = [torch.nn.Parameter(torch.zeros(0, 8)), torch.nn.Parameter(torch.zeros(4)),
              torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(4))]
    names = {id(p): name for p, name in zip(params, ["e0", "a", "e1", "b"])}
    grads = [torch.zeros(0, 8), buffer[4:8], torch.zeros(0), buffer[:4]]
    segments = bucket_segments(_bucket(buffer, grads, params), names)
    assert [(s.name, s.offset, s.numel, s.shape) for s in segments] == [
        ("e0", 0, 0, (0, 8)), ("a", 4, 4, (4,)), ("e1", 8, 0, (0,)), ("b", 0, 4, (4,))]


def test_a_gradient_outside_its_bucket_buffer_is_refused():
    """A gradient that is no view into the buffer (here: past its end, in the same memory) would be compressed as
    the buffer's values at a wrong offset: refused, though the sizes add up."""
    memory = torch.zeros(16)
    buffer, params = memory[:8], [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    names = {id(params[0]): "a", id(params[1]): "b"}
    with pytest.raises(RuntimeError, match="not a view into the bucket buffer"):
        bucket_segments(_bucket(buffer, [buffer[:4], memory[10:14]], params), names)


def test_overlapping_collectives_count_their_time_once():
    assert _union_seconds([(1.0, 3.0), (0.0, 2.0), (5.0, 6.0), (5.5, 5.75)]) == 4.0
    assert _union_seconds([]) == 0.0
