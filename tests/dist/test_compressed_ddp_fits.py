"""2-process gloo tests of CompressedDDPStrategy under Lightning whose fits run in sequence in one pair of launched
rank processes (module fixture ``fits``, each fit in its own directory; a Lightning spawn per fit cost two fresh
Pythons for a fit of a few steps): fits that end by epochs or stop between syncs, uneven epochs, validation between
syncs, the GradScaler's scale, unused, frozen and toggled parameters, overflowed steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_dtrain.strategies import CHECKPOINT_KEY
from tests.dist._compressed_ddp_fit_jobs import (
    EPOCH_UPDATES,
    TOGGLE_RUNS,
    UNUSED_CODECS,
    VALIDATION_RUNS,
    _fit_by_epochs,
    _fit_frozen_between_syncs,
    _fit_resumed_after_an_early_sync,
    _fit_stopped_after_a_step,
    _fit_two_optimizers,
    _fit_uneven,
    _fit_unfrozen_at_resume,
    _fit_validating,
    _fit_with_a_branch,
    _fit_with_a_branch_zeroed_in_place,
)
from tests.dist._compressed_ddp_helpers import (
    WORLD,
    assert_same,
    dumps,
    fit_in_one_group,
    fitted,
    make_net,
    regression_batch,
)
from tests.dist._compressed_ddp_scaler_jobs import (
    OVERFLOW_CODECS,
    OVERFLOW_STEP,
    _fit_init_scale,
    _fit_manual,
    _fit_overflow,
    _fit_scale_record,
)

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_a_fit_that_ends_by_epochs_checkpoints_the_synchronized_model(fits, key):
    """max_epochs=2 of 3 batches: 6 steps, syncs at 4 and at the last step, before that step's checkpoint. Only
    max_steps was checked: a fit by epochs synced in on_train_end, after ModelCheckpoint wrote last.ckpt (rank 0's
    unsynchronized parameters; DiLoCo without its last outer step: 0.22 off in a 2-rank project of 14 steps)."""
    tmp = fitted(fits, _fit_by_epochs, key)
    end = dumps(tmp, "epochs", "end")  # the module's on_train_end runs before the strategy's fallback sync
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    assert end[0]["local_update"]["num_syncs"] == 2 and end[0]["local_update"]["steps_since_sync"] == 0
    last = torch.load(tmp / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    assert_same({k.removeprefix("net."): v for k, v in last["state_dict"].items()}, end[0]["params"], "last.ckpt")


def test_a_checkpoint_written_at_a_stop_between_syncs_is_rank_zeros_and_said_so(fits):
    """A stop decided after step 6 (period 4), no validation: ModelCheckpoint writes last.ckpt at the epoch's end,
    before the strategy's final sync in on_train_end. Its state_dict is rank 0's own parameters (every rank's are in
    lit_dtrain_comm, so a resume continues exactly: test_resume_restores_comm_state_exactly's local_sgd case), not the
    model the module holds after the fit; that went unsaid. Rank 0 now warns, naming the step and the steps since
    the sync."""
    tmp = fitted(fits, _fit_stopped_after_a_step, "local_sgd")
    last = torch.load(tmp / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6 and last[CHECKPOINT_KEY]["local_update"]["steps_since_sync"] == 2
    own = [rank["params"] for rank in last[CHECKPOINT_KEY]["per_rank"]]
    assert_same(last["state_dict"], own[0], "last.ckpt's state_dict")
    assert any(not torch.equal(own[0][k], own[1][k]) for k in own[0])  # between syncs: the ranks differ
    (message,) = torch.load(tmp / "warnings_rank0.pt")
    assert message.startswith("CompressedDDPStrategy: the fit stopped at step 6, 2 steps after the last local_sgd "
                              "sync, and a checkpoint was written at that step"), message
    assert "holds rank 0's own parameters" in message and "trainer.save_checkpoint" in message
    assert torch.load(tmp / "warnings_rank1.pt") == []


def _assert_resumed_as_straight_from_the_state_before_the_sync(tmp: Path, resumed: str, saved: str,
                                                               synced: list[dict] | None) -> None:
    """``resumed`` ended on ``straight``'s weights on every rank; ``saved``'s last.ckpt (step 6, 2 steps after the
    period's sync) holds the synchronized model ``synced`` (each rank's dump after the sync; None: not dumped, the
    state_dict is then only checked not to be rank 0's own) in its state_dict and every rank's own state from before
    the sync that followed in lit_dtrain_comm."""
    straight, end = dumps(tmp, "straight", "end"), dumps(tmp, resumed, "end")
    for rank in range(WORLD):
        assert_same(end[rank]["params"], straight[rank]["params"], f"rank {rank} at step 10")
    last = torch.load(tmp / saved / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    state_dict = {k.removeprefix("net."): v for k, v in last["state_dict"].items()}
    state = last[CHECKPOINT_KEY]
    assert (state["local_update"]["steps_since_sync"], state["local_update"]["num_syncs"]) == (2, 2)
    own = [rank["params"] for rank in state["per_rank"]]
    assert any(not torch.equal(own[0][k], own[1][k]) for k in own[0])  # each rank's own, from before the sync
    if synced is None:
        assert any(not torch.equal(state_dict[k.removeprefix("net.")], own[0][k]) for k in own[0])
        return
    assert_same(synced[0]["params"], synced[1]["params"], "ranks after the sync")
    assert_same(state_dict, synced[0]["params"], "state_dict")


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_a_stop_followed_by_a_validation_resumes_as_the_straight_run(fits, key):
    """A stop after step 6 (period 4; as max_time or EarlyStopping) is followed by Lightning's validation, which
    synchronizes first, and last.ckpt is written after it. That sync is one a fit that did not stop never makes, and
    the resume went on from the synchronized model: 0.0029 off the straight run's weights at step 10 (DiLoCo 0.027, its
    outer step taken early). The checkpoint keeps the synchronized model in its state_dict (what was validated) and
    every rank's state from before that sync for the resume, which now ends on the straight run's weights exactly."""
    tmp = fitted(fits, _fit_resumed_after_an_early_sync, key)
    _assert_resumed_as_straight_from_the_state_before_the_sync(tmp, "resumed", "stopped", dumps(tmp, "stopped", "val6"))


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_an_extended_finished_fit_continues_as_the_straight_run(fits, key):
    """A fit finished at max_steps=6 syncs at its last step (sync_on_last_step; period 4), and its last.ckpt holds
    that model. An extension to 10 went on from it: 0.0029 off a straight 10-step fit (DiLoCo 0.027, its outer step
    taken early). The checkpoint keeps the synchronized model in its state_dict and every rank's state from before
    the sync, and the extension now ends on the straight run's weights exactly. The same for a fit under
    sync_on_last_step=False, which syncs in on_train_end, and the file trainer.save_checkpoint writes after it."""
    tmp = fitted(fits, _fit_resumed_after_an_early_sync, key)
    _assert_resumed_as_straight_from_the_state_before_the_sync(tmp, "extended", "finished",
                                                               dumps(tmp, "finished", "end"))
    _assert_resumed_as_straight_from_the_state_before_the_sync(tmp, "extended_unsynced", "unsynced", None)


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_a_fit_finished_at_a_period_end_keeps_the_synchronized_state(fits, key):
    """A fit finished at max_steps=8 (period 4) syncs there as the straight run does: its checkpoint keeps the
    synchronized state, not the one from before the sync, and the extension to 10 ends on the straight run's weights."""
    tmp = fitted(fits, _fit_resumed_after_an_early_sync, key)
    straight, end = dumps(tmp, "straight", "end"), dumps(tmp, "extended_at_period_end", "end")
    for rank in range(WORLD):
        assert_same(end[rank]["params"], straight[rank]["params"], f"rank {rank} at step 10")
    state = torch.load(tmp / "at_period_end" / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert (state["local_update"]["steps_since_sync"], state["local_update"]["num_syncs"]) == (0, 2)


@pytest.mark.parametrize("key", ["local_sgd", "ddp"])
def test_ranks_whose_epochs_differ_in_length_fail_at_once_naming_them(fits, key):
    """3 batches on rank 0, 4 on rank 1, max_epochs=1, local SGD period 4: rank 0's sync at its last step (3) met
    rank 1's next per-batch SIGTERM broadcast (Lightning's) and both hung until collective_timeout_s. Under
    ``strategy=ddp`` (Lightning's DDPStrategy) rank 0 finished its 3 steps and rank 1 failed in its 4th step's
    all-reduce (gloo's 'Connection closed by peer'). Both ranks now raise a ConfigError at the epoch's first batch,
    before any step."""
    name = f"{_fit_uneven.__name__}_{key}"
    for rank in range(WORLD):
        outcome = torch.load(fits / f"outcomes_rank{rank}.pt", weights_only=False)[name]
        assert outcome.startswith("ConfigError: the ranks' training epochs differ in length (rank 0: 3 batches, its "
                                  "epoch ends after step 3; rank 1: 4 batches, its epoch ends after step 4)"), outcome
    assert not list((fits / name).glob("uneven_end_*"))  # no rank finished its fit


@pytest.mark.parametrize("key, syncs", [
    ("local_sgd", (3, 1)),  # syncs after steps 4, 5 (early: val), 9 (its period)
    # accumulate_grad_batches=2: validations after batches 5, 10, 15 (steps 2, 5, 7); syncs at them and at step 9
    # (the last), all early
    ("diloco", (4, 4)),
])
def test_a_validation_between_syncs_sees_the_synchronized_model(fits, key, syncs):
    """val_check_interval=5 batches, sync_period=4, 9 steps. The validation came 1 step after the sync of step 4: each
    rank validated its own parameters (val/loss a mean over different models) and the checkpoint written after it
    held rank 0's. Now the step before it synchronizes early (with accumulate_grad_batches=2 the validation follows
    batch 5, a batch without a step: it synchronizes after that batch's backward). The module's on_validation_start,
    which Lightning calls before the strategy's, sees the synchronized model too: that batch used to sync in the
    strategy's on_validation_start, so the module's (and callbacks') saw each rank's own parameters."""
    tmp = fitted(fits, _fit_validating, key)
    val_step = 5 // VALIDATION_RUNS[key][1]  # the optimizer steps taken when the validation runs
    at_val = dumps(tmp, "val", f"val{val_step}")
    assert_same(at_val[0]["params"], at_val[1]["params"], "ranks at the validation")
    for start in dumps(tmp, "val", f"valstart{val_step}"):
        assert_same(start["params"], at_val[0]["params"], "the module's on_validation_start")
    net = make_net()
    net.load_state_dict(at_val[0]["params"])
    with torch.no_grad():
        expected = sum(F.mse_loss(net(x), y) for x, y in (regression_batch(10_000, r) for r in range(WORLD))) / WORLD
    torch.testing.assert_close(torch.load(tmp / f"loss{val_step}.pt"), expected)
    saved = torch.load(tmp / "ckpt" / f"step={val_step}.ckpt", weights_only=True)["state_dict"]
    assert_same({k.removeprefix("net."): v for k, v in saved.items()}, at_val[0]["params"], "checkpoint after it")
    end = dumps(tmp, "val", "end")
    assert (end[0]["local_update"]["num_syncs"], end[0]["local_update"]["num_early_syncs"]) == syncs


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> Path:
    """The fits of the tests not marked slow (each reads its own directory)."""
    jobs = [(_fit_by_epochs, key) for key in sorted(EPOCH_UPDATES)] + [(_fit_stopped_after_a_step, "local_sgd")]
    jobs += [(_fit_resumed_after_an_early_sync, key) for key in sorted(EPOCH_UPDATES)]
    jobs += [(_fit_validating, key) for key in VALIDATION_RUNS]
    jobs += [(_fit_scale_record, "topk"), (_fit_manual, "topk"), (_fit_init_scale, "topk")]
    jobs += [(_fit_with_a_branch, key) for key in UNUSED_CODECS]
    jobs.append((_fit_with_a_branch_zeroed_in_place, "sign"))
    jobs += [(_fit_unfrozen_at_resume, key) for key in sorted(EPOCH_UPDATES)]
    jobs.append((_fit_frozen_between_syncs, "local_sgd"))
    jobs += [(_fit_two_optimizers, key) for key in sorted(TOGGLE_RUNS)]
    jobs += [(_fit_overflow, key) for key in OVERFLOW_CODECS]
    # last: without the epoch-length check they fail only at the timeout (or leave the group broken)
    jobs += [(_fit_uneven, "local_sgd"), (_fit_uneven, "ddp")]
    return fit_in_one_group(tmp_path_factory.mktemp("fits"), jobs)


def test_strategy_tells_the_codec_the_gradscaler_scale(fits):
    """16-mixed (here a CPU GradScaler): before each step the strategy passes the scaler's scale to the codec, so its
    error-feedback residual follows the scaler's changes (test_error_feedback_follows_a_gradscaler_change_of_scale).
    Before, the codec was never told: a residual made under 1024 was added at twice its value under 512."""
    tmp = fitted(fits, _fit_scale_record, "topk")
    seen = torch.load(tmp / "scales.pt", weights_only=True)
    assert [s for s, _ in seen] == [1024.0] * 3 + [512.0] * 3  # no overflow here: only the forced halving
    assert all(told == s for s, told in seen), seen
    residual = torch.load(tmp / "scale_end_rank0.pt", weights_only=True)["compressor"]
    assert residual["grad_scale"] == 512.0 and residual["residuals"]


@pytest.mark.parametrize("key", list(UNUSED_CODECS))
def test_a_globally_unused_parameter_keeps_its_residual_until_it_is_used_again(fits, key):
    """find_unused_parameters=True, error-feedback codec: at a step where no rank used ``branch``, DDP leaves its grad
    None and discards what the hook sent for it, so its residual must stay as it was (to be sent at its next use).
    Before, the hook sent part of it and kept the rest, and the sent part was lost: the residual drained."""
    tmp = fitted(fits, _fit_with_a_branch, key)
    for rank in range(WORLD):
        seen = torch.load(tmp / f"branch_rank{rank}.pt", weights_only=True)
        assert [(step, unused) for step, unused, _ in seen] == [(s, s % 3 != 0) for s in range(6)], seen
        for (step, unused, residual), (_, _, before) in zip(seen[1:], seen):
            assert before.abs().sum() > 0, (rank, step)  # the codec left something in it at the step before
            if unused:
                assert torch.equal(residual, before), (rank, step, (residual - before).abs().sum())
            else:
                assert not torch.equal(residual, before), (rank, step)


def test_an_unused_parameter_keeps_its_residual_when_grads_are_zeroed_in_place(fits):
    """As test_a_globally_unused_parameter_keeps_its_residual_until_it_is_used_again, with ``zero_grad(set_to_none=
    False)`` and 2 micro-batches per step (``no_sync``): the unused branch's grad is then zeros, not None, and the
    strategy tells it unused from DDP's used map. Before, its residual drained at every unused step (sign: L1 6.07 ->
    2.97) and what the hook sent of it was lost."""
    tmp = fitted(fits, _fit_with_a_branch_zeroed_in_place, "sign")
    for rank in range(WORLD):
        seen = torch.load(tmp / f"branch_rank{rank}.pt", weights_only=True)
        assert [step for step, _, _ in seen] == list(range(6)), seen
        for (step, _, residual), (_, _, before) in zip(seen[1:], seen):
            assert torch.equal(residual, before) == (step % 3 != 0), (rank, step, (residual - before).abs().sum())


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_a_layer_unfrozen_at_a_resume_trains_on_under_local_updates(fits, key):
    """A layer frozen when the checkpoint was written and trainable in the resumed fit (progressive unfreezing across
    fits, as the docs advise for DiLoCo): it is not among the checkpoint's per-rank parameters nor DiLoCo's outer
    state. Before, both resumes failed at setup with a bare ``KeyError: 'net.0.weight'`` (and DiLoCo's next step
    with 'DiLoCo state has no outer parameters'). Now the layer starts from its loaded value, the same on every
    rank; local SGD's resume is bit for bit a straight fit that unfroze it at that step, and DiLoCo starts its outer
    loop for it at that value with zero momentum."""
    tmp = fitted(fits, _fit_unfrozen_at_resume, key)
    start, end = dumps(tmp, "resumed", "start"), dumps(tmp, "resumed", "end")
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    assert not torch.equal(end[0]["params"]["0.weight"], start[0]["params"]["0.weight"])  # it trained
    if key == "local_sgd":
        for r, straight in enumerate(dumps(tmp, "straight", "end")):
            assert_same(end[r]["params"], straight["params"], f"rank{r} resumed vs straight")
    else:
        assert "net.0.weight" in end[0]["local_update"]["outer_params"]


def test_a_layer_frozen_between_local_sgd_syncs_is_averaged_first(fits):
    """Local SGD averages the trainable parameters only. A layer frozen 2 steps after a sync (each rank had trained
    its own copy) kept each rank's copy for good: the 2-rank fit ended with the ranks' ``net.0`` differing, and its
    checkpoints held rank 0's. Now the first forward with a changed set of trainable parameters syncs those that
    trained until then (an early sync): the ranks end equal, and a resume from a step-2 checkpoint with the layer
    frozen (each rank's own copy restored, then averaged) is bit for bit that straight fit."""
    tmp = fitted(fits, _fit_frozen_between_syncs, "local_sgd")
    straight, resumed = dumps(tmp, "straight", "end"), dumps(tmp, "resumed", "end")
    assert_same(straight[0]["params"], straight[1]["params"], "the straight fit's ranks")
    for r in range(WORLD):
        assert_same(resumed[r]["params"], straight[r]["params"], f"rank{r} resumed vs straight")


@pytest.mark.parametrize("key", sorted(EPOCH_UPDATES))
def test_local_updates_sync_every_optimizers_parameters_under_toggle_optimizer(fits, key):
    """A sync falls in one optimizer's step, where ``toggle_optimizer`` has switched the other's parameters off.
    The rule synced the trainable parameters only: local SGD averaged the toggled optimizer's alone (every sync at
    steps 4, 8 and 12 fell in the discriminator's or the generator's step), so the ranks' other parameters never met
    (0.021 apart at the end), and DiLoCo raised 'the trainable parameters changed since its outer loop started'."""
    tmp = fitted(fits, _fit_two_optimizers, key)
    end = dumps(tmp, "gan", "end")
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    assert end[0]["local_update"]["num_syncs"] == 3
    if key == "diloco":
        assert {"net.g.0.weight", "net.d.weight"} <= set(end[0]["local_update"]["outer_params"])


def test_a_toggled_off_optimizers_residual_waits_for_its_next_step(fits):
    """Under an error-feedback codec and ``find_unused_parameters``, the generator's step leaves the discriminator
    (toggled off) unused: DDP discards what the hook sent for it, and the strategy puts its residual back, but it
    only looked among the ``requires_grad`` parameters, so that residual was sent and lost at every generator step
    (int8: drained to 0 after each). It must be what the discriminator's own step left, until its next step."""
    tmp = fitted(fits, _fit_two_optimizers, "int8_ef")
    end = dumps(tmp, "gan", "end")
    assert_same(end[0]["params"], end[1]["params"], "ranks at the end")
    for rank in range(WORLD):
        after = torch.load(tmp / f"d_residuals_rank{rank}.pt", weights_only=True)  # batch b: D stepped iff b is odd
        for b in range(1, len(after) - 1, 2):
            assert after[b].abs().sum() > 0, (rank, b)
            assert torch.equal(after[b + 1], after[b]), (rank, b)


def test_manual_optimization_tells_the_codec_the_scale_before_its_backward(fits):
    """Under manual optimization the comm hook runs in ``manual_backward``, before the strategy's ``optimizer_step``,
    which was where the codec was told the scale: after the skipped step (scale 1024 -> 512) the hook added the
    residual, made under 1024, to a bucket under 512 (at twice its value), and the late rescale then halved the new
    residual. Every reduce must run under the scale its bucket holds, as under automatic optimization."""
    tmp = fitted(fits, _fit_manual, "topk")
    for rank in range(WORLD):
        told = torch.load(tmp / f"told_rank{rank}.pt", weights_only=True)
        assert {scale for _, _, scale in told} == {1024.0, 512.0}, told  # the skip at step 2 halved it
        assert all(codec == scale for _, codec, scale in told), (rank, told)


def test_a_first_step_under_an_init_scale_fp32_cannot_hold_is_not_taken_for_a_skip(fits):
    """The skip is told by the scale going down in the step. Before the first step the GradScaler reports its
    ``init_scale`` as the Python float given, after it the fp32 it holds: for 1000.1 that is lower, and the strategy
    took the taken first step for a skipped one and undid it in the codec (its residuals back to zero)."""
    tmp = fitted(fits, _fit_init_scale, "topk")
    for rank in range(WORLD):
        first = torch.load(tmp / f"init_scale_rank{rank}.pt", weights_only=True)[0]
        assert first["scale"] == torch.tensor(1000.1, dtype=torch.float32).item() < 1000.1  # taken, not halved
        assert any(r.abs().sum() > 0 for r in first["state"]["residuals"].values()), rank  # the step's residual


@pytest.mark.parametrize("tag", list(OVERFLOW_CODECS))
def test_a_step_skipped_for_one_ranks_overflow_leaves_every_ranks_residuals_as_they_were(fits, tag):
    """16-mixed, several DDP buckets: at one step rank 1's gradient holds an inf and rank 0's is finite. Every rank
    must see the overflow (the GradScaler halves its scale and skips the step on both: parameters unchanged and
    equal), and since the step's gradient is discarded, as in plain DDP, every rank's error-feedback state (worker
    residuals, PowerSGD's Qs, int8_rs's server residuals) must be exactly what it was before the step."""
    tmp = fitted(fits, _fit_overflow, tag)
    ranks = [torch.load(tmp / f"{tag}_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank, seen in enumerate(ranks):
        before, after = seen[OVERFLOW_STEP - 1], seen[OVERFLOW_STEP]
        where = f"{tag} rank {rank}"
        assert (before["scale"], after["scale"]) == (1024.0, 512.0), where  # the scaler skipped the step
        assert_same(after["params"], before["params"], f"{where} params")  # no rank stepped alone
        assert_same(after["params"], ranks[0][OVERFLOW_STEP]["params"], f"{where} params across ranks")
        assert any(r.abs().sum() > 0 for r in before["state"]["residuals"].values()), where
        assert_same(after["state"], before["state"], f"{where} state")
        assert not torch.equal(seen[-1]["params"]["net.0.weight"], after["params"]["net.0.weight"]), where
