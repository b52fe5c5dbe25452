"""lit_dtrain entry point: ``python train.py [hydra overrides]`` (``-m`` for sweeps)."""

import os

import hydra
from omegaconf import DictConfig

from lit_dtrain._compose_errors import composed, run_reporting_unknown_keys
from lit_dtrain.config_resolvers import compose_for_a_run
from lit_dtrain.sweeps import reports_user_errors
from lit_dtrain.train import train

CONFIG_PATH = "conf"  # beside this file


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
@reports_user_errors  # a bad config, corpus or checkpoint: 'error: <message>', no traceback
def main(cfg: DictConfig) -> float:
    composed()  # Hydra reports errors from here on as always (an unknown key was reported as it composed)
    metrics, _ = train(cfg)  # in a sweep, a failed job logs its error to its train.log (lit_dtrain.sweeps)
    return metrics["val_loss"]  # what a sweeper would optimize


if __name__ == "__main__":
    compose_for_a_run()  # paths.output_dir reads '<run dir>' until Hydra sets it ('~<key holding it>' is refused)
    # optimizer.lrr=1e-3: 'error: ... did you mean 'optimizer.lr'?', one line
    run_reporting_unknown_keys(main, config_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), CONFIG_PATH))
