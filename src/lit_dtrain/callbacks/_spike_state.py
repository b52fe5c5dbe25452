"""The state ``LossSpikeMonitor`` keeps in a checkpoint (under its class name, :mod:`._state_keys`): the detector's
statistics, the raise window's spike steps, the excluded sample indices, the spike count, the current run of
non-finite steps, the cool-down's start and the indices of the latest steps (``exclude_previous_steps``)."""

from __future__ import annotations

import torch


def state_dict(monitor) -> dict:
    return {
        "detector": monitor.detector.state_dict(),
        "window_steps": list(monitor.window.steps),
        "excluded": torch.as_tensor(monitor.excluded, dtype=torch.long),
        "num_spikes": monitor.num_spikes,
        "nonfinite_run": list(monitor.nonfinite_run),
        "cooldown_start": monitor.cooldown_start,
        "recent_indices": [list(x) for x in monitor.recent_indices],
    }


def load_state_dict(monitor, state_dict: dict) -> None:
    monitor.detector.load_state_dict(state_dict["detector"])
    monitor.window.steps = [int(s) for s in state_dict["window_steps"]]
    monitor.excluded = [int(i) for i in torch.as_tensor(state_dict["excluded"]).tolist()]
    monitor.num_spikes = int(state_dict["num_spikes"])
    monitor.nonfinite_run = [int(s) for s in state_dict.get("nonfinite_run", [])]
    monitor.cooldown_start = int(state_dict["cooldown_start"])
    monitor.recent_indices.clear()
    monitor.recent_indices.extend([int(i) for i in x] for x in state_dict["recent_indices"])
