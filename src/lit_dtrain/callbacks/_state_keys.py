"""Checkpoint keys of callback states that survive a change of the callback's arguments.

Lightning stores a callback's ``state_dict`` under its ``state_key``. A key built from the arguments (as
``LossSpikeMonitor`` and ``AdaptiveGradClip`` once did) loses the state on a resume with a retuned threshold:
the spike monitor then forgets which samples it excluded and trains on them again. These callbacks now use the
class name, and :func:`load_state_under_old_key` finds a state that an older checkpoint stored under the
argument-built key (``ClassName{...}``).
"""

from __future__ import annotations

import lightning as L


def load_state_under_old_key(callback: L.Callback, checkpoint: dict) -> None:
    """From ``on_load_checkpoint``: load the one state stored under ``<qualname>{...}`` when none is under the
    callback's own key (Lightning then has nothing to hand to ``load_state_dict``)."""
    states = checkpoint.get("callbacks") or {}
    if callback.state_key in states:
        return
    prefix = type(callback).__qualname__ + "{"
    old = [key for key in states if isinstance(key, str) and key.startswith(prefix)]
    if len(old) == 1:
        callback.load_state_dict(states[old[0]])


def note_stage(callback: L.Callback, stage: str) -> None:
    """From ``setup``: whether the checkpoint state Lightning may load next (``ckpt_path=``) is for a fit."""
    callback._state_for_fit = stage == "fit"


def state_is_for_fit(callback: L.Callback) -> bool:
    """From ``load_state_dict``: False where the state comes from ``trainer.validate()``, ``test()`` or ``predict()``
    with ``ckpt_path=`` (Lightning loads every callback's state there too), which is to be ignored: it replaced the
    state of the fit this object serves (after validate(ckpt_path=<step 2>) of a fit to step 8, a LossSpikeMonitor's
    spikes were 0 and its exclusions gone, AdaptiveGradClip's statistics and WSDScheduler's step those of step 2), and
    a later fit of the same Trainer went on from it (its excluded batch spiked again, train/samples fell from 32 to
    12). A checkpoint's state is a fit's: an evaluation needs only its weights."""
    return getattr(callback, "_state_for_fit", True)
