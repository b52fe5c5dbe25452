"""lit_dtrain entry point: ``python train.py [hydra overrides]`` (``-m`` for sweeps)."""

import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lit_dtrain.train import train

log = logging.getLogger("lit_dtrain.train")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    try:
        metrics, _ = train(cfg)
    except Exception as e:
        if hc.mode == RunMode.MULTIRUN:  # Hydra reports only the first failed job's error, after the whole sweep
            log.exception("job %s failed: %s: %s", hc.job.num, type(e).__name__, e)
        raise
    return metrics["val_loss"]  # what a sweeper would optimize


if __name__ == "__main__":
    main()
