"""LossSpikeMonitor's recovery actions, from the fifth hand mutation audit: with ``skip`` the cool-down starts at the
step after the dropped one (its whole hold on steps that train); a cool-down that started on the dropped step itself
passed the suite, one step of the hold lost; so did a rollback that also undid the dropped step's comm state, writing
the spike step's pre-step residuals over the ones the snapshot restored."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.unit._loss_spike_helpers import (  # noqa: F401 - one_thread: its autouse fixture
    Inject,
    LrProbe,
    make_data,
    make_module,
    make_trainer,
    one_thread,
)


def test_with_skip_the_cooldown_holds_on_the_steps_after_the_dropped_one(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["skip", "lr_cooldown"], warmup_steps=3, cooldown_factor=0.1, cooldown_steps=2,
                               cooldown_ramp_steps=1)
    probe = LrProbe()
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor, probe], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events] == [5] and monitor.cooldown_start == 6
    factors = {s: probe.applied[s] / probe.scheduled[s] for s in range(4, 10)}
    # step 5 is dropped (its LR unscaled, no update); steps 6 and 7 hold 0.1, step 8 ramps halfway back
    assert factors == pytest.approx({4: 1.0, 5: 1.0, 6: 0.1, 7: 0.1, 8: 0.55, 9: 1.0})


@pytest.mark.parametrize(("restored", "undone"), [(3, []), (None, ["undo"])])
def test_a_rollback_keeps_the_restored_comm_state_and_only_a_rollback_without_a_snapshot_undoes_the_step(
        restored, undone) -> None:
    """A rollback restores the snapshot's codec state (residuals, Qs); undoing the dropped step after it wrote the
    spike step's pre-step state over the restored one. Without a snapshot the step is dropped as with ``skip``, and
    the comm step is undone (the strategy folded the dropped gradient into its residuals)."""
    monitor = LossSpikeMonitor(actions=["rollback"])
    monitor._rollback = lambda trainer, step: restored
    monitor._saved_scaler = None
    calls: list[str] = []
    trainer = SimpleNamespace(is_global_zero=False, precision_plugin=SimpleNamespace(scaler=None),
                              strategy=SimpleNamespace(undo_comm_step=lambda: calls.append("undo")))
    pending = {"step": 5, "decision": monitor.detector.decide(1.0), "actions": ["rollback"], "indices": [],
               "drop": True, "counted": False}
    monitor._finish_event(trainer, None, pending)
    assert calls == undone and monitor.events[-1]["rolled_back_to"] == restored
