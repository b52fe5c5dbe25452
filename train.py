"""lit_dtrain entry point: ``python train.py [hydra overrides]`` (``-m`` for sweeps)."""

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain.train import ConfigError, pin_sweep_dir, train

log = logging.getLogger("lit_dtrain.train")


def check_resumed_job(cfg: DictConfig, hc) -> None:
    """resume=auto in a multirun resumes job N from <sweep dir>/N: refuse it when that run was trained with another
    value of a swept key (the same sweep re-run with its values in another order), before train() rewrites its
    config_resolved.yaml."""
    old_file = Path(hc.runtime.output_dir) / "config_resolved.yaml"
    if hc.mode != RunMode.MULTIRUN or cfg.get("resume") != "auto" or not old_file.is_file():
        return
    multirun = Path(hc.runtime.output_dir).parent / "multirun.yaml"  # this start's sweep, as Hydra saved it
    task = list(OmegaConf.load(multirun).hydra.overrides.task) if multirun.is_file() else []
    swept = {o.key_or_group.replace("/", ".") for o in OverridesParser.create().parse_overrides(task)
             if o.is_sweep_override()}  # data/sampler=random,fourier: the node data.sampler
    swept |= set(hc.sweeper.get("params") or {})
    old = OmegaConf.load(old_file)
    for key in sorted(swept):
        before, now = _comparable(OmegaConf.select(old, key), OmegaConf.select(cfg, key))
        if before != now:
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


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    pin_sweep_dir()  # before Lightning re-launches rank 1 (multirun + DDP)
    hc = HydraConfig.get()
    grid = hc.sweeper.get("params") if hc.mode != RunMode.MULTIRUN else None
    if grid:  # e.g. `python train.py experiment=wsd_vs_cosine`: Hydra ignores the experiment's grid without -m
        log.warning("this config sweeps %s (hydra.sweeper.params) only with -m; without it this is one run",
                    " ".join(f"{k}={v}" for k, v in grid.items()))
    try:
        check_resumed_job(cfg, hc)
        metrics, _ = train(cfg)
    except Exception as e:
        if hc.mode == RunMode.MULTIRUN:  # Hydra reports only the first failed job's error, after the whole sweep
            log.exception("job %s failed: %s: %s", hc.job.num, type(e).__name__, e)
        raise
    return metrics["val_loss"]  # what a sweeper would optimize


if __name__ == "__main__":
    main()
