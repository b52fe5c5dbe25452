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


def keep_the_weights_origin(cfg: DictConfig, ckpt_path: str | Path) -> None:
    """A full resume (``resume=auto``, ``ckpt_path``, a decay branch) without ``init_from`` records the ``init_from``
    of the checkpoint's run (its ``config_resolved.yaml``, which a resume of that run dir has not rewritten yet):
    the weights it continues began there. A continual-pre-training run extended in place (``resume=auto
    trainer.max_steps=<more>``, ``init_from`` left out as it is not read) recorded ``init_from: null``, and
    ``scripts/compare_runs.py`` labelled it ``init_from=null`` beside a run trained alike from the same file. This
    start loads the checkpoint alone; ``init_from`` is set after :func:`check_init_from` has passed over it."""
    from lit_dtrain.schedules._resume_lr import source_config

    if cfg.get("init_from") is not None:
        return  # given: this start's own (refused with ckpt_path; not read by resume=auto in the run's own dir)
    source = source_config(Path(str(ckpt_path)))
    try:
        origin = OmegaConf.select(source, "init_from") if source is not None else None
    except Exception:  # noqa: BLE001 - a config that is no mapping: nothing recorded
        return
    if isinstance(origin, str) and origin.strip():
        with open_dict(cfg):
            cfg.init_from = origin
        log.info("init_from: recorded as %s, where the weights of %s began (this start loads that checkpoint)",
                 origin, ckpt_path)


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
