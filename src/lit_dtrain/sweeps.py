"""Hydra multirun checks that ``train(cfg)`` runs itself, so that any Hydra entry point calling it gets them, not
only the root ``train.py``. Each is a no-op outside a Hydra multirun (``train(cfg)`` called from plain Python)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf


def check_resumed_job(cfg: DictConfig) -> None:
    """resume=auto in a multirun resumes job N from <sweep dir>/N: refuse it when that run was trained with another
    value of a swept key (the same sweep re-run with its values in another order), before train() rewrites its
    config_resolved.yaml."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    old_file = Path(hc.runtime.output_dir) / "config_resolved.yaml"
    if hc.mode != RunMode.MULTIRUN or cfg.get("resume") != "auto" or not old_file.is_file():
        return
    multirun = Path(hc.runtime.output_dir).parent / "multirun.yaml"  # this start's sweep, as Hydra saved it
    task = list(OmegaConf.load(multirun).hydra.overrides.task) if multirun.is_file() else []
    swept = {
        o.key_or_group.replace("/", ".")
        for o in OverridesParser.create().parse_overrides(task)
        if o.is_sweep_override()
    }  # data/sampler=random,fourier: the node data.sampler
    swept |= set(hc.sweeper.get("params") or {})
    old = OmegaConf.load(old_file)
    for key in sorted(swept):
        before, now = _comparable(OmegaConf.select(old, key), OmegaConf.select(cfg, key))
        if before != now:
            from lit_dtrain.train import ConfigError  # lazy: lit_dtrain.train imports this module

            raise ConfigError(
                f"resume=auto: {old_file.parent} was trained with {key}={_show(before)}, this job sets "
                f"{key}={_show(now)}: job N resumes <sweep dir>/N, so re-run the sweep with the same -m arguments in "
                "the same order (or resume into another hydra.sweep.dir)"
            )


def _comparable(old, new):
    """The earlier run's resolved value and this job's, as plain values; for a config group, without the entries
    this job interpolates (``total_steps: ${trainer.max_steps}`` follows a resume's longer max_steps)."""
    plain_old = OmegaConf.to_container(old, resolve=True) if isinstance(old, (DictConfig, ListConfig)) else old
    if not isinstance(new, DictConfig):
        return plain_old, OmegaConf.to_container(new, resolve=True) if isinstance(new, ListConfig) else new
    raw = OmegaConf.to_container(new, resolve=False)
    skip = {k for k, v in raw.items() if isinstance(v, str) and "${" in v}
    plain_new = {k: v for k, v in OmegaConf.to_container(new, resolve=True).items() if k not in skip}
    if isinstance(plain_old, dict):
        plain_old = {k: v for k, v in plain_old.items() if k not in skip}
    return plain_old, plain_new


def _show(value) -> str:
    return value.get("_target_", str(value)) if isinstance(value, dict) else str(value)
