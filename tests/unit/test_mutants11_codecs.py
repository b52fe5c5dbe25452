"""Exact results of the top-k, sign and quantizing codecs (``strategies/sparsify.py``, ``strategies/quantize.py``)
where single-point mutants passed test_compressors_topk (top-k), _codecs, _error_feedback, test_compressor_properties,
test_compressor_undo_layouts and the three test_mutants5 compressor files (eleventh hand mutation audit)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.strategies import BlockQuantizer, LoopbackCommunicator, NoCompression, ScaledSign, TopK
from lit_dtrain.strategies.compressors import Segment

A, B = Segment("a", 0, 4, (4,)), Segment("b", 4, 4, (4,))
X = torch.tensor([10.0, 9.0, 8.0, 7.0, 1.0, 1.0, 1.0, 2.0])  # top-2 of the whole: 0, 1; top-1 of each half: 0, 7


def resumed_topk(layout: list[list[str]]) -> TopK:
    state = TopK(ratio=0.25).state_dict()
    state["bucket_layout"] = layout
    codec = TopK(ratio=0.25)
    codec.load_state_dict(state)
    return codec


def test_topk_follows_the_saved_buckets_only_at_the_first_step_after_a_resume():
    """The first step after a resume (DDP's one initial bucket) selects within each saved bucket: top-1 of a and of b,
    indices 0 and 7. From the next step on the bucket is the selection group again: top-2 of the whole, 0 and 1
    (keeping the restored layout split every later step too, where DDP did not rebuild its buckets)."""
    codec = resumed_topk([["a"], ["b"]])
    assert sorted(codec.compress(X, [A, B], 5)[1].tolist()) == [0, 7]
    assert sorted(codec.compress(X, [A, B], 6)[1].tolist()) == [0, 1]
    assert codec.state_dict()["bucket_layout"] == [["a", "b"]]


def test_topk_splits_a_bucket_only_when_it_holds_whole_saved_buckets():
    """A bucket holding a and c, where the saved buckets were (a, b) and (c,), is no union of saved buckets: it is one
    selection group, top-2 of the whole (splitting by the saved group of each parameter took 0 and 7)."""
    codec = resumed_topk([["a", "b"], ["c"]])
    c = Segment("c", 4, 4, (4,))
    assert sorted(codec.compress(X, [A, c], 5)[1].tolist()) == [0, 1]
    assert codec.num_calls == 0


def test_a_state_saved_right_after_a_resume_keeps_the_saved_buckets():
    """A checkpoint written after the load and before any step (a validation-only restart) holds the loaded bucket
    layout, so a resume from it splits the first step as the first resume did; an empty layout there selected over
    DDP's initial bucket as a whole."""
    codec = resumed_topk([["a"], ["b"]])
    assert codec.state_dict()["bucket_layout"] == [["a"], ["b"]]
    again = TopK(ratio=0.25)
    again.load_state_dict(codec.state_dict())
    assert sorted(again.compress(X, [A, B], 5)[1].tolist()) == [0, 7]


def test_topk_sums_the_values_two_ranks_sent_for_one_index():
    """Ranks choose their own coordinates; where two chose the same one, the gathered values add up: 2 + 4 at index 3
    (scattering them in rank order kept the last rank's 4)."""
    payloads = [(torch.tensor([1.0, 2.0]), torch.tensor([0, 3], dtype=torch.int32)),
                (torch.tensor([4.0, 8.0]), torch.tensor([3, 5], dtype=torch.int32))]
    out = TopK().decompress_sum(payloads, [Segment("p", 0, 6, (6,))], 6)
    assert out.tolist() == [1.0, 0.0, 0.0, 6.0, 0.0, 8.0]


def test_topk_takes_an_initial_ratio_equal_to_the_ratio():
    """``initial_ratio`` may be anywhere in ``[ratio, 1]``, its lower end included: k stays 10 of 100 throughout."""
    codec = TopK(ratio=0.1, initial_ratio=0.1, ratio_warmup_steps=10)
    assert [codec.k_at(100, step) for step in (0, 5, 10, 20)] == [10, 10, 10, 10]


def test_scaled_sign_sends_a_zero_as_plus_the_scale():
    """A zero entry's bit is set (``x >= 0``): [0, 2, -2, 0] decodes as the scale 1.0 times [1, 1, -1, 1], the residual
    -1 for each zero (``x > 0`` sent them as -1)."""
    x = torch.tensor([0.0, 2.0, -2.0, 0.0])
    seg = [Segment("p", 0, 4, (4,))]
    codec = ScaledSign()
    assert codec.decompress(codec.compress(x, seg, 0), seg, 4).tolist() == [1.0, 1.0, -1.0, 1.0]


def test_a_bf16_topk_payload_that_overflows_leaves_the_residual_as_it_was():
    """bf16 holds at most 3.39e38: a finite fp32 3.4e38 is sent as inf. The bucket comes out non-finite and the step
    is dropped from the residual (0 here), where taking bf16 for a dtype that cannot overflow left -inf in it."""
    codec, seg = TopK(ratio=0.5, value_dtype="bf16"), [Segment("p", 0, 8, (8,))]
    g = torch.zeros(8)
    g[3] = 3.4e38
    assert codec.payload_may_overflow and TopK(value_dtype="fp32").payload_may_overflow is False
    assert not codec.reduce(g.clone(), seg, LoopbackCommunicator(), 0).wait().isfinite().all()
    assert torch.equal(codec.residual_for(seg, g), torch.zeros(8))


def test_int8_noise_of_a_parameter_after_a_whole_block_parameter_does_not_depend_on_the_bucket():
    """A parameter of 32 values is exactly 2 blocks of 16; the parameter after it (20 values) draws its stochastic
    rounding from its own seed, so it decodes identically alone in another bucket. Counting 3 blocks for the 32 values
    shifted the next parameter's noise by one row, so its rounding depended on the bucket."""
    x = torch.randn(52, generator=torch.Generator().manual_seed(1))
    a, b = Segment("a", 0, 32, (32,)), Segment("b", 32, 20, (20,))
    codec = BlockQuantizer(bits=8, block_size=16, stochastic_rounding=True)
    both = codec.decompress(codec.compress(x, [a, b], 3), [a, b], 52)
    alone_seg = [Segment("b", 0, 20, (20,))]
    alone = codec.decompress(codec.compress(x[32:].clone(), alone_seg, 3), alone_seg, 20)
    assert torch.equal(both[32:], alone)


def test_int8_noise_of_an_untiled_buffer_differs_between_the_buckets_of_a_step():
    """Segments that do not tile the buffer give flat blocks with one draw a call, seeded by the call count too: two
    buckets of one step (the same values here) are rounded with different noise, not the same."""
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    seg = [Segment("a", 0, 60, (60,))]
    codec = BlockQuantizer(bits=4, block_size=16, stochastic_rounding=True)
    first = codec.reduce(x.clone(), seg, LoopbackCommunicator(), 0).wait()
    second = codec.reduce(x.clone(), seg, LoopbackCommunicator(), 0).wait()
    assert not torch.equal(first, second)


def test_int8_blocks_follow_the_parameters_given_in_any_order():
    """Segments listed out of buffer order ([b, a] with b at offset 20) still start a block at each parameter: 2 + 2
    scales for 20 + 20 values at block 16, and the same decoded values as in order (taken as given, the first
    parameter's offset broke the walk and the buffer fell back to 3 flat blocks)."""
    x = torch.randn(40, generator=torch.Generator().manual_seed(2))
    a, b = Segment("a", 0, 20, (20,)), Segment("b", 20, 20, (20,))
    codec = BlockQuantizer(bits=8, block_size=16)
    payload = codec.compress(x, [b, a], 0)
    assert payload[0].numel() == 4
    in_order = codec.decompress(codec.compress(x, [a, b], 0), [a, b], 40)
    assert torch.equal(codec.decompress(payload, [b, a], 40), in_order)


def test_an_odd_block_size_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^BlockQuantizer: block_size must be an even number >= 2, got 3$"):
        BlockQuantizer(block_size=3)


def test_no_compression_payload_is_a_copy():
    """``compress`` returns a payload that does not alias the bucket: dividing it (as a generic all-reduce does by the
    world size) leaves the gradient as it was."""
    x = torch.tensor([2.0, 4.0])
    payload = NoCompression().compress(x, [Segment("p", 0, 2, (2,))], 0)
    payload[0].div_(2)
    assert x.tolist() == [2.0, 4.0] and payload[0].tolist() == [1.0, 2.0]
