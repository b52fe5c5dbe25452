"""``hydra.job.chdir=true``: relative paths on the command line stay relative to the directory ``train.py`` started in.

Hydra changes the working directory into the run dir before the job runs, so ``init_from=runs/a/checkpoints/last.ckpt``
typed in the project's root was looked up inside the new run dir (``error: init_from=... does not exist``), and a
relative ``LIT_DTRAIN_CACHE`` or ``data.sources[0].paths`` silently pointed into each run dir (a token cache built again
per run, a corpus glob that matches nothing there). :func:`absolute_paths_under_chdir` makes every path value lit_dtrain
reads absolute against Hydra's ``runtime.cwd`` (the directory the command ran in) before anything reads it.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, ListConfig, OmegaConf

LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")  # Lightning's ckpt_path names, not files
# the path keys lit_dtrain reads, in an order where a key is made absolute before those that interpolate it
# (paths.log_dir before data.exclude_dirs, paths.cache_dir before data.cache_dir, paths.checkpoint_dir before the
# checkpoint callbacks' dirpath)
_PATH_KEYS = ("paths.log_dir", "paths.cache_dir", "paths.checkpoint_dir", "ckpt_path", "init_from", "decay_branch.ckpt",
              "data.cache_dir", "data.exclude_dirs", "trainer.default_root_dir", "logger.save_dir",
              "callbacks.loss_spike.path", "callbacks.model_checkpoint.dirpath", "callbacks.preemption.dirpath")


def _absolute(value: object, cwd: str) -> object:
    if isinstance(value, str) and value.strip():
        path = os.path.expanduser(value)
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(cwd, path))
    return value


def _set_absolute(cfg: DictConfig, key: str, cwd: str) -> None:
    try:
        value = OmegaConf.select(cfg, key, default=None)
    except Exception:  # ${lit.required:...} (experiment=cpt_replay's init_from): train() names what to give
        return
    if isinstance(value, ListConfig):
        absolute = [_absolute(entry, cwd) for entry in value]
        if absolute != list(value):
            OmegaConf.update(cfg, key, absolute, merge=False)
    elif (absolute := _absolute(value, cwd)) != value:
        OmegaConf.update(cfg, key, absolute, merge=False)


def _lightning_keyword(value: object, cwd: str) -> bool:
    """Whether ``ckpt_path`` is one of Lightning's names (``last``, ``best``, ...) and no file of that name is where the
    command ran: made absolute, ``ckpt_path=last`` was refused as '/<cwd>/last' does not exist', without the hint
    that names ``resume=auto``."""
    return value in LIGHTNING_CKPT_NAMES and not os.path.exists(os.path.join(cwd, str(value)))


def absolute_paths_under_chdir(cfg: DictConfig) -> None:
    """Under ``hydra.job.chdir=true``, make lit_dtrain's relative path values absolute against the directory the
    command ran in (``hydra.runtime.cwd``), in place; a no-op outside Hydra or without ``chdir``."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    cwd = str(hydra_cfg.runtime.cwd)
    if not hydra_cfg.job.chdir or os.path.abspath(os.getcwd()) == os.path.abspath(cwd):
        return
    for key in _PATH_KEYS:
        if key == "ckpt_path" and _lightning_keyword(OmegaConf.select(cfg, key, default=None), cwd):
            continue  # resume.py names it for what it is ('last' of Lightning is not read here: resume=auto)
        _set_absolute(cfg, key, cwd)
    sources = OmegaConf.select(cfg, "data.sources", default=None)
    if isinstance(sources, ListConfig):
        for i, source in enumerate(sources):
            if isinstance(source, DictConfig) and "paths" in source:
                _set_absolute(cfg, f"data.sources.{i}.paths", cwd)
