"""2-process gloo tests of the state a local-update rule keeps from before a sync that a fit going on past that step
never makes (``_comm_state.kept_for_a_resume``: a stop's validation, the fit's last step, ``on_train_end``), in the
cases test_compressed_ddp_fits.py's do not reach: manual optimization, a stop held off by ``min_steps``, a validation
at the fit's last step, a pseudo-gradient codec. The fits run in one pair of launched rank processes
(module fixture ``kept``); each resumed or extended fit must end on the straight fit's weights bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_dtrain.strategies import CHECKPOINT_KEY
from tests.dist._compressed_ddp_helpers import WORLD, assert_same, dumps, fit_in_one_group, fitted
from tests.dist._kept_state_jobs import (
    _fit_held_mid_accumulation,
    _fit_manual,
    _fit_min_steps,
    _fit_pseudo_gradient_codec,
    _fit_validated_last_step,
)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Path:
    jobs = [(_fit_manual, "local_sgd"), (_fit_min_steps, "local_sgd"),
            (_fit_validated_last_step, "local_sgd"), (_fit_pseudo_gradient_codec, "diloco"),
            (_fit_held_mid_accumulation, "local_sgd")]
    return fit_in_one_group(tmp_path_factory.mktemp("kept"), jobs)


def _assert_ends_as_straight(tmp: Path, *tags: str) -> None:
    straight = dumps(tmp, "straight", "end")
    for tag in tags:
        end = dumps(tmp, tag, "end")
        for rank in range(WORLD):
            assert_same(end[rank]["params"], straight[rank]["params"], f"{tag}: rank {rank} at step 10")


def _kept_counts(path: Path) -> tuple[int, int, int]:
    """(global_step, steps_since_sync, num_syncs) of a checkpoint's local-update state."""
    ckpt = torch.load(path, weights_only=True)
    state = ckpt[CHECKPOINT_KEY]["local_update"]
    return ckpt["global_step"], state["steps_since_sync"], state["num_syncs"]


def test_manual_optimization_resumes_and_extends_as_the_straight_run(kept):
    """Under manual optimization the fit's last batch syncs after its training_step (not in its optimizer step): a fit
    finished at step 6 (period 4) and extended to 10 must go on from each rank's state from before that sync, as one
    stopped after step 6 (Lightning's validation syncs) and resumed does. Without the kept state the extension ended
    0.0029 off the straight run's weights (local SGD)."""
    tmp = fitted(kept, _fit_manual, "local_sgd")
    _assert_ends_as_straight(tmp, "resumed", "extended")
    for saved in ("stopped", "finished"):
        assert _kept_counts(tmp / saved / "last.ckpt") == (6, 2, 2)


def test_a_validation_at_the_last_step_keeps_the_synchronized_state(kept):
    """A fit finished at step 6 with a validation every 6 batches: its last step's sync is the validation's, which a
    longer fit makes too, so its checkpoint keeps the synchronized state (kept from before it, the extension to 10
    ended 0.0029 off the straight run's weights)."""
    tmp = fitted(kept, _fit_validated_last_step, "local_sgd")
    _assert_ends_as_straight(tmp, "extended")
    assert _kept_counts(tmp / "finished" / "last.ckpt") == (6, 0, 2)


def test_a_stop_held_off_by_min_steps_keeps_only_the_stops_own_sync(kept):
    """Asked to stop after step 2 under min_steps=7, the fit trains on: its validation at step 5 syncs as the straight
    run's does, and its checkpoint keeps that synchronized state (kept from before it, a resume to 10 ended 0.0036
    off); the stop's own validation after step 7 syncs where the straight run does not, and a resume from its
    checkpoint goes on from the state before that sync. Both end on the straight run's weights."""
    tmp = fitted(kept, _fit_min_steps, "local_sgd")
    _assert_ends_as_straight(tmp, "from5", "from7")
    assert _kept_counts(tmp / "held" / "step=5.ckpt") == (5, 0, 2)
    assert _kept_counts(tmp / "held" / "last.ckpt") == (7, 2, 3)


def test_a_pseudo_gradient_codec_resumes_from_its_residuals_before_the_stops_sync(kept):
    """DiLoCo with an error-feedback int8 pseudo-gradient codec, stopped after step 6 (period 4): the stop's validation
    syncs, which moves the codec's rank-local residuals; the resume goes on from each rank's residuals from before it
    and ends on the straight run's weights."""
    tmp = fitted(kept, _fit_pseudo_gradient_codec, "diloco")
    _assert_ends_as_straight(tmp, "resumed")
    ckpt = torch.load(tmp / "stopped" / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    synced = dumps(tmp, "stopped", "val6")
    for rank in range(WORLD):
        residuals = ckpt["per_rank"][rank]["local_update"]["residuals"]
        assert any(not torch.equal(residuals[k], synced[rank]["local_update_rank"]["residuals"][k]) for k in residuals)


def test_a_validation_while_min_steps_holds_a_stop_off_keeps_the_synchronized_state(kept):
    """Accumulation 2, a validation after batch 5 (mid-accumulation: the strategy's on_validation_start syncs), a stop
    asked after step 1 under min_steps=6. That validation is one the fit makes anyway, but trainer.should_stop was
    set, so its checkpoint kept the state from before its sync: resumed to 8, it ended 0.011 off a resume from the
    same checkpoint of a fit never asked to stop (identical until then). Now the two end bit for bit the same."""
    tmp = fitted(kept, _fit_held_mid_accumulation, "local_sgd")
    assert _kept_counts(tmp / "held" / "step=2.ckpt") == (2, 0, 1)
    assert _kept_counts(tmp / "held" / "step=6.ckpt") == (6, 1, 3)  # the stop's own validation keeps
    held, straight = dumps(tmp, "from_held2", "end"), dumps(tmp, "from_straight2", "end")
    for rank in range(WORLD):
        assert_same(held[rank]["params"], straight[rank]["params"], f"rank {rank} at step 8")
