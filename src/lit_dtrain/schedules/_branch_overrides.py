"""The command line's values for the keys a WSD decay branch sets (``trainer.max_steps``, the schedule's
``total_steps``, ``decay_steps``, ``decay_fraction``): one given with another value than the branch's is refused
(:func:`refuse_given_branch_keys`, from ``workflows.apply_decay_branch``), where the branch replaced it without a
word."""

from __future__ import annotations

import re
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from lit_dtrain.errors import ConfigError

RELATIVE = object()  # an override's value relative to its node, which only the config resolves


class Interpolation(NamedTuple):
    """An override's value that is another key's (``'scheduler.total_steps=${trainer.max_steps}'``): ``target`` the
    key it names, ``value`` what it gives before the branch sets its keys."""

    target: str
    value: object


def _given_overrides() -> dict[str, object]:
    """``{key: value}`` of the command line's overrides (Hydra's task overrides; deletions left out), ``{}`` when
    Hydra did not start this process (``train(cfg)`` called with a composed config)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lit_dtrain.sweep_grid import unresolved

    if not HydraConfig.initialized():
        return {}
    task, parser, given = HydraConfig.get().overrides.task, OverridesParser.create(), {}  # (values RELATIVE too)
    # as typed, each interpolation resolved alone: resolving the whole list, 'data.val_batch_size=${.batch_size}'
    # (relative to data: valid) raised 'Index 'batch_size' (str) is not an int' inside Hydra's list, in a traceback
    for i, o in enumerate(parser.parse_overrides(unresolved(task))):
        value = o.value()
        # trainer.max_steps=${oc.env:STEPS}, or in a mapping ('++scheduler={decay_steps:${oc.env:STEPS}}'): the value
        # it gives (a mapping's was compared as the text '${oc.env:STEPS}' and refused where STEPS was the branch's)
        if isinstance(value, (str, dict)) and "${" in str(value):
            try:
                value = parser.parse_override(str(task[i])).value()
            except Exception:  # noqa: BLE001 - relative to its node ('${.warmup_steps}'): read in the config
                value = RELATIVE if isinstance(value, str) else value  # a mapping's: each such key (_flattened)
            if isinstance(o.value(), str) and (target := re.fullmatch(r"\$\{([A-Za-z_][\w.]*)\}", o.value())):
                value = Interpolation(target[1], value)  # another key's value, absolute
        if not o.is_delete():
            given.update(_flattened(o.key_or_group, value))
    return given


def _flattened(key: str, value) -> dict[str, object]:
    """``{key: value}`` with a mapping's keys too, dotted (``'++scheduler={decay_steps:5}'`` gives
    ``scheduler.decay_steps``: the branch replaced it, and ``'++trainer={max_steps:20}'``, without a word)."""
    flat = {key: value}
    for k, v in (value.items() if isinstance(value, dict) else ()):
        if isinstance(v, str) and "${" in v:  # the line did not resolve: relative to its node, read in the config
            v = RELATIVE
        flat.update(_flattened(f"{key}.{k}", v))
    return flat


def refuse_given_branch_keys(cfg: DictConfig, nodes: list[tuple[str, DictConfig]], start: int, steps: int) -> None:
    """``ConfigError`` for a key the branch sets (``trainer.max_steps = S + N``; ``total_steps``, ``decay_steps = N``,
    ``decay_fraction = null``) given on the command line with another value (a relative one, ``${.warmup_steps}``,
    read in ``cfg``): it was replaced without a word (``trainer.max_steps=20 decay_branch.steps=4`` from step 6). A
    value that names a key the branch sets (``'scheduler.total_steps=${trainer.max_steps}'``, the WSD config's own) is
    that key's branch value: it was refused as the value before the branch ('scheduler.total_steps=1000 is given')."""
    given = _given_overrides()
    sets = {"trainer.max_steps": (start + steps, f"the checkpoint's step {start} + decay_branch.steps={steps}")}
    for key in dict.fromkeys([k for k, _ in nodes] + ["scheduler"]):  # the callback reads scheduler.<key> too
        sets[f"{key}.total_steps"] = (start + steps, f"the checkpoint's step {start} + decay_branch.steps={steps}")
        sets[f"{key}.decay_steps"] = (steps, "decay_branch.steps")
        sets[f"{key}.decay_fraction"] = (None, "the branch decays over decay_branch.steps")
    for key, (value, why) in sets.items():
        typed = given.get(key, value)
        if isinstance(typed, Interpolation):  # '${trainer.max_steps}': judged after the branch sets the key it names
            typed = sets[typed.target][0] if typed.target in sets else typed.value
        if typed is RELATIVE:  # read here alone: another key's '${.nope}' is the run's own one-line error later
            try:
                typed = OmegaConf.select(cfg, key)
            except Exception:  # noqa: BLE001 - '${.nope}' for a key the branch sets: named as typed
                node, _, leaf = key.rpartition(".")
                typed = OmegaConf.to_container(OmegaConf.select(cfg, node), resolve=False)[leaf]
        if typed != value:
            raise ConfigError(
                f"decay_branch sets {key}={'null' if value is None else value} ({why}), but {key}={typed} is "
                f"given; drop {key} (decay_branch.steps is the decay's length)"
            )
