"""WSD's workflows on top of ``train(cfg)``: decay branches, extension, continual pre-training.

- **Decay branch** (``decay_branch.ckpt=PATH decay_branch.steps=N``): resume everything from a
  stable-phase checkpoint at step ``S`` (weights, optimizer, data position, step) and run only a decay of
  ``N`` steps into a new run dir: ``trainer.max_steps = S + N``, and the WSD schedule gets
  ``total_steps = S + N``, ``decay_steps = N``. The branch's first step ``S`` runs at the first decay value
  (:class:`~lit_dtrain.schedules.StepLambdaLR` re-applies the new schedule on load). The checkpoint is
  only read, so the original run is not disturbed.
- **Extend**: ``ckpt_path=PATH trainer.max_steps=LARGER`` (WSD's ``total_steps`` follows ``trainer.max_steps``);
  the restored step skips the warmup (:func:`fit_default_warmup` keeps a grown default warmup from re-warming a
  checkpoint at its peak LR).
- **Continual pre-training** (``init_from=PATH``): load only the model weights of a checkpoint; optimizer,
  schedule (with its re-warmup), step and data position start fresh.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from omegaconf import DictConfig, open_dict

from lit_dtrain._config_values import as_integer
from lit_dtrain.checkpoint import CheckpointError, checkpoint_files, checkpoint_global_step, not_a_file_reason
from lit_dtrain.config_resolvers import default_warmup
from lit_dtrain.errors import ConfigError
from lit_dtrain.schedules._branch_overrides import refuse_given_branch_keys
from lit_dtrain.schedules._checkpoint_weights import (  # init_from and the scripts' model loading
    check_init_from,
    checkpoint_weights,
    load_model_weights,
    model_from_checkpoint,
)
from lit_dtrain.schedules._resume_lr import (
    BRANCH_JUMP,
    below,
    branch_in_warmup_fix,
    checkpoint_lr_and_peak,
    warn_if_a_resume_moves_the_lr,
    warn_if_the_lr_moves,
    written_as,
)
from lit_dtrain.sweeps import another_run_dir
from lit_dtrain.utils.args import is_number, is_whole_float
from lit_dtrain.utils.rank_zero import log_once
from lit_dtrain.utils.words import counted

log = logging.getLogger(__name__)

__all__ = [
    "SCHEDULE_TARGETS", "WSD_CALLBACK_TARGETS", "WSD_TARGETS", "apply_decay_branch", "check_init_from",
    "check_one_decay_length", "checkpoint_weights", "fit_default_warmup", "load_model_weights", "log_a_changed_peak",
    "model_from_checkpoint", "unknown_argument_error", "warn_if_the_resume_moves_the_lr",
]

WSD_TARGETS = ("lit_dtrain.schedules.wsd_scheduler", "lit_dtrain.schedules.lr.wsd_scheduler")
SCHEDULE_TARGETS = tuple(  # the other schedules a resume can move the LR of
    f"lit_dtrain.schedules{module}.{name}_scheduler" for module in ("", ".lr") for name in ("cosine", "constant")
)
WSD_CALLBACK_TARGETS = ("lit_dtrain.callbacks.WSDScheduler", "lit_dtrain.callbacks.wsd.WSDScheduler")


def _wsd_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """``(key, node)`` of the config nodes that carry a WSD schedule: ``scheduler`` and/or a ``WSDScheduler``
    callback (``callbacks.<name>``)."""
    nodes = []
    sched = cfg.get("scheduler")
    if sched is not None and sched.get("_target_") in WSD_TARGETS:
        nodes.append(("scheduler", sched))
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is not None and node.get("_target_") in WSD_CALLBACK_TARGETS:
            nodes.append((f"callbacks.{name}", node))
    return nodes


def _resumed_schedule_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """The WSD nodes (:func:`_wsd_nodes`), else a cosine or constant ``scheduler``: the schedules a resume moves."""
    nodes = _wsd_nodes(cfg)
    sched = cfg.get("scheduler")
    if not nodes and sched is not None and str(sched.get("_target_", "")) in SCHEDULE_TARGETS:
        nodes = [("scheduler", sched)]
    return nodes


def check_one_decay_length(cfg: DictConfig) -> None:
    """``ConfigError`` naming the config keys when a WSD node sets both ``decay_steps`` and ``decay_fraction``:
    conf/scheduler/wsd.yaml and conf/callbacks/wsd.yaml default ``decay_fraction`` to 0.2, so a ``decay_steps`` given
    alone needs ``decay_fraction=null``. (The schedule's own error names only its arguments: in another Lightning
    project, ``WSDScheduler(decay_steps=..., decay_fraction=...)`` has no yaml file to fix.)"""
    for key, node in _wsd_nodes(cfg):
        steps, fraction = node.get("decay_steps"), node.get("decay_fraction")
        if steps is not None and fraction is not None:
            raise ConfigError(
                f"{key}.decay_steps={steps} and {key}.decay_fraction={fraction} are both set (its config's "
                f"decay_fraction defaults to 0.2): give one, e.g. {key}.decay_steps={steps} {key}.decay_fraction=null"
            )


def unknown_argument_error(key: str, node: DictConfig, error: TypeError) -> str:
    """The one-line message for a schedule node holding keys its ``_target_`` takes no argument for (``experiment=
    cpt_replay scheduler=cosine``: the experiment's ``scheduler.decay_fraction``, an argument of WSD only). It names
    every such key (``scheduler=constant``: ``decay_fraction`` and ``min_lr_factor``), not only the first that the
    ``TypeError`` names, so that one command line fixes them all."""
    name = str(node.get("_target_", "")).rsplit(".", 1)[-1]
    found = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    if found is None:
        return f"{key}: {error}"
    unknown = _keys_not_taken(node) or [found.group(1)]
    typo = _misspelt(node, unknown)
    if typo is not None:
        return f"{key}.{typo[0]} is not an argument of {name}; did you mean '{key}.{typo[1]}'?"
    from lit_dtrain._removed_keys import removal_fixes  # '++scheduler.decay_fraction=0.2': remove that, not '~'

    settings = " and ".join(f"{key}.{arg}={node.get(arg)}" for arg in unknown)
    verb = "is not an argument" if len(unknown) == 1 else "are not arguments"
    fixes, from_a_file = removal_fixes(key, unknown)
    guess = " (an experiment's setting for another schedule?)" if from_a_file else ""
    return f"{settings} {verb} of {name}{guess}; {'; '.join(fixes)}"


def _misspelt(node: DictConfig, unknown: list[str]) -> tuple[str, str] | None:
    """The first of ``unknown`` that no schedule of conf/scheduler takes, with the close argument of ``node``'s
    target: a typo, not an experiment's setting for another schedule ('++scheduler.warmup_stepz=3' was told to drop
    it, 'an experiment's setting for another schedule?', naming no 'scheduler.warmup_steps')."""
    import difflib

    from hydra.utils import get_object

    from lit_dtrain import schedules
    from lit_dtrain.config_keys import accepted_arguments

    try:
        own = accepted_arguments(get_object(str(node.get("_target_")))) or set()
    except (ImportError, ValueError, TypeError):
        return None
    anyones = set().union(*(accepted_arguments(getattr(schedules, f"{kind}_scheduler")) or set()
                            for kind in ("constant", "cosine", "wsd")))
    for arg in unknown:
        close = difflib.get_close_matches(arg, sorted(own), n=1)
        if arg not in anyones and close:
            return arg, close[0]
    return None


def _keys_not_taken(node: DictConfig) -> list[str]:
    """The keys of ``node`` that its ``_target_`` takes no argument for ([] when it cannot tell: no signature, or a
    ``**kwargs`` it cannot follow; :func:`lit_dtrain.config_keys.accepted_arguments`)."""
    from hydra.utils import get_object

    from lit_dtrain.config_keys import accepted_arguments

    try:
        accepted = accepted_arguments(get_object(str(node.get("_target_"))))
    except (ImportError, ValueError, TypeError):
        return []
    if accepted is None:
        return []
    return [k for k in node.keys() if not str(k).startswith("_") and k not in accepted]


def _is_default_warmup(cfg: DictConfig, node: DictConfig) -> bool:
    """Whether ``node.warmup_steps`` is the configs' derived default ``${lit.warmup:${trainer.max_steps}}`` (not a
    number the user gave), told by how the key is written, not by its value. conf/callbacks/wsd.yaml's
    ``${oc.select:scheduler.warmup_steps,<the default>}`` is followed to the key it reads where the config holds it
    (an experiment's ``scheduler:`` settings after ``'~scheduler'``): ``experiment=cpt_replay
    scheduler.warmup_steps=7`` under the callback, resumed at step 5 with ``trainer.max_steps=70`` (whose default is
    7 too), was taken for the default and fitted to 5, so step 5 ran at the peak, not 6/7 of it as with
    ``trainer.max_steps=60``."""
    raw = written_as(cfg, node, "warmup_steps")
    return isinstance(raw, str) and "lit.warmup:" in raw \
        and int(node.warmup_steps) == default_warmup(int(cfg.trainer.max_steps))


def _at_peak(path: Path) -> bool:
    """Whether the checkpoint's LR for its next step is its peak LR in every param group (past its warmup, not in a
    decay); ``False`` when it does not record both."""
    lr_and_peak = checkpoint_lr_and_peak(path)
    return lr_and_peak is not None and not below(lr_and_peak, 1.0)


def fit_default_warmup(cfg: DictConfig, ckpt: str | Path, start: int | None = None) -> None:
    """Resuming a checkpoint at step ``start`` that is at its peak LR (past its warmup): a ``warmup_steps`` (WSD's,
    a constant or cosine schedule's) that is the derived default ``min(100, max(1, max_steps // 10))`` of a larger
    ``trainer.max_steps`` (an extension, a long decay branch) and lies past ``start`` would put the resumed steps back
    into a warmup; it becomes ``start`` (no resumed step lies in it, so the schedule goes on at the peak). A number the
    user gave is left alone. A cosine checkpoint past its warmup is below its peak, so its warmup is not fitted: any
    longer cosine moves its LR, which the resume warns about."""
    ckpt = Path(str(ckpt))
    start = checkpoint_global_step(ckpt) if start is None else start
    for key, node in _resumed_schedule_nodes(cfg):
        warmup = int(node.get("warmup_steps") or 0)
        if start < warmup and _is_default_warmup(cfg, node) and _at_peak(ckpt):
            log_once(
                log, logging.INFO,
                "%s.warmup_steps defaults to %d for trainer.max_steps=%d, past the checkpoint's step %d, which is at "
                "its peak LR: using warmup_steps=%d (pass %s.warmup_steps=W to choose another)",
                key,
                warmup,
                int(cfg.trainer.max_steps),
                start,
                start,
                key,
            )
            with open_dict(node):
                node.warmup_steps = start


def warn_if_the_resume_moves_the_lr(cfg: DictConfig, ckpt: str | Path, start: int) -> None:
    """A resume (``ckpt_path``, ``resume=auto``; not a branch's start, warning itself) whose schedule (WSD, cosine or
    constant, the scheduler or the callback) gives step ``start`` another LR than the checkpoint's: extending a
    decayed run re-enters the stable phase at the peak (up); a larger ``trainer.max_steps`` grows the default warmup
    past a checkpoint inside its warmup (down), a smaller one shrinks it (up) or moves the decay before the step
    (down). A warmup the user gave past the step (a deliberate re-warm) is only logged
    (:func:`~lit_dtrain.schedules._resume_lr.warn_if_a_resume_moves_the_lr`). Rank 0 alone: under torchrun or srun
    every rank resumes the same checkpoint, and each printed the same warning. A branch's restart from its own
    checkpoints is checked, and told to keep its ``decay_branch.steps``."""
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    branch = (cfg.get("decay_branch") or {}).get("ckpt")
    if branch is not None and Path(str(ckpt)).resolve() == Path(str(branch)).expanduser().resolve():
        return  # the branch's start: apply_decay_branch warned, naming decay_branch.ckpt
    nodes = _resumed_schedule_nodes(cfg)
    if nodes:
        key, node = nodes[0]
        default = _is_default_warmup(cfg, node)
        warn_if_a_resume_moves_the_lr(Path(str(ckpt)), start, key, node, default_warmup=default,
                                      peak_lr=(cfg.get("optimizer") or {}).get("lr"),
                                      fix=None if branch is None else _branch_restart_fix(cfg))
    log_a_changed_peak(cfg, ckpt)


def _branch_restart_fix(cfg: DictConfig) -> str:
    """The fix for a decay branch restarted (``resume=auto``) with a schedule that moves its LR: another
    ``decay_branch.steps`` than it started with (read from its ``config_resolved.yaml``, which this start has not
    rewritten yet) moved its decay under the steps it trained; the LR jumped without a word."""
    from omegaconf import OmegaConf

    try:
        steps = OmegaConf.select(OmegaConf.load(Path(str(cfg.paths.output_dir)) / "config_resolved.yaml"),
                                 "decay_branch.steps")
    except (OSError, ValueError, TypeError):
        steps = None
    started = f"decay_branch.steps={steps}, the one" if steps is not None else "the decay_branch.steps"
    return (f"restart this decay branch with {started} it started with (now decay_branch.steps="
            f"{cfg.decay_branch.steps}), or branch a decay of another length into a new run_name")


def log_a_changed_peak(cfg: DictConfig, ckpt: str | Path) -> None:
    """Log a resume whose ``optimizer.lr`` is not the checkpoint's peak: the configured one is used (StepLambdaLR and
    WSDScheduler keep it over the checkpoint's)."""
    lr = (cfg.get("optimizer") or {}).get("lr")
    lr_and_peak = checkpoint_lr_and_peak(Path(str(ckpt))) if isinstance(lr, (int, float)) else None
    if lr_and_peak is not None and any(abs(peak - lr) > 1e-6 * abs(lr) for peak in lr_and_peak[1]):
        log.info("resuming %s with optimizer.lr=%g as the peak LR, where the checkpoint's run had %s", ckpt, lr,
                 ", ".join(f"{peak:g}" for peak in lr_and_peak[1]))


def apply_decay_branch(cfg: DictConfig) -> int | None:
    """Turn ``decay_branch.{ckpt,steps}`` into the resume and schedule keys; returns the branch step ``S``.

    Sets ``ckpt_path`` (unless ``resume=auto`` finds this branch's own checkpoints: an interrupted branch
    resumes itself), ``trainer.max_steps = S + N`` and, on the WSD scheduler or callback,
    ``total_steps = S + N``, ``decay_steps = N``, ``decay_fraction = null``. Raises ``ConfigError`` naming
    the key for a missing file, a branch inside the warmup, a branch into the source run's own dir, a
    non-WSD schedule, ``ckpt_path`` set as well, or a branch dir holding checkpoints without ``resume=auto``.
    """
    branch = cfg.get("decay_branch")
    if branch is None or (branch.get("ckpt") is None and branch.get("steps") is None):
        return None
    if branch.get("ckpt") is None or branch.get("steps") is None:
        raise ConfigError(
            f"decay_branch needs both ckpt and steps, got ckpt={branch.get('ckpt')!r}, steps={branch.get('steps')!r}"
        )
    src = Path(str(branch.ckpt)).expanduser()
    if not src.is_file():
        raise ConfigError(f"decay_branch.ckpt={str(branch.ckpt)!r} {not_a_file_reason(src)}")
    steps = branch.steps
    if is_whole_float(steps):  # 5.0 (5e0, a computed length): that integer, as every other step count takes it
        # (check_types, check_int); it was refused here alone, 'must be a positive integer'
        steps = as_integer("decay_branch.steps", steps)
        with open_dict(cfg):
            cfg.decay_branch.steps = steps
    if not is_number(steps, integer=True) or steps <= 0:
        raise ConfigError(f"decay_branch.steps must be a positive integer, got {steps!r}")
    if cfg.get("ckpt_path"):
        raise ConfigError("set either decay_branch.ckpt or ckpt_path, not both (the branch resumes its ckpt)")
    if cfg.get("init_from"):
        raise ConfigError("set either decay_branch.ckpt or init_from, not both")
    out_dir = Path(str(cfg.paths.output_dir)).expanduser().resolve()
    if out_dir == src.resolve().parent or out_dir in src.resolve().parents:
        raise ConfigError(
            f"decay_branch.ckpt={str(src)!r} lies inside this run's dir {str(out_dir)!r}; give the branch its own "
            "run_name so that the original run is not disturbed"
        )
    nodes = _wsd_nodes(cfg)
    if not nodes:
        raise ConfigError(
            "decay_branch needs the WSD schedule: scheduler=wsd (the default), "
            "or '~scheduler' 'callbacks=[default,wsd]'"
        )
    try:  # the key as typed, as init_from's errors: a damaged file was named by its path alone
        start = checkpoint_global_step(src)
    except CheckpointError as e:  # damaged (a member fails its CRC-32 check), truncated, foreign
        raise ConfigError(f"decay_branch.ckpt: {e}") from e
    total = start + steps
    refuse_given_branch_keys(cfg, nodes, start, steps)
    with open_dict(cfg):  # first: the default warmup_steps (${lit.warmup:${trainer.max_steps}}) follows it
        cfg.trainer.max_steps = total
    fit_default_warmup(cfg, src, start)  # a long decay's default warmup past a stable S: any warmup <= S is the same
    log_the_branchs_last_step(cfg, start, steps)
    for key, node in nodes:
        warmup = int(node.get("warmup_steps") or 0)
        if start < warmup:
            why = ""
            if _is_default_warmup(cfg, node):
                why = f", the default min(100, max(1, max_steps // 10)) of the branch's max_steps={total}"
            # a warmup given (an experiment's, as cpt_replay's 50) can be longer than the source run's
            fix = branch_in_warmup_fix(src, key, start)
            raise ConfigError(
                f"decay_branch.ckpt is at step {start}, inside the warmup ({key}.warmup_steps={warmup}{why}); "
                f"branch from a stable-phase checkpoint{fix}"
            )
        with open_dict(node):
            node.total_steps = total
            node.decay_steps = steps
            node.decay_fraction = None
    own_dir = Path(str(cfg.paths.checkpoint_dir))
    own = checkpoint_files(own_dir)
    with open_dict(cfg):
        if cfg.get("resume") == "auto" and own:  # resolve_ckpt_path picks last.ckpt (or the newest if it is missing)
            log_once(log, logging.INFO, "decay_branch: resuming this branch's own checkpoints in %s", own_dir)
        elif own:  # re-resuming the source here would write last-v1.ckpt beside the first start's last.ckpt
            raise ConfigError(
                f"this branch's run dir {str(own_dir.parent)!r} already holds checkpoints ({', '.join(own[:3])}"
                f"{', ...' if len(own) > 3 else ''}); continue the branch with resume=auto, or {another_run_dir()}"
            )
        else:
            cfg.ckpt_path = str(src)
            cfg.resume = None
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:  # what the checkpoint's LRs say, read once: every rank branches from the same one
        warn_if_the_lr_moves(src, start, *nodes[0], **BRANCH_JUMP, peak_lr=(cfg.get("optimizer") or {}).get("lr"))
        log_a_changed_peak(cfg, src)
    log_once(log, logging.INFO, "decay_branch: from step %d of %s, decaying over %s to step %d", start, src,
             counted(steps, "step"), total)
    return start


def log_the_branchs_last_step(cfg: DictConfig, start: int, steps: int) -> None:
    """Lightning logs the step of 0-based index ``s`` (``train/loss``, the LR) where ``(s + 1) % log_every_n_steps ==
    0``: a branch of fewer steps than that (``decay_branch.steps=3`` with the default 10) logged no train loss or LR at
    all, its decay never drawn. Where the branch's steps ``start .. start + steps - 1`` hold no logged step, it logs
    every ``d`` steps, ``d`` the largest divisor of ``start + steps`` up to ``steps`` and ``log_every_n_steps``: its
    last step is logged, and as few others as that allows; said once."""
    every = cfg.trainer.get("log_every_n_steps")
    total = start + steps
    if not is_number(every, integer=True) or every <= 0 or total // every > start // every:
        return
    d = max(n for n in range(1, min(every, steps) + 1) if total % n == 0)
    with open_dict(cfg):
        cfg.trainer.log_every_n_steps = d
    log_once(log, logging.INFO, "decay_branch: none of its %s (%d..%d) is one that trainer.log_every_n_steps=%d logs; "
             "it logs every %s instead, to its last", counted(steps, "step"), start, total - 1, every,
             counted(d, "step") if d > 1 else "step")
