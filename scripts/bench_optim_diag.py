#!/usr/bin/env python
"""Overhead of OptimizerDiagnostics (and of LossSpikeMonitor / AdaptiveGradClip) on the default nano model.

Two measures, both side by side in this process:

1. hook time: the wall time spent inside each callback's hooks, divided by the run's wall time. This is
   insensitive to the noise of a shared machine and is the number the <= 2% target is checked against;
2. end-to-end: seconds per step of runs with and without the callback, median over repeats. One untimed
   2-step run first takes the process's one-time costs (the token cache, the first fit); each repeat then runs
   every variant in an order rotated by one (A B C, B C A, ...), so that no variant is always first.

Each run trains the nano model (conf/model/nano.yaml) on the stdlib corpus; the sequence length and batch
default to 64 and 8 so that it fits 2 shared CPU cores (``--block-size``, ``--batch-size``). Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lit_dtrain.callbacks import AdaptiveGradClip, LossSpikeMonitor, OptimizerDiagnostics  # noqa: E402
from lit_dtrain.config_resolvers import default_cache_dir  # noqa: E402
from lit_dtrain.data import LMDataModule  # noqa: E402
from lit_dtrain.module import LitLLM  # noqa: E402
from lit_dtrain.optim import adamw  # noqa: E402
from lit_dtrain.utils.args import ScriptArgumentParser, positive_int, window_int  # noqa: E402
from lit_dtrain.utils.scripts import rotated  # noqa: E402

# (OptimizerDiagnostics also measures inside optimizer.step, through torch step pre/post hooks: _pre_step, _post_step)
HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
         "on_train_batch_end", "_pre_step", "_post_step")


def timed(callback: L.Callback) -> L.Callback:
    """Wraps the callback's hooks with a wall-clock accumulator (``callback.hook_seconds``)."""
    callback.hook_seconds = 0.0
    for name in HOOKS:
        fn = getattr(callback, name, None)
        if fn is None:
            continue

        def wrapper(*args, _fn=fn, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                callback.hook_seconds += time.perf_counter() - t0

        setattr(callback, name, wrapper)
    return callback


def run(args, callback: L.Callback | None) -> tuple[float, float]:
    """Trains ``args.steps`` steps; returns (seconds per step, hook seconds)."""
    torch.manual_seed(0)
    model_cfg = OmegaConf.load(ROOT / "conf/model/nano.yaml")
    model_cfg.block_size = args.block_size
    model = instantiate(model_cfg)
    lit = LitLLM(model, optimizer=partial(adamw, lr=3e-3))
    dm = LMDataModule(block_size=args.block_size, batch_size=args.batch_size, progress=False,
                      cache_dir=default_cache_dir())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=1.0, callbacks=[callback] if callback else [])
    t0 = time.perf_counter()
    trainer.fit(lit, datamodule=dm)
    seconds = time.perf_counter() - t0
    return seconds / args.steps, getattr(callback, "hook_seconds", 0.0)


def main() -> None:
    p = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=200, help="steps per run")
    p.add_argument("--repeats", type=positive_int, default=3, help="repeats per variant (rotated order)")
    p.add_argument("--block-size", type=window_int, default=64, help="tokens per window")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per step")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (1 is stable on a shared machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    default_interval = OptimizerDiagnostics().every_n_steps
    variants = {
        "none": lambda: None,
        f"diag_every_{default_interval}": lambda: timed(OptimizerDiagnostics()),
        "diag_every_1": lambda: timed(OptimizerDiagnostics(every_n_steps=1)),
        "loss_spike_skip": lambda: timed(LossSpikeMonitor(actions=["log", "skip"])),
        "loss_spike_rollback": lambda: timed(LossSpikeMonitor(actions=["log", "rollback"])),
        "adaptive_grad_clip": lambda: timed(AdaptiveGradClip()),
    }
    step_s: dict[str, list[float]] = {k: [] for k in variants}
    hook_frac: dict[str, list[float]] = {k: [] for k in variants}
    run(argparse.Namespace(**{**vars(args), "steps": 2}), None)  # untimed: the first run paid the token cache
    for r in range(args.repeats):
        for name in rotated(list(variants), r):
            per_step, hook = run(args, variants[name]())
            step_s[name].append(per_step)
            hook_frac[name].append(hook / (per_step * args.steps))
            print(f"repeat {r} {name:22s} {per_step * 1e3:7.1f} ms/step  hooks {100 * hook_frac[name][-1]:.3f}%",
                  flush=True)
    base = statistics.median(step_s["none"])
    result = {"steps": args.steps, "repeats": args.repeats, "block_size": args.block_size,
              "batch_size": args.batch_size, "ms_per_step_none": base * 1e3}
    for name in variants:
        if name == "none":
            continue
        med = statistics.median(step_s[name])
        result[f"ratio_ms_per_step_{name}"] = med / base
        result[f"hook_overhead_pct_{name}"] = 100 * statistics.median(hook_frac[name])
        print(f"{name:22s} step ratio over none {med / base:.3f}  "
              f"hook overhead {result[f'hook_overhead_pct_{name}']:.3f}%")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
