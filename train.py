"""lit_dtrain entry point: ``python train.py [hydra overrides]`` (``-m`` for sweeps)."""

import hydra
from omegaconf import DictConfig

from lit_dtrain.train import pin_sweep_dir, train


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    pin_sweep_dir()  # before Lightning re-launches rank 1 (multirun + DDP)
    metrics, _ = train(cfg)
    return metrics["val_loss"]  # what a sweeper would optimize


if __name__ == "__main__":
    main()
