"""The LR a resume (``ckpt_path``, ``resume=auto``, a decay branch) gives the checkpoint's next step against the LR the
checkpoint holds for it: a WSD schedule that is not the checkpoint's run's can raise it (extending a decayed run, a
decay branch from the peak) or lower it (a larger ``trainer.max_steps`` whose default warmup grows past a checkpoint
still inside its warmup), both without a word from the optimizer; these warn with both LRs."""

from __future__ import annotations

import logging
from pathlib import Path

from lit_dtrain.checkpoint import safe_torch_load
from lit_dtrain.schedules.lr import resolve_decay_steps, wsd_lr_factor

log = logging.getLogger("lit_dtrain.schedules.workflows")  # the workflows' logger: one name to filter

# the wording of warn_if_the_lr_moves for a decay branch and for any other resume
BRANCH_JUMP = {
    "label": "decay_branch.ckpt",
    "what": "the branch's first LR",
    "why": "the branch decays from the peak",
    "advice": "Branch from a stable-phase checkpoint",
}
RESUME_JUMP = {
    "label": "checkpoint",
    "what": "this run's LR for that step",
    "why": "this run's schedule is not the checkpoint's (a larger trainer.max_steps moves the decay later)",
    "advice": "Extend a stable-phase checkpoint",
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


def warn_if_the_lr_moves(ckpt: Path, start: int, key: str, node, *, label: str, what: str, why: str, advice: str,
                         drops: bool = False) -> None:
    """Warn when the checkpoint's LR for its next step ``start`` is below the LR that ``node``'s WSD schedule (config
    key ``key``) gives that step: the checkpoint was decaying (a finished run's last.ckpt, a branch of a branch), or
    inside a warmup longer than the new schedule's (the checkpoint does not record its run's warmup), and the new
    schedule raises the LR without a re-warmup. With ``drops`` (a resume, not a branch, whose decay lowers the LR by
    design), also when it is above: the new schedule lowers it (a default warmup grown past the step, an earlier
    decay)."""
    lr_and_peak = checkpoint_lr_and_peak(ckpt)
    if lr_and_peak is None:
        return
    total = int(node.total_steps)
    warmup = int(node.get("warmup_steps") or 0)
    factor = wsd_lr_factor(
        start,
        total_steps=total,
        warmup_steps=warmup,
        decay_steps=resolve_decay_steps(total, node.get("decay_steps"), node.get("decay_fraction")),
        decay_type=str(node.get("decay_type", "1-sqrt")),
        min_lr_factor=float(node.get("min_lr_factor", 0.0)),
    )
    lrs, peaks = lr_and_peak
    new = _fmt([peak * factor for peak in peaks])
    if below(lr_and_peak, factor):
        log.warning(
            "%s %s is below its peak LR (in its warmup or decay): its LR for step %d is %s (peak %s), below %s %s: "
            "%s, so the LR jumps up without a re-warmup. %s, or continue a decayed model with init_from=... and a "
            "re-warmup (continual pre-training, docs/wsd.md)",
            label, ckpt, start, _fmt(lrs), _fmt(peaks), what, new, why, advice,
        )
    elif drops and _above(lr_and_peak, factor):
        cause = (
            f"{key}.warmup_steps={warmup} lies past the checkpoint's step (the default min(100, max(1, max_steps // "
            "10)) grows with trainer.max_steps), so the resumed steps warm up again from a lower LR; pass "
            f"{key}.warmup_steps=<the checkpoint's run's> to go on with its warmup"
            if start < warmup
            else f"this run's {key} (total_steps={total}, trainer.max_steps) decays earlier than the checkpoint's"
        )
        log.warning(
            "%s %s: its LR for step %d is %s (peak %s), above %s %s: %s",
            label, ckpt, start, _fmt(lrs), _fmt(peaks), what, new, cause,
        )


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
