"""An ``init_from`` that an experiment requires (``experiment=cpt_replay``) but a full resume does not read; an empty
checkpoint path refused."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from lit_dtrain.checkpoint import checkpoint_files
from lit_dtrain.config_resolvers import RequiredValueError
from lit_dtrain.errors import ConfigError

log = logging.getLogger(__name__)


def drop_required_init_from_on_a_full_resume(cfg: DictConfig) -> None:
    """Set a required, ungiven ``init_from`` to null when ``decay_branch.ckpt``, ``ckpt_path`` or ``resume=auto`` (in a
    run dir that holds checkpoints) resumes a checkpoint in full: its weights come from that checkpoint, so there is
    nothing for ``init_from`` to load. Before, a decay branch (or an extension) of a continual-pre-training run, typed
    with its ``experiment=cpt_replay``, stopped at ``give init_from=PATH``, and giving it stopped at ``set either
    decay_branch.ckpt or init_from, not both``; an extension in place (``resume=auto`` with ``trainer.max_steps``
    raised) stopped at ``give init_from=PATH`` too."""
    try:
        cfg.get("init_from")
        return  # given (or not required): the usual checks apply
    except RequiredValueError:
        pass
    branch = cfg.get("decay_branch") or {}
    key = "decay_branch.ckpt" if branch.get("ckpt") else "ckpt_path" if cfg.get("ckpt_path") else None
    if key is None and cfg.get("resume") == "auto" and checkpoint_files(Path(str(cfg.paths.checkpoint_dir))):
        # an extension in place (trainer.max_steps raised), as check_init_from reads it: the run's own checkpoints
        key = "resume=auto"
    if key is None:
        return  # a fresh start: the required init_from's error stands
    with open_dict(cfg):
        cfg.init_from = None
    log.info("init_from: not needed, %s resumes a checkpoint in full (weights, optimizer, step, data)", key)


CHECKPOINT_PATH_KEYS = ("ckpt_path", "init_from", "decay_branch.ckpt")


def refuse_empty_checkpoint_paths(cfg: DictConfig) -> None:
    """``ConfigError`` for a checkpoint path key given as an empty string (``init_from=$CKPT`` with ``CKPT`` unset):
    an empty ``init_from`` read as not given, so ``experiment=cpt_replay``'s continual pre-training trained from random
    weights at step 0 without a word, an empty ``ckpt_path`` (``ckpt_path=$CKPT``) started a fresh run at step 0 for
    the resume asked for, and an empty ``decay_branch.ckpt`` was called a directory. ``null`` is the "none"."""
    for key in CHECKPOINT_PATH_KEYS:
        try:
            value = OmegaConf.select(cfg, key)
        except RequiredValueError:  # experiment=cpt_replay's init_from, not given: its own error follows
            continue
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{key} is empty ({key}={value!r}; an unset shell variable?): give a checkpoint file, "
                              f"or {key}=null for none")
