"""``lit_dtrain.strategies.comm_checkpoint``'s messages exact where the fifteenth hand mutation audit's single-point
mutants passed the resume tests: a refused resume names only the parts of the preset that differ, and the warning
of another strategy's resume names each piece of state it drops (every rank's own parameters under local updates,
PowerSGD's warm-start Qs, the error-feedback residuals) and what is lost with it."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies import CompressedDDPStrategy
from lit_dtrain.strategies.comm_checkpoint import (
    CHECKPOINT_KEY,
    UnsplittableStateError,
    dropped_comm_state_message,
    elastic_rank_entry,
    rank_entry,
    refuse_another_preset,
    warm_start_rank_notes,
    warn_if_comm_state_dropped,
    without_unapplied_residuals,
)


def test_a_refused_resume_names_only_what_differs(tmp_path):
    """int8 resumed under topk: the compressors differ and the local-update rules (None and None) do not; listing
    every part said 'local-update rule None (this run: None)' as if that were a reason too."""
    path = tmp_path / "last.ckpt"
    torch.save({CHECKPOINT_KEY: CompressedDDPStrategy(compressor="int8").comm_state_dict()}, path)
    with pytest.raises(ConfigError) as caught:
        refuse_another_preset(CompressedDDPStrategy(compressor="topk"), path)
    assert str(caught.value).startswith(f"{path}: its comm state was written by compressor 'int8' (this run: 'topk')."
                                        " Resume it with the preset that wrote it (strategy=ddp_compressed/int8)")


def _dropped(state: dict) -> str:
    return dropped_comm_state_message({CHECKPOINT_KEY: state}, SingleDeviceStrategy(device="cpu"))


def test_a_local_sgd_state_with_every_ranks_parameters_names_them_and_the_steps_since_the_sync():
    rank = {"counters": {}, "compressor": None, "local_update": None, "params": {"w": torch.ones(2)},
            "optimizer_states": [{}]}
    state = {"world_size": 2, "per_rank": [rank, rank],
             "local_update": {"name": "local_sgd", "steps_since_sync": 3, "period": 4}}
    assert _dropped(state).startswith(
        f"{CHECKPOINT_KEY}: the checkpoint was written under CompressedDDPStrategy (strategy=ddp_compressed/local_sgd, "
        "2 ranks) and holds its local_sgd counters and period, every rank's own parameters and optimizer state; this "
        "run's SingleDeviceStrategy does not read that state, so it is dropped: every rank resumes from rank 0's "
        "parameters and optimizer state, which are not the synchronized model (3 steps since the last sync).")


def test_a_powersgd_state_names_its_residuals_and_warm_start_and_the_gradient_lost():
    codec = {"name": "powersgd", "residuals": {"w": torch.ones(4, 2)}, "q_memory": {"w": torch.ones(2, 1)}}
    state = {"world_size": 2, "local_update": None,
             "per_rank": [{"counters": {}, "compressor": codec, "local_update": None}] * 2}
    assert _dropped(state).startswith(
        f"{CHECKPOINT_KEY}: the checkpoint was written under CompressedDDPStrategy (strategy=ddp_compressed/powersgd, "
        "2 ranks) and holds its error-feedback residuals of 2 ranks, PowerSGD Q matrices (its warm start), comm "
        "counters; this run's SingleDeviceStrategy does not read that state, so it is dropped: the gradient that "
        "compression held back in the residuals is never applied.")


def test_the_message_of_dropped_state_is_warned_and_returned_and_nothing_is_said_of_none(recwarn):
    checkpoint = {CHECKPOINT_KEY: CompressedDDPStrategy(compressor="int8").comm_state_dict()}
    plain = SingleDeviceStrategy(device="cpu")
    message = warn_if_comm_state_dropped(checkpoint, plain, "x.ckpt")
    assert message == dropped_comm_state_message(checkpoint, plain, "x.ckpt")
    assert [str(w.message) for w in recwarn] == [message]
    recwarn.clear()
    assert warn_if_comm_state_dropped({}, plain) is None and len(recwarn) == 0


def test_a_resume_on_another_number_of_ranks_keeps_no_codec_state_where_none_was_written():
    """Local SGD writes no compressor state and no pseudo-gradient compressor state: the entry of a resume on 1 rank
    holds None for both (an empty dict was a compressor state that the load refused, 'does not match this
    strategy's compressor None'), rank 0's counters and optimizer state, and the mean of the ranks' parameters."""
    ranks = [{"counters": {"step": r}, "compressor": None, "local_update": None,
              "params": {"w": torch.tensor([1.0 + 2 * r])}, "optimizer_states": [{"r": r}]} for r in range(2)]
    state = {"world_size": 2, "per_rank": ranks, "local_update": {"name": "local_sgd", "steps_since_sync": 1}}
    entry, notes = elastic_rank_entry(state, 1)
    assert entry["compressor"] is None and entry["local_update"] is None
    assert entry["counters"] == {"step": 0} and entry["optimizer_states"] == [{"r": 0}]
    assert torch.equal(entry["params"]["w"], torch.tensor([2.0]))
    assert notes == ["every rank starts from the mean of the 2 ranks' parameters, which differ 1 step after the last "
                     "sync (the point a sync now would move them to)",
                     "every rank takes rank 0's optimizer state (rank 1's is dropped)"]


def _local_sgd_ranks(n: int) -> list[dict]:
    return [{"counters": {}, "compressor": None, "local_update": None, "params": {"w": torch.ones(1)},
             "optimizer_states": [{"r": r}]} for r in range(n)]


@pytest.mark.parametrize(("saved", "optimizer_note"), [
    (1, None),  # nothing dropped ('those of ranks 1-0 are dropped' was said of a 1-rank checkpoint)
    (2, "every rank takes rank 0's optimizer state (rank 1's is dropped)"),
    (3, "every rank takes rank 0's optimizer state (those of ranks 1-2 are dropped)"),
])
def test_the_optimizer_states_dropped_are_those_of_every_rank_but_rank_0(saved, optimizer_note):
    state = {"world_size": saved, "per_rank": _local_sgd_ranks(saved), "local_update": {"name": "local_sgd"}}
    entry, notes = elastic_rank_entry(state, 4)
    assert entry["optimizer_states"] == [{"r": 0}]
    assert notes == ([optimizer_note] if optimizer_note else [])  # equal parameters: no note of their mean


def test_a_checkpoint_holding_fewer_ranks_than_it_says_is_refused():
    state = {"world_size": 3, "per_rank": _local_sgd_ranks(2), "local_update": {"name": "local_sgd"}}
    with pytest.raises(ValueError, match=rf"^{CHECKPOINT_KEY}: the checkpoint says 3 ranks but holds the state of 2 "
                                         r"\(a damaged file\?\)$"):
        elastic_rank_entry(state, 1)


def test_the_warning_of_a_resume_on_another_number_of_ranks_names_every_change():
    ranks = _local_sgd_ranks(2)
    ranks[1]["params"] = {"w": torch.full((1,), 3.0)}
    state = {"world_size": 2, "per_rank": ranks, "local_update": {"name": "local_sgd", "steps_since_sync": 2}}
    assert rank_entry(state, 0, 2) == (ranks[0], None)
    assert rank_entry(state, 0, 1)[1] == (
        f"{CHECKPOINT_KEY}: the checkpoint was written on 2 ranks and this run has 1: the replicated codec and "
        "local-update state and rank 0's comm counters are kept; every rank starts from the mean of the 2 ranks' "
        "parameters, which differ 2 steps after the last sync (the point a sync now would move them to); every rank "
        "takes rank 0's optimizer state (rank 1's is dropped). A resume on the same number of ranks keeps everything")


def test_the_norm_of_dropped_residuals_counts_the_server_residuals_of_the_same_parameter():
    """int8_rs resumed with error_feedback=False drops its residual (3) and its server residual (4) of ``w``: norm
    5 (keyed by parameter name alone, the server residual replaced the residual, and the warning said 4)."""
    from lit_dtrain.strategies.registry import build_compressor

    codec = build_compressor({"name": "int8_rs", "error_feedback": False})
    saved = {"name": "int8_rs", "residuals": {"w": torch.tensor([3.0])}, "server_residuals": {"w": torch.tensor([4.0])}}
    entry, notes = without_unapplied_residuals({"compressor": saved, "local_update": None}, codec, None)
    assert entry["compressor"] == {"name": "int8_rs", "residuals": {}, "server_residuals": {}}
    assert notes == [f"{CHECKPOINT_KEY}: the checkpoint's int8_rs error-feedback residuals (rank 0's norm 5: the "
                     "gradient compression held back) are dropped, since this run's int8_rs codec has "
                     "error_feedback=False: that gradient is never applied. To keep it, resume with "
                     "strategy.compressor.error_feedback=true"]


def test_a_powersgd_resumed_without_warm_start_at_another_rank_is_not_told_that_its_qs_restart():
    """Without warm start every step draws its Qs afresh, whatever the checkpoint holds: nothing restarts."""
    from lit_dtrain.strategies.registry import build_compressor

    saved = {"name": "powersgd", "matrix_approximation_rank": 4, "q_memory": {"w": torch.ones(8, 4)}}
    cold = build_compressor({"name": "powersgd", "matrix_approximation_rank": 2, "warm_start": False})
    warm = build_compressor({"name": "powersgd", "matrix_approximation_rank": 2})
    assert warm_start_rank_notes({"compressor": saved}, cold, None) == []
    assert len(warm_start_rank_notes({"compressor": saved}, warm, None)) == 1


def test_a_checkpoint_from_before_the_rank_was_saved_gives_it_by_its_widest_q():
    """Qs of widths 4 and 2 (a matrix 2 wide): the rank was 4, and at rank 2 the 4-wide Q restarts."""
    from lit_dtrain.strategies.registry import build_compressor

    saved = {"name": "powersgd", "q_memory": {"w": torch.ones(8, 4), "v": torch.ones(2, 2)}}
    codec = build_compressor({"name": "powersgd", "matrix_approximation_rank": 2})
    (note,) = warm_start_rank_notes({"compressor": saved}, codec, None, {"w": (8, 8), "v": (2, 2)})
    assert "(2 matrices) are of rank 4 and this run's strategy.compressor.matrix_approximation_rank is 2: 1 of them " \
           "restart (the other 1, of matrices at most 2 wide, fit both ranks and are kept)" in note


@pytest.mark.parametrize(("q", "shapes"), [
    (torch.ones(2, 2), {"w": (8, 2)}),  # m = 2 rows: (2, min(8, 2, 4)) at rank 4 as at rank 2
    (torch.ones(4, 4), None),  # no shapes: m = 4 = the saved rank, so min(n, m) = 4 = its width, within rank 8
])
def test_a_q_that_fits_the_new_rank_is_kept_without_a_word(q, shapes):
    from lit_dtrain.strategies.registry import build_compressor

    saved = {"name": "powersgd", "matrix_approximation_rank": q.shape[1], "q_memory": {"w": q}}
    codec = build_compressor({"name": "powersgd", "matrix_approximation_rank": 2 * q.shape[1]})
    assert warm_start_rank_notes({"compressor": saved}, codec, None, shapes) == []


def test_codec_state_that_only_rank_1_holds_is_refused_by_name():
    codecs = [{"name": "fp16", "num_calls": 4}, {"name": "fp16", "num_calls": 4, "scale": torch.tensor(2.0)}]
    state = {"world_size": 2, "local_update": None,
             "per_rank": [{"counters": {}, "compressor": c, "local_update": None} for c in codecs]}
    with pytest.raises(UnsplittableStateError, match=r"the compressor state \['scale'\] differs between rank 0 and "
                                                     r"rank 1"):
        elastic_rank_entry(state, 1)


def test_a_codec_resumed_without_error_feedback_from_a_state_without_residuals_is_told_nothing():
    from lit_dtrain.strategies.registry import build_compressor

    codec = build_compressor({"name": "int8", "error_feedback": False})
    entry, notes = without_unapplied_residuals({"compressor": {"name": "int8", "residuals": {}}}, codec, None)
    assert entry["compressor"] == {"name": "int8", "residuals": {}} and notes == []
