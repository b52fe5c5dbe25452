"""The check of a resumed multirun job against the config its run dir was trained with (:func:`check_resumed_job`,
run by :func:`lit_dtrain.sweeps.sweep_checks`; moved out of ``lit_dtrain.sweeps``, which still exports it)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain.errors import ConfigError
from lit_dtrain.sweep_grid import sweep_dir_of, sweep_task

_REORDERED: dict[tuple, str] = {}  # (sweep dir, -m arguments) -> a job refused for its order, in this process


def check_resumed_job(cfg: DictConfig) -> None:
    """resume=auto in a multirun resumes job N from <sweep dir>/N: refuse it when that run was trained with another
    value of a swept key (the same sweep re-run with its values in another order), before train() rewrites its
    config_resolved.yaml. A later job of that re-run with no run of its own yet (the killed sweep never started it)
    is refused too: it would train <sweep dir>/N with the other order's values, where the sweep re-run in its own
    order then refused it (a job 1 of '3e-3,1e-3' trained its dir with lr=1e-3, the first order's job 0)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    old_file = Path(hc.runtime.output_dir) / "config_resolved.yaml"
    if hc.mode != RunMode.MULTIRUN or cfg.get("resume") != "auto":
        return
    task = sweep_task(hc)
    sweep = (str(sweep_dir_of(hc)), tuple(task))
    if not old_file.is_file():
        if sweep in _REORDERED:
            raise ConfigError(
                f"resume=auto: {old_file.parent} holds no run yet, and an earlier job of this re-run was refused "
                f"({_REORDERED[sweep]}): these -m values are in another order than that sweep's, so this job "
                "would train its dir with another job's values; re-run the sweep with the same -m arguments in the "
                "same order (or resume into another hydra.sweep.dir)"
            )
        return
    swept = {
        o.key_or_group.replace("/", ".")
        for o in OverridesParser.create().parse_overrides(task)
        if o.is_sweep_override()
    }  # data/sampler=random,fourier: the node data.sampler
    swept |= {str(key).replace("/", ".") for key in hc.sweeper.get("params") or {}}  # an experiment's grid
    old = OmegaConf.load(old_file)
    for key in sorted(swept):
        diffs = _differences(
            _plain(OmegaConf.select(old, key)),
            _plain(OmegaConf.select(cfg, key)),
            _plain(OmegaConf.select(cfg, key), resolve=False),
            key,
        )
        if diffs:
            (where, before, now), more = diffs[0], len(diffs) - 1
            _REORDERED[sweep] = f"{old_file.parent} was trained with {where}={_show(before)}"
            raise ConfigError(
                f"resume=auto: {old_file.parent} was trained with {where}={_show(before)}, this job sets "
                f"{where}={_show(now)}{f' (and {more} more under {key})' if more else ''}: job N resumes "
                "<sweep dir>/N, so re-run the sweep with the same -m arguments in the same order (or resume into "
                "another hydra.sweep.dir)"
            )


_UNSET = object()  # an entry one of the two configs does not have


def _plain(value, resolve: bool = True):
    return OmegaConf.to_container(value, resolve=resolve) if isinstance(value, (DictConfig, ListConfig)) else value


def _differences(old, new, raw, key: str) -> list[tuple[str, object, object]]:
    """``(dotted key, earlier value, this job's value)`` of each entry that differs between the earlier run's
    resolved config and this job's, leaving out the entries this job interpolates (``raw``, its unresolved
    config), at any depth: ``callbacks.wsd.total_steps: ${trainer.max_steps}`` follows a resume's longer
    max_steps. A node whose ``_target_`` differs is one difference (``scheduler``: wsd vs cosine)."""
    if isinstance(raw, str) and "${" in raw:
        return []
    if isinstance(old, dict) and isinstance(new, dict) and old.get("_target_") == new.get("_target_"):
        raw = raw if isinstance(raw, dict) else {}
        return [
            diff
            for k in sorted(old.keys() | new.keys(), key=str)
            for diff in _differences(old.get(k, _UNSET), new.get(k, _UNSET), raw.get(k), f"{key}.{k}")
        ]
    return [] if old == new else [(key, old, new)]


def _show(value) -> str:
    if value is _UNSET:
        return "(not set)"
    return value.get("_target_", str(value)) if isinstance(value, dict) else str(value)
