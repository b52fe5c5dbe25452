"""The end of a ``train(cfg)`` run: the text sample rank 0 draws (:mod:`lit_dtrain.end_sample`), the unigram entropy
``summary.json`` records beside the loss, and the report (``summary.json``, the sample, the one summary line)."""

from __future__ import annotations

import json
import logging
import math
import shlex
import signal
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from lit_dtrain.callbacks.memory_monitor import highest, memory_mib
from lit_dtrain.data._mixture_resume import mixture_shares
from lit_dtrain.end_sample import generate_sample, sample_skip_reason
from lit_dtrain.module import LitLLM
from lit_dtrain.run_dirs import SUMMARY_LINE
from lit_dtrain.sigterm_exit import SampleCut
from lit_dtrain.utils.atomic import write_atomically
from lit_dtrain.utils.job_log import log_to_handlers

log = logging.getLogger("lit_dtrain.train")  # train.py's logger: its job log's handlers write the summary line


def reported_before(previous: dict) -> bool:
    """Whether ``previous`` (:func:`~lit_dtrain.train_callbacks.figures_of_the_fit_that_trained`, on rank 0) is of
    the ``summary.json`` an earlier start wrote at this very end: it counted the train split's ``unigram_entropy``,
    which it holds (and drew the sample of these weights then, where its ``sample_drawn`` says so). A restart of a
    finished run (a continued sweep's finished job) drew and counted both again: 16.5 s of its 33.6 s for model=nano
    on 2 busy CPU cores, the same sample and summary.json as the first start's."""
    return "unigram_entropy" in previous


def sample_settings(cfg: DictConfig) -> dict:
    """What the end-of-run sample is drawn with, for ``summary.json``'s ``sample_settings``: ``sample.*`` and
    ``seed``."""
    sample = cfg.get("sample") or {}
    return {**(OmegaConf.to_container(sample, resolve=True) if isinstance(sample, DictConfig) else dict(sample)),
            "seed": int(cfg.seed)}


def _generate_sample(module: LitLLM, datamodule, cfg: DictConfig, trainer: L.Trainer, checkpoint: str,
                     previous: dict | None = None) -> str:
    """The end-of-run sample on rank 0; "" on the other ranks, under a strategy that shards the weights, and where
    an earlier start sampled these weights with these settings (its ``summary.json``'s ``sample_drawn``: not one
    whose sample a SIGTERM cut, nor one with ``sample.max_new_tokens=0``, which a restart then said it 'drew' and
    drew none; and its ``sample_settings``: a restart given another ``sample.prompt`` or ``seed`` drew none)."""
    reason = sample_skip_reason(trainer.strategy, trainer.world_size, trainer.is_global_zero, checkpoint)
    previous = previous or {}
    if reason is None and previous.get("sample_drawn") is True and previous.get("sample_settings") == \
            sample_settings(cfg):  # (max_new_tokens=0: no sample, no line)
        drawn = int((cfg.get("sample") or {}).get("max_new_tokens") or 0) > 0
        reason = ("no text sample: the start that trained these weights drew it (this one only validated); sample "
                  f"them with: python scripts/generate.py {shlex.quote(checkpoint)}") if drawn else ""
    if reason is not None:
        if reason and trainer.is_global_zero:
            log.info(reason)
        return ""
    model = getattr(module.model, "_orig_mod", module.model)
    try:
        return generate_sample(model, datamodule.tokenizer, cfg.get("sample") or {}, int(cfg.seed), module.device)
    except SampleCut as cut:  # the finished run's summary.json and exit come first (SIGKILL follows a SIGTERM)
        hint = "" if trainer.fast_dev_run else \
            f"; sample the saved weights: python scripts/generate.py {shlex.quote(checkpoint)}"
        log.warning("no text sample: %s came %s%s", signal.Signals(cut.args[0]).name, cut.args[1], hint)
        return ""


def summary_entropy(trainer: L.Trainer, datamodule, previous: dict | None = None) -> float | None:
    """``unigram_entropy`` (a count over the whole train split) on rank 0, which writes it; ``None`` elsewhere. A
    start that only validated keeps the one its ``summary.json`` holds (:func:`reported_before`): the entropy of the
    data its steps were trained on."""
    if not trainer.is_global_zero:
        return None
    kept = reported_before(previous or {}) and same_data(datamodule)
    return previous["unigram_entropy"] if kept else datamodule.unigram_entropy()


def same_data(datamodule) -> bool:
    """Whether the checkpoint this start restored was trained on this start's train split and mixture shares, which
    the entropy is of: a finished run restarted with ``resume=auto`` on another corpus (the resume warns, and
    validates on it) kept the first corpus's 3.23 nats beside a val_loss on the new one, whose entropy is 0.51."""
    saved = getattr(datamodule, "restored_data", None)
    return saved == (datamodule.sampler.dataset_key, mixture_shares(datamodule.sources))


@rank_zero_only
def _report(metrics: dict, sample: str, out_dir: Path, trainer: L.Trainer, write_summary: bool = True,
            settings: dict | None = None) -> None:
    """The sample and the summary line; ``summary.json`` unless ``write_summary`` is False (a ``fast_dev_run`` smoke
    test: one run with ``resume=auto`` in a finished run's dir replaced its summary by the smoke test's, its
    ``checkpoint`` by null and its ``val_loss`` by one batch's). ``settings``: the sample's (:func:`sample_settings`;
    an earlier start's sample is kept only where they are the same)."""
    # or an earlier start's of these settings (a restart with another prompt whose sample was cut, or off, drew none)
    earlier = metrics.pop("sample_drawn", None) is True
    earlier = metrics.pop("sample_settings", None) == settings and earlier
    metrics["sample_drawn"] = earlier or bool(sample)  # (last in summary.json)
    metrics["sample_settings"] = settings if metrics["sample_drawn"] else None
    if "peak_rss_mib" in metrics:  # and the sample's, which rank 0 alone drew
        metrics["peak_rss_mib"] = highest(metrics["peak_rss_mib"], memory_mib().get("memory/peak_rss_mib"))
    if write_summary:
        safe = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        text = json.dumps(safe, indent=2, allow_nan=False)  # strict JSON: NaN/inf become null
        write_atomically(out_dir / "summary.json", lambda tmp: tmp.write_text(text))
    if sample:
        print(f"--- sample ---\n{sample}\n--------------")
        for lg in trainer.loggers:
            if hasattr(getattr(lg, "experiment", None), "add_text"):
                lg.experiment.add_text("sample", f"```\n{sample}\n```", global_step=trainer.global_step)
    tokens_per_sec, ppl = metrics["tokens_per_sec"], metrics["val_ppl"]
    # a rate below 10 with two figures: 0.4 tokens/s (llama_125m on a CPU) read 'tokens/s=0'
    rate = "-" if tokens_per_sec is None else f"{tokens_per_sec:.0f}" if tokens_per_sec >= 10 \
        else f"{tokens_per_sec:.2g}"
    summary = (
        f"{SUMMARY_LINE}{metrics['val_loss']:.4f} ppl={f'{ppl:.2f}' if ppl < 1e6 else f'{ppl:.3g}'} "
        f"tokens/s={rate} steps={metrics['steps']} "
        f"wall={metrics['wall_seconds']:.1f}s ckpt={metrics['checkpoint']}"
        + (f" stopped={metrics['stopped']}" if metrics.get("stopped", "max_steps") != "max_steps" else "")
        + (" DIVERGED" if metrics.get("diverged") else "")
        + ("" if write_summary else " (fast_dev_run: no summary.json)")
    )
    print(summary)
    log_to_handlers(log, summary)  # and into train.log, which held every line of the run but this one
