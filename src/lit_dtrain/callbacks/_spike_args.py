"""The argument checks of :class:`~lit_dtrain.callbacks.loss_spike.LossSpikeMonitor`: when it is built, and when a fit
starts (what the run must offer its actions)."""

from __future__ import annotations

from collections.abc import Sequence

from lit_dtrain.callbacks._args import check_arg, finite_number, is_path, whole_at_least
from lit_dtrain.callbacks.adaptive_grad_clip import is_sharded
from lit_dtrain.utils.args import is_flag

ACTIONS = ("log", "skip", "rollback", "lr_cooldown", "raise")


def check_args(actions: Sequence[str] | str, *, grad_z_threshold, check_grad, snapshot_every, snapshot_keep,
               rollback_min_age, exclude_previous_steps, cooldown_factor, cooldown_steps, cooldown_ramp_steps,
               raise_after, raise_window, warmup_steps, max_nonfinite, path) -> list[str]:
    """Raise ``ValueError`` naming the first bad argument; returns ``actions`` as a list of strings."""
    # null or a number: "TypeError: 'NoneType' object is not iterable" in Hydra's wrapper
    check_arg("LossSpikeMonitor", "actions", actions, lambda v: isinstance(v, str) or iter(v) is not None,
              f"a non-empty subset of {ACTIONS}")
    actions = [str(a) for a in ([actions] if isinstance(actions, str) else actions)]
    unknown = [a for a in actions if a not in ACTIONS]
    if unknown or not actions:
        raise ValueError(f"LossSpikeMonitor: actions must be a non-empty subset of {ACTIONS}, got {actions}")
    # a flag given as a string in a project of one's own (check_grad="false") was truthy: the grad check stayed on
    check_arg("LossSpikeMonitor", "check_grad", check_grad, is_flag, "True or False")
    if grad_z_threshold is not None and not check_grad:
        raise ValueError("LossSpikeMonitor: grad_z_threshold needs check_grad=True")
    ints = {"snapshot_every": snapshot_every, "snapshot_keep": snapshot_keep, "cooldown_steps": cooldown_steps,
            "raise_after": raise_after, "raise_window": raise_window}
    for name, value in ints.items():
        check_arg("LossSpikeMonitor", name, value, whole_at_least(1), "an integer >= 1")
    for name, value in (("rollback_min_age", rollback_min_age), ("exclude_previous_steps", exclude_previous_steps),
                        ("cooldown_ramp_steps", cooldown_ramp_steps)):
        check_arg("LossSpikeMonitor", name, value, whole_at_least(0), "an integer >= 0")
    if "rollback" in actions and int(rollback_min_age) >= int(snapshot_every) * int(snapshot_keep):
        # the oldest of snapshot_keep snapshots, one every snapshot_every steps, is at most keep * every - 1
        # steps old (older only where spikes dropped the snapshots after it)
        raise ValueError(
            f"LossSpikeMonitor: rollback_min_age ({rollback_min_age}) must be < snapshot_every * snapshot_keep "
            f"({snapshot_every} * {snapshot_keep}): the kept snapshots are younger than that, so a rollback would "
            f"restore a newer one than asked; lower rollback_min_age, or raise snapshot_keep or snapshot_every"
        )
    # checked here too, so that the message names this argument (RobustStat's is ``warmup``)
    check_arg("LossSpikeMonitor", "warmup_steps", warmup_steps, whole_at_least(2), "an integer >= 2")
    check_arg("LossSpikeMonitor", "max_nonfinite", max_nonfinite, whole_at_least(1, none_ok=True),
              "an integer >= 1 or None")
    check_arg("LossSpikeMonitor", "cooldown_factor", cooldown_factor, finite_number(lambda v: 0.0 < v <= 1.0),
              "in (0, 1]")
    # path=5 appended the events to file descriptor 5, path=0 (falsy) wrote <default_root_dir>/spikes.jsonl
    check_arg("LossSpikeMonitor", "path", path, lambda v: v is None or is_path(v), "a file path or None")
    return actions


def check_fit(trainer, pl_module, actions: Sequence[str]) -> None:
    """Refuse a fit whose module or strategy the ``actions`` cannot work with."""
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            f"LossSpikeMonitor needs automatic optimization, but {type(pl_module).__name__} sets "
            f"automatic_optimization = False: it decides in on_before_optimizer_step once per step and drops or "
            f"restores that one optimizer's step, which manual optimization (several optimizer.step calls per "
            f"batch) does not give. Remove the callback, or use automatic optimization with one optimizer"
        )
    if "rollback" in actions and is_sharded(trainer.strategy):
        from lit_dtrain.errors import ConfigError  # (train.py prints a ConfigError as one line, not a traceback)

        raise ConfigError(f"LossSpikeMonitor action 'rollback' snapshots full state dicts and does not support "
                          f"sharded strategies ({type(trainer.strategy).__name__}): use 'skip' "
                          f"(callbacks.loss_spike.actions=[log,skip]), or strategy=ddp")
