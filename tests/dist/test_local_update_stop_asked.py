"""2-process gloo tests of which local-update sync a stop's validation keeps the state from before
(``_comm_state.kept_for_a_resume``): only one that runs because of the stop. A stop asked before an optimizer step's
end (in ``training_step``) was synced in that step without keeping (a resume went on from the sync: 0.0029 off the
straight run, DiLoCo 0.027), and a stop asked where a validation falls anyway (``val_check_interval``) kept the state
from before a sync the straight run makes too (0.011 off). Each resumed fit must end on its reference bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist._compressed_ddp_helpers import WORLD, assert_same, dumps, fit_in_one_group, fitted
from tests.dist._stop_asked_jobs import (
    _fit_manual_stopped_in_step,
    _fit_stopped_at_a_scheduled_validation,
    _fit_stopped_in_step,
)
from tests.dist.test_local_update_kept_state import _kept_counts

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one pair of rank processes, 13 short fits: ~40 s on 2 shared cores


@pytest.fixture(scope="module")
def asked(tmp_path_factory) -> Path:
    jobs = [(_fit_stopped_in_step, "local_sgd"), (_fit_stopped_in_step, "diloco"),
            (_fit_manual_stopped_in_step, "local_sgd"), (_fit_stopped_at_a_scheduled_validation, "local_sgd")]
    return fit_in_one_group(tmp_path_factory.mktemp("asked"), jobs)


def _assert_same_end(tmp: Path, tag: str, reference: str) -> None:
    end, ref = dumps(tmp, tag, "end"), dumps(tmp, reference, "end")
    for rank in range(WORLD):
        assert_same(end[rank]["params"], ref[rank]["params"], f"{tag} against {reference}: rank {rank}")


@pytest.mark.parametrize("key", ["local_sgd", "diloco"])
def test_a_stop_asked_in_training_step_keeps_the_state_from_before_its_sync(asked, key):
    """Asked to stop in step 6's training_step (period 4), the fit validates after step 6 only because of the stop;
    that step's optimizer step syncs for it. Its last.ckpt keeps each rank's state from before that sync (2 steps
    since the last sync), and a resume to 10 ends on the straight run's weights (before: 0.0029 off, DiLoCo 0.027)."""
    tmp = fitted(asked, _fit_stopped_in_step, key)
    assert _kept_counts(tmp / "stopped" / "last.ckpt") == (6, 2, 2)
    _assert_same_end(tmp, "resumed", "straight")


def test_a_stop_asked_in_a_manual_training_step_keeps_the_state_from_before_its_sync(asked):
    """As above under manual optimization, whose batch syncs after training_step returns."""
    tmp = fitted(asked, _fit_manual_stopped_in_step, "local_sgd")
    assert _kept_counts(tmp / "stopped" / "last.ckpt") == (6, 2, 2)
    _assert_same_end(tmp, "resumed", "straight")


def test_a_stop_where_a_validation_falls_anyway_keeps_the_synchronized_state(asked):
    """Accumulation 2, a validation after batch 5 (mid-accumulation, step 2) in every fit; one fit also asked to stop
    there. That validation's sync is one the straight run makes, so both step-2 checkpoints hold the synchronized
    state, and resumes from them end the same (before: the stopped fit's kept the state from before, 0.011 off)."""
    tmp = fitted(asked, _fit_stopped_at_a_scheduled_validation, "local_sgd")
    assert _kept_counts(tmp / "stopped" / "step=2.ckpt") == _kept_counts(tmp / "straight" / "step=2.ckpt") == (2, 0, 1)
    _assert_same_end(tmp, "from_stopped", "from_straight")
