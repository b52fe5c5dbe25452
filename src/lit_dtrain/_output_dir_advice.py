"""What a refusal of an unwritable run or sweep dir (``sweeps.OutputDirCheck``) tells the user to point elsewhere.

It said ``point LIT_DTRAIN_OUTPUT (paths.log_dir, now '<$LIT_DTRAIN_OUTPUT>')`` whatever set the dir: with
``paths.log_dir=/ro/out`` on the command line it read ``now '/tmp/out'`` (the variable, writable and overridden), so
the advice changed nothing; with ``hydra.run.dir=/ro/x`` neither key is in the dir's way.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from lit_dtrain.config_resolvers import env_dir


def _inside(directory: str, parent: str) -> bool:
    directory, parent = os.path.abspath(directory), os.path.abspath(parent)
    return directory == parent or directory.startswith(parent.rstrip(os.sep) + os.sep)


def output_dir_advice(config: DictConfig, kind: str, directory: str) -> str:
    """``point <what sets the dir> (now '<its value>') at a writable directory``: ``LIT_DTRAIN_OUTPUT`` where
    ``paths.log_dir`` is the variable's, ``paths.log_dir`` where it was set otherwise, ``hydra.<kind>.dir`` where the
    dir is not below ``paths.log_dir``."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        log_dir = OmegaConf.select(config, "paths.log_dir", default=None)
    except OmegaConfBaseException:
        log_dir = None
    env = env_dir("LIT_DTRAIN_OUTPUT", "outputs")
    if log_dir is None:  # no paths section (a config of one's own): the variable, as the configs read it
        return f"point LIT_DTRAIN_OUTPUT (now {env!r}) at a writable directory"
    if not _inside(directory, str(log_dir)):
        return f"point hydra.{kind}.dir (now {directory!r}) at a writable directory"
    if str(log_dir) != env:
        return f"point paths.log_dir (now {str(log_dir)!r}; it overrides LIT_DTRAIN_OUTPUT) at a writable directory"
    return f"point LIT_DTRAIN_OUTPUT (paths.log_dir, now {env!r}) at a writable directory"
