"""The LR a resume (``ckpt_path``, ``resume=auto``, a decay branch) gives the checkpoint's next step against the LR the
checkpoint holds for it, which is the LR its run would have trained that step with. A schedule that is not the
checkpoint's run's moves it without a word from the optimizer: up (extending a decayed run, a decay branch from the
peak, a smaller ``trainer.max_steps`` whose default warmup shrinks below a checkpoint inside its warmup, a longer
cosine) or down (a larger ``trainer.max_steps`` whose default warmup grows past such a checkpoint, a decay moved to
before its step). Each warns with both LRs and the cause, except a warmup the user gave that lies past the step: the
documented deliberate re-warm, only logged.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from lit_dtrain.checkpoint import safe_torch_load
from lit_dtrain.schedules.lr import resolve_decay_steps, schedule_factor, wsd_lr_factor

log = logging.getLogger("lit_dtrain.schedules.workflows")  # the workflows' logger: one name to filter

# the wording of warn_if_the_lr_moves for a decay branch
BRANCH_JUMP = {
    "label": "decay_branch.ckpt",
    "what": "the branch's first LR",
    "why": "the branch decays from the peak",
    "advice": "Branch from a stable-phase checkpoint",
}
def below(lr_and_peak: tuple[list[float], list[float]], factor: float) -> bool:
    """Whether any param group's LR is below ``peak * factor`` (beyond float rounding)."""
    return any(lr < peak * factor * (1 - 1e-6) for lr, peak in zip(*lr_and_peak))


def _above(lr_and_peak: tuple[list[float], list[float]], factor: float) -> bool:
    return any(lr > peak * factor * (1 + 1e-6) for lr, peak in zip(*lr_and_peak))


def checkpoint_lr_and_peak(path: str | Path) -> tuple[list[float], list[float]] | None:
    """``(LRs, peak LRs)`` of the first optimizer's param groups in a Lightning checkpoint: the LRs its optimizer
    state holds and the peaks its WSD state holds (``LambdaLR``'s ``base_lrs``, else the ``WSDScheduler``
    callback's). ``None`` when either is missing (no optimizer state, no schedule state)."""
    ckpt = safe_torch_load(Path(path), mmap=True)
    try:
        lrs = [float(g["lr"]) for g in ckpt["optimizer_states"][0]["param_groups"]]
    except (KeyError, IndexError, TypeError):
        return None
    peaks = None
    for state in ckpt.get("lr_schedulers") or []:
        if isinstance(state, dict) and "base_lrs" in state:
            peaks = state["base_lrs"]
            break
    for key, state in (ckpt.get("callbacks") or {}).items():
        if peaks is None and str(key).startswith("WSDScheduler") and isinstance(state, dict) and state.get("base_lrs"):
            peaks = state["base_lrs"][0]
    if peaks is None or len(peaks) != len(lrs):
        return None
    return lrs, [float(x) for x in peaks]


def warn_if_the_lr_moves(ckpt: Path, start: int, key: str, node, *, label: str, what: str, why: str,
                         advice: str, peak_lr: float | None = None) -> None:
    """Warn when the checkpoint's LR for its next step ``start`` is below the LR that ``node``'s WSD schedule (config
    key ``key``) gives that step: the checkpoint was decaying (a finished run's last.ckpt, a branch of a branch), or
    inside a warmup longer than the new schedule's (the checkpoint does not record its run's warmup), and the new
    schedule raises the LR without a re-warmup. (A decay branch lowers the LR by design.) ``peak_lr``: the configured
    ``optimizer.lr``, the peak the new schedule uses (StepLambdaLR and WSDScheduler keep it over the checkpoint's);
    ``None``: the checkpoint's peaks. Before, an ``optimizer.lr`` lowered to the checkpoint's LR was still told that
    the LR jumps up to the checkpoint's peak times the factor."""
    lr_and_peak = checkpoint_lr_and_peak(ckpt)
    if lr_and_peak is None:
        return
    lrs, peaks = lr_and_peak
    configured = isinstance(peak_lr, (int, float)) and not isinstance(peak_lr, bool)
    starts = [float(peak_lr)] * len(lrs) if configured else peaks  # every param group starts at optimizer.lr
    factor = _factor(node, start)
    if factor is None or not below((lrs, starts), factor):
        return
    if below(lr_and_peak, 1.0):
        where = "is below its peak LR (in its warmup or decay)"
    else:  # at its own peak: optimizer.lr was raised above it
        where = f"is at its peak LR, below optimizer.lr={peak_lr:g}"
    log.warning(
        "%s %s %s: its LR for step %d is %s (peak %s), below %s %s: %s, so the LR jumps up without a re-warmup. %s, "
        "or continue a decayed model with init_from=... and a re-warmup (continual pre-training, docs/wsd.md)",
        label, ckpt, where, start, _fmt(lrs), _fmt(peaks), what, _fmt([lr * factor for lr in starts]), why, advice,
    )


def _wsd_args(node) -> dict:
    keys = ("total_steps", "warmup_steps", "decay_steps", "decay_fraction", "decay_type", "min_lr_factor")
    return {k: node.get(k) for k in keys if node.get(k) is not None or k in ("decay_steps", "decay_fraction")}


def _factor(node, step: int) -> float | None:
    """The factor that a schedule node (``scheduler``: wsd, cosine, constant; the ``WSDScheduler`` callback) gives
    ``step``; ``None`` for another target or arguments that do not validate (the config check reports those)."""
    if str(node.get("_target_", "")).endswith("WSDScheduler"):
        try:
            return wsd_lr_factor(step, **_wsd_args(node))
        except (TypeError, ValueError):
            return None
    return schedule_factor(node, step)


def _is_wsd(node) -> bool:
    return str(node.get("_target_", "")).endswith(("wsd_scheduler", "WSDScheduler"))


def _decay_start(node) -> int | None:
    """The first step of the node's decay (the cosine's is the end of its warmup); ``None`` for a constant LR."""
    target = str(node.get("_target_", ""))
    if target.endswith("cosine_scheduler"):
        return int(node.get("warmup_steps") or 0)
    if _is_wsd(node):
        total = int(node.total_steps)
        return total - resolve_decay_steps(total, node.get("decay_steps"), node.get("decay_fraction"))
    return None


def warn_if_a_resume_moves_the_lr(ckpt: Path, start: int, key: str, node, *, default_warmup: bool,
                                  peak_lr: float | None = None, fix: str | None = None) -> None:
    """A resume (not a branch's start) whose schedule (config node ``key``) gives the checkpoint's next step ``start``
    another LR than the checkpoint holds for it warns, with both LRs and why. Not for a drop into a warmup the user
    gave (``default_warmup`` false: the documented re-warm, logged at info level), nor for a decay that starts at
    ``start`` from a checkpoint at its peak (the continuous path, as a decay branch takes it). ``peak_lr``: the
    configured ``optimizer.lr``, the peak the resume trains with (``None``: the checkpoint's peaks). The schedule
    must move the LR (against the checkpoint's peak) and the LR this run gives the step must move the same way:
    a schedule that raises the factor while ``optimizer.lr`` was lowered to or below the checkpoint's LR does not
    jump up (before, it was told 'this run's is <the checkpoint's peak times the factor>... the LR jumps up'); a
    changed ``optimizer.lr`` alone is logged by :func:`log_a_changed_peak`. ``fix``: what to do, in place of the
    advice for the cause (a decay branch's restart)."""
    lr_and_peak = checkpoint_lr_and_peak(ckpt)
    factor = _factor(node, start)
    if lr_and_peak is None or factor is None:
        return
    lrs, peaks = lr_and_peak
    configured = isinstance(peak_lr, (int, float)) and not isinstance(peak_lr, bool)
    starts = [float(peak_lr)] * len(lrs) if configured else peaks  # every param group's peak is optimizer.lr
    up = below(lr_and_peak, factor) and below((lrs, starts), factor)
    down = _above(lr_and_peak, factor) and _above((lrs, starts), factor)
    if not (up or down):
        return
    warmup = int(node.get("warmup_steps") or 0)
    decay_start = _decay_start(node)
    at_peak = not below(lr_and_peak, 1.0)
    head = f"checkpoint {ckpt}: its LR for step {start} is {_fmt(lrs)} (peak {_fmt(peaks)}), this run's is " \
           f"{_fmt([lr * factor for lr in starts])}"
    grows = "the default min(100, max(1, max_steps // 10)), which follows trainer.max_steps"
    if down and start < warmup and not default_warmup:
        log.info("%s: step %d lies in %s.warmup_steps=%d as given, so the resumed steps warm up again", head, start,
                 key, warmup)
        return
    if down and at_peak and start == decay_start:
        return  # this run's decay starts at the checkpoint's step: it decays from the peak, as a decay branch does
    if start < warmup:
        cause = (f"{key}.warmup_steps={warmup}{f' ({grows})' if default_warmup else ''} lies past the step, so the "
                 "resumed steps warm up again from a lower LR" if down else
                 f"{key}.warmup_steps={warmup}{f' ({grows})' if default_warmup else ''} is shorter than the "
                 "checkpoint's run's warmup, so the LR jumps up")
        advice = f"pass {key}.warmup_steps=<the checkpoint's run's> to go on with its warmup"
        if up and (theirs := _their_warmup(ckpt, key, start)) is not None and theirs <= start:  # it was decaying
            cause = (f"the checkpoint is past its run's warmup ({key}.warmup_steps={theirs}) and below its peak, in "
                     f"its decay, and this run's {key}.warmup_steps={warmup}"
                     f"{f' ({grows})' if default_warmup else ''} gives the step a higher LR, so the LR jumps up")
            advice = ("extend a stable-phase checkpoint, or continue a decayed model with init_from=... and a "
                      "re-warmup (continual pre-training, docs/wsd.md)")
    elif up and decay_start is not None and start >= decay_start and _is_wsd(node):
        total = node.get("total_steps")
        changed = _changed(ckpt, key, node, (*_DECAY_KEYS["wsd"], "warmup_steps"), start)
        which = (": this run's " + " and ".join(changed) if changed else
                 " (another total_steps, decay length, decay_type, min_lr_factor or warmup)")
        cause = (f"the step lies in this run's decay (from step {decay_start} to total_steps={total}, "
                 f"decay_type={node.get('decay_type')}, min_lr_factor={node.get('min_lr_factor')}), which gives it a "
                 f"higher LR than the checkpoint's run's schedule did{which}, so the LR jumps up")
        advice = (f"resume with the checkpoint's run's trainer.max_steps and {key} decay settings, or branch a decay "
                  "from a stable-phase checkpoint with decay_branch.ckpt=... decay_branch.steps=N")
    elif up:
        later = f" and before or early in its decay (total_steps={node.get('total_steps')})" if decay_start else ""
        changed = _changed(ckpt, key, node, ("warmup_steps", *_DECAY_KEYS["wsd" if _is_wsd(node) else "cosine"]),
                           start)
        cause = (f"the checkpoint is below its peak, in its run's warmup or decay, and the step lies past this run's "
                 f"{key}.warmup_steps={warmup}{f' ({grows})' if default_warmup else ''}{later}, so the LR jumps up "
                 "without a re-warmup" + ("; this run's " + " and ".join(changed) if changed else ""))
        advice = (f"pass {key}.warmup_steps=<the checkpoint's run's> to go on with its warmup; extend a stable-phase "
                  "checkpoint, or continue a decayed model with init_from=... and a re-warmup (continual pre-training, "
                  "docs/wsd.md)")
    else:
        where = f"its decay starts at step {decay_start}" if decay_start is not None else "it lowers the LR there"
        cause = f"{_what_differs(ckpt, key, node, start)}: {where}, so the LR drops at the resume"
        advice = "to decay over the steps left from here, branch with decay_branch.ckpt=... decay_branch.steps=N"
    log.warning("%s: %s; %s", head, cause, advice if fix is None else fix)


# the settings that place and shape each schedule's decay, named where a resume's differ from the checkpoint's run's
_DECAY_KEYS = {
    "wsd": ("total_steps", "decay_steps", "decay_fraction", "decay_type", "min_lr_factor"),
    "cosine": ("total_steps", "warmup_steps", "min_lr_factor"),
}


def _what_differs(ckpt: Path, key: str, node, start: int) -> str:
    """This run's settings of schedule ``node`` (config ``key``) that place or shape its decay otherwise than the
    checkpoint's run's (read from its ``config_resolved.yaml``, :func:`source_config`), each with the checkpoint's
    run's value; ``total_steps`` named as ``trainer.max_steps`` where it follows it. Where that config is not there
    (or differs in none of them), this run's settings, saying whether ``total_steps`` follows ``trainer.max_steps``
    or was given. Before, every such warning said '(total_steps=X, from trainer.max_steps)', also where
    ``decay_fraction`` had changed and ``trainer.max_steps`` had not, or ``total_steps`` was given."""
    names = _DECAY_KEYS["wsd" if _is_wsd(node) else "cosine"]
    if differ := _changed(ckpt, key, node, names, start):
        return "this run's " + " and ".join(differ)
    settings = ", ".join(f"{name}={node.get(name)}" for name in names if node.get(name) is not None)
    given = "from trainer.max_steps" if _follows_max_steps(node) else "as given"
    return f"this run's {key} ({settings}; total_steps {given}) is not the checkpoint's run's"


def _follows_max_steps(node) -> bool:
    """Whether ``node.total_steps`` is written ``${trainer.max_steps}``, also through conf/callbacks/wsd.yaml's
    ``${oc.select:scheduler.total_steps,${trainer.max_steps}}`` (a resume of the callback form with another
    trainer.max_steps was told 'this run's callbacks.wsd.total_steps=12', a key not given)."""
    from omegaconf import DictConfig

    raw = written_as(node._get_root(), node, "total_steps") if isinstance(node, DictConfig) else None
    return isinstance(raw, str) and raw.replace(" ", "") == "${trainer.max_steps}"


_SELECT = re.compile(r"\$\{oc\.select:\s*([A-Za-z_][\w.]*)\s*,(.*)\}", re.DOTALL)


def written_as(cfg, node, name: str):
    """``node.<name>`` as written, not resolved; a ``${oc.select:key,default}`` followed to the key where ``cfg``
    holds it (an experiment's ``scheduler:`` settings after ``'~scheduler'``), else to its default."""
    from omegaconf import DictConfig, OmegaConf

    raw = OmegaConf.to_container(node, resolve=False).get(name)
    while isinstance(raw, str) and (select := _SELECT.fullmatch(raw.strip())):
        parent, _, leaf = select[1].rpartition(".")
        holder = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not isinstance(holder, DictConfig) or leaf not in holder or OmegaConf.is_missing(holder, leaf):
            raw = select[2]  # the key is absent: oc.select gives its default
        else:
            raw = OmegaConf.to_container(holder, resolve=False)[leaf]
    return raw


def _changed(ckpt: Path, key: str, node, names, start: int) -> list[str]:
    """Each of ``names`` that schedule ``node`` (config ``key``) sets otherwise than the checkpoint's run's config
    (:func:`source_config`), as '<key>.<name>=<this run's> where the checkpoint's run had <its>' (``total_steps``
    named as ``trainer.max_steps`` where it follows it), or the schedule where it is another (``scheduler=cosine
    where the checkpoint's run had wsd``); empty where that config is not there or differs in none of them. The
    warnings of an LR that jumps up named no setting: 'another total_steps, decay length, decay_type, min_lr_factor
    or warmup'."""
    from omegaconf import DictConfig, OmegaConf

    source = _config_of_its_start(ckpt, key, start)
    theirs = OmegaConf.select(source, key, default=None) if source is not None else None
    if not isinstance(theirs, DictConfig):
        return []
    if theirs.get("_target_") != node.get("_target_"):  # wsd <-> cosine: it named nothing
        return [f"{key}={_option(node)} where the checkpoint's run had {_option(theirs)}"]
    follows, differ = _follows_max_steps(node), []
    for name in (name for name in names if node.get(name) != theirs.get(name)):
        named = f"trainer.max_steps={node.get(name)} (which {key}.total_steps follows)" \
            if name == "total_steps" and follows else f"{key}.{name}={_yaml(node.get(name))}"
        differ.append(f"{named} where the checkpoint's run had {_yaml(theirs.get(name))}")
    return differ


def _option(node) -> str:
    """A schedule node's conf/scheduler option (``lit_dtrain.schedules.cosine_scheduler``: ``cosine``)."""
    return str(node.get("_target_")).rpartition(".")[2].removesuffix("_scheduler")


def _yaml(value) -> str:
    return "null" if value is None else str(value)  # as one types it in an override


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def source_config(ckpt: Path):
    """The config of the run that wrote ``ckpt`` (``<run>/checkpoints/x.ckpt``): its ``<run>/config_resolved.yaml``
    (a resume of that run dir has not rewritten it yet); ``None`` when it is missing or unreadable (a checkpoint
    does not record its config)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(Path(ckpt).resolve().parent.parent / "config_resolved.yaml")
    except Exception:  # noqa: BLE001 - missing, unreadable or not YAML: nothing to read from it
        return None


def _config_of_its_start(ckpt: Path, key: str, start: int):
    """:func:`source_config`, where its schedule (node ``key``) gives step ``start`` the LR that ``ckpt`` holds for
    it: a later start of the run dir rewrites that file before its first checkpoint (a resume with
    trainer.max_steps=2000, killed in training), and then its values are not those the checkpoint was trained with.
    A resume with max_steps=20 was told 'trainer.max_steps=20 where the checkpoint's run had 2000' of a step-10
    checkpoint of a 10-step run. A schedule that cannot be evaluated is taken as it is."""
    from omegaconf import DictConfig, OmegaConf

    source = source_config(ckpt)
    theirs = OmegaConf.select(source, key, default=None) if source is not None else None
    lr_and_peak = checkpoint_lr_and_peak(ckpt)
    if isinstance(theirs, DictConfig) and lr_and_peak is not None:
        try:
            factor = _factor(theirs, start)
        except Exception:  # noqa: BLE001 - a schedule of an older version: nothing to check it by
            factor = None
        if factor is not None and (below(lr_and_peak, factor) or _above(lr_and_peak, factor)):
            return None
    return source


def _their_warmup(ckpt: Path, key: str, start: int) -> int | None:
    """The ``<key>.warmup_steps`` of the run that wrote ``ckpt`` (:func:`_config_of_its_start`), or None."""
    from omegaconf import OmegaConf

    source = _config_of_its_start(ckpt, key, start)
    try:
        value = OmegaConf.select(source, f"{key}.warmup_steps") if source is not None else None
    except (ValueError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def source_warmup(ckpt: Path, key: str) -> int | None:
    """The ``<key>.warmup_steps`` of the run that wrote ``ckpt``, read from its config (:func:`source_config`);
    ``None`` when that file or key is missing."""
    from omegaconf import OmegaConf

    source = source_config(ckpt)
    try:
        value = OmegaConf.select(source, f"{key}.warmup_steps") if source is not None else None
    except (ValueError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def branch_in_warmup_fix(ckpt: Path, key: str, start: int) -> str:
    """The fix a decay branch refused for a default warmup grown past ``start`` is told: one that is accepted. The
    source run's warmup, where that lies at or before the step (the checkpoint is past it); where the checkpoint is
    inside it, any warmup past the step is refused too, so: train the source run past it first."""
    warmup = source_warmup(ckpt, key)
    if warmup is None:
        return (f", or set {key}.warmup_steps to the source run's warmup if the checkpoint is past it (at most "
                f"{start})")
    if warmup <= start:
        return f", or set {key}.warmup_steps={warmup} (the source run's)"
    return (f"; the checkpoint is inside the source run's own warmup too ({key}.warmup_steps={warmup} in its "
            f"config_resolved.yaml): train the source run past step {warmup} first")
