"""Warnings for a composed config that trains, but not what its command reads as: the default callbacks dropped by a
``callbacks=<one choice>`` override, a FourierSampler stage schedule longer than the run, and a checkpoint file name
that shows another metric than the one it is ranked by. ``check_config`` runs them; rank 0 logs."""

from __future__ import annotations

import logging
import re

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("lit_dtrain.config_checks")  # beside the other start-up checks' lines


def warn_if_the_default_callbacks_are_dropped(cfg: DictConfig) -> None:
    """``callbacks=loss_spike`` (meant as ``'callbacks=[default,loss_spike]'``) selects that callback *instead of* the
    default group: the run wrote no checkpoint before its end (none at a validation, none on SIGTERM), and no LR or
    throughput curves, without a word. ``callbacks=none`` (nothing at all) and ``callbacks.model_checkpoint=null`` are
    meant: no warning."""
    callbacks = cfg.get("callbacks") or {}
    if callbacks and "model_checkpoint" not in callbacks and rank_zero_only.rank == 0:
        names = ",".join(callbacks)
        log.warning("callbacks=[%s] replaces the default callbacks (model_checkpoint, preemption, lr_monitor, "
                    "throughput, memory): no checkpoint before the run's end, none on SIGTERM; to add to them: "
                    "'callbacks=[default,%s]'", names, names)


def warn_if_the_stages_outlast_the_run(cfg: DictConfig) -> None:
    """``data/sampler=fourier`` keeps the brief's stage schedule (LR x0.1 to step 5 * step_unit, x0.5 to 20 *
    step_unit, step_unit 1000): the default 1000-step run trained every step at 0.1 of ``optimizer.lr``, and a
    ``-m data/sampler=random,fourier`` comparison showed the sampler far behind (val 4.60 against 3.45 after 10
    steps), without a word. A bad value is left to the sampler's own error."""
    node = OmegaConf.select(cfg, "data.sampler", default=None)
    if not (isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith("FourierSampler")):
        return
    if not (node.get("stages", True) and node.get("stage_lr", True)) or rank_zero_only.rank != 0:
        return
    from lit_dtrain.data.samplers import spectral

    max_steps, unit = cfg.trainer.get("max_steps"), node.get("step_unit", 1000)
    try:
        stages = spectral.parse_stages(node.get("stage_table"))
        last = spectral.stage_at(int(max_steps) - 1, float(unit), stages)
    except (TypeError, ValueError):
        return
    if last.lr_mult >= stages[-1].lr_mult:
        return
    log.warning("data/sampler=fourier: trainer.max_steps=%s ends in the sampler's stage '%s' (LR x%g of "
                "optimizer.lr, x%g from step 0): its last stage (x%g) starts at step %g = %g x "
                "data.sampler.step_unit=%g. Scale the stages to the run with data.sampler.step_unit=<max_steps / "
                "%g>, or set data.sampler.stage_lr=false", max_steps, last.name, last.lr_mult, stages[0].lr_mult,
                stages[-1].lr_mult, stages[-1].start * float(unit), stages[-1].start, float(unit),
                stages[-1].start / 0.4)


# val/ppl is exp(val/loss), strictly increasing: the two rank checkpoints alike, so a file named by one is also the
# best by the other (monitor=val/ppl with the default filename warned, though its best file was val/loss's)
SAME_RANKING = frozenset({"val/loss", "val/ppl"})


def warn_if_a_checkpoint_name_shows_another_metric(cfg: DictConfig) -> None:
    """``callbacks.model_checkpoint.monitor=val/text/loss`` (a mixture's per-source loss) keeps the default
    ``filename: step{step:06d}-val{val/loss:.4f}``: the best checkpoint by the text source's loss was written as
    ``step000012-val3.5197.ckpt``, 3.5197 the pooled ``val/loss``, which reads as its score, without a word."""
    if rank_zero_only.rank != 0:
        return
    for key, node in (cfg.get("callbacks") or {}).items():
        if not isinstance(node, DictConfig):
            continue
        monitor, filename = node.get("monitor"), node.get("filename")
        if not (isinstance(monitor, str) and isinstance(filename, str)):
            continue
        shown = [m for m in re.findall(r"\{([^}:]+)", filename) if m not in ("step", "epoch")]
        if shown and monitor not in shown and not (SAME_RANKING >= {monitor, *shown}):
            fixed = filename.replace("{" + shown[0], "{" + monitor, 1)
            log.warning("callbacks.%s ranks its checkpoints by monitor=%s, but its filename %r shows %s: the best "
                        "file's name holds another metric's value; to name it by the ranked one: "
                        "callbacks.%s.filename='%s'", key, monitor, filename, ", ".join(shown), key, fixed)
