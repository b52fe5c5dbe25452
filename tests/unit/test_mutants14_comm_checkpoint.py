"""``lit_dtrain.strategies.comm_checkpoint``'s resume on another number of ranks (``elastic_rank_entry``), exact
where the fourteenth hand mutation audit's single-point mutants passed the resume tests: what counts as the same
state on every rank (nested keys, list lengths, tensor shapes, a value one rank lacks), and the mean residual (fp32
sums, a rank without a parameter adding zero, the saved dtype kept)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.strategies.comm_checkpoint import UnsplittableStateError, elastic_rank_entry


def _state(*compressors: dict) -> dict:
    per_rank = [{"counters": {"step": 4}, "compressor": c, "local_update": None} for c in compressors]
    return {"world_size": len(per_rank), "local_update": None, "per_rank": per_rank}


def _q(**qs) -> dict:
    return {"name": "powersgd", "num_calls": 4, "q_memory": qs}


@pytest.mark.parametrize(("rank0", "rank1", "differ"), [
    # rank 1 holds a Q that rank 0 lacks (comparing rank 0's keys alone called them the same)
    (_q(w=torch.ones(2, 2)), _q(w=torch.ones(2, 2), v=torch.ones(3, 1)), "q_memory"),
    # the same 4 values in another shape
    (_q(w=torch.arange(4.0).view(2, 2)), _q(w=torch.arange(4.0).view(4, 1)), "q_memory"),
    # a bucket layout one bucket longer on rank 1 (map() over both stops at the shorter)
    ({"name": "topk", "buckets": [[0, 4]]}, {"name": "topk", "buckets": [[0, 4], [4, 8]]}, "buckets"),
    # a tensor that rank 1 does not hold at all: named, not AttributeError on None.shape
    ({"name": "fp16", "scale": torch.tensor(2.0)}, {"name": "fp16"}, "scale"),
])
def test_state_that_differs_between_the_ranks_in_any_part_is_refused_by_name(rank0, rank1, differ):
    with pytest.raises(UnsplittableStateError, match=rf"the compressor state \['{differ}'\] differs between rank 0 "
                                                     r"and rank 1: .* resume on the 2 ranks that wrote it"):
        elastic_rank_entry(_state(rank0, rank1), 1)


def test_equal_replicated_state_is_kept_as_rank_0_wrote_it():
    q = _q(w=torch.arange(4.0).view(2, 2), v=torch.ones(3, 1))
    kept, notes = elastic_rank_entry(_state(q, _q(w=torch.arange(4.0).view(2, 2), v=torch.ones(3, 1))), 3)
    assert kept["compressor"]["q_memory"] is q["q_memory"] and kept["compressor"]["num_calls"] == 4 and notes == []


def test_a_rank_without_a_residual_adds_zero_to_the_mean_over_every_saved_rank():
    """Rank 1 never held an error-feedback residual for ``b``: the gradient still owed is rank 0's ``b`` over the 2
    saved ranks (dividing by the ranks that hold it gave rank 0's whole, twice what the 2-rank run owed)."""
    rank0 = {"name": "int8", "residuals": {"w": torch.tensor([2.0, 4.0]), "b": torch.tensor([6.0])}}
    rank1 = {"name": "int8", "residuals": {"w": torch.tensor([4.0, 8.0])}}
    kept, _ = elastic_rank_entry(_state(rank0, rank1), 1)
    assert torch.equal(kept["compressor"]["residuals"]["w"], torch.tensor([3.0, 6.0]))
    assert torch.equal(kept["compressor"]["residuals"]["b"], torch.tensor([3.0]))


def test_half_precision_residuals_are_summed_in_fp32_and_kept_in_their_dtype():
    """bf16 residuals 256, 1 and 1 on 3 ranks: summed in fp32, 258 / 3 is 86.0 in bf16; summed in bf16 (8
    significant bits), 256 + 1 + 1 stays 256 and the mean is 85.5. The mean is stored as bf16, the codec's dtype."""
    held = [256.0, 1.0, 1.0]
    ranks = [{"name": "int8", "residuals": {"w": torch.tensor([v], dtype=torch.bfloat16)}} for v in held]
    kept, _ = elastic_rank_entry(_state(*ranks), 1)
    mean = kept["compressor"]["residuals"]["w"]
    assert mean.dtype == torch.bfloat16
    assert mean.item() == torch.tensor([258.0 / 3]).to(torch.bfloat16).item() == 86.0
