#!/usr/bin/env python
"""Inject loss spikes deterministically into the default model's training and compare recoveries.

Injections (at fixed optimizer steps, the same in every injected run):

- ``random_tokens``: that step's batch is replaced by uniformly random tokens (a corrupt shard);
- ``lr_x100``: that step's update uses 100x the scheduled LR (a bad update; the loss spikes one step later);
- ``nan_loss``: the model's logits are NaN for that step (a numerical blow-up: NaN loss and grads).

Runs, one after another in this process, each from the same seed and data:

- ``clean``: no injection, our ``LossSpikeMonitor`` on (rollback mode, so snapshots are taken): false
  positives, and the reference val loss; Lightning's ``SpikeDetection`` rides along passively (recording
  instead of raising) to count its false positives too;
- ``unprotected``: injected, no monitor (ours rides along with ``actions=[log]`` only, Lightning's passively);
- ``unprotected_no_nan``: injected without the NaN, no monitor: how much the other two spikes cost;
- ``lightning``: injected, Lightning's ``SpikeDetection`` as shipped (it raises at the first spike it sees);
- ``skip`` and ``rollback``: injected, our monitor with that action.

Recall counts an injection at step s as detected when the detector fires at a step in [s, s+2]. The model is
the default nano model (conf/model/nano.yaml); to fit 2 shared CPU cores the sequence length and batch
default to 64 and 8 (``--block-size``, ``--batch-size``). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import SpikeDetection
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lit_dtrain.callbacks import LossSpikeMonitor  # noqa: E402
from lit_dtrain.config_resolvers import default_cache_dir  # noqa: E402
from lit_dtrain.train import train  # noqa: E402
from lit_dtrain.utils.args import (  # noqa: E402
    ScriptArgumentParser,
    comma_list,
    nonnegative_int,
    positive_int,
    seed_int,
    window_int,
)
from lit_dtrain.utils.plots import OutputPathError, output_path  # noqa: E402

KINDS = ("random_tokens", "lr_x100", "nan_loss")
VARIANTS = ("clean", "unprotected", "unprotected_no_nan", "lightning", "skip", "rollback")


class SpikeInjector(L.Callback):
    """Injects the configured spikes and records the per-step training loss."""

    def __init__(self, schedule: dict[int, str], seed: int = 0) -> None:
        self.schedule, self.seed = dict(schedule), seed
        self.losses: list[float] = []
        self.z: list[float] = []  # our monitor's loss z-score and relative rise per step (when it is on)
        self.rel: list[float] = []
        self.trainer = None
        self._handle = self._lr_hook = None
        self._lr_saved = None

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kind = self.schedule.get(trainer.global_step)
        if kind == "random_tokens":
            g = torch.Generator().manual_seed(self.seed + trainer.global_step)
            vocab = pl_module.model.config.vocab_size if hasattr(pl_module.model, "config") else 257
            for key in ("input_ids", "labels"):
                batch[key].copy_(torch.randint(vocab, batch[key].shape, generator=g))
        elif kind == "nan_loss":
            self._handle = pl_module.model.register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.schedule.get(trainer.global_step) == "lr_x100":
            self._lr_saved = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] *= 100.0
            # removed at the batch end: removing it inside torch's loop over the step hooks raised "OrderedDict
            # mutated during iteration" whenever another post hook was registered after it
            self._lr_hook = optimizer.register_step_post_hook(lambda *a: self._restore(optimizer))
            self._lr_optimizer = optimizer

    def _restore(self, optimizer):
        if self._lr_saved is not None:
            for g, lr in zip(optimizer.param_groups, self._lr_saved):
                g["lr"] = lr
            self._lr_saved = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._lr_hook is not None:  # and the LR put back where the step was skipped (the hook never ran)
            self._lr_hook.remove()
            self._lr_hook = None
            self._restore(self._lr_optimizer)
        self.losses.append(float(outputs["loss"]))
        monitor = next((c for c in trainer.callbacks if isinstance(c, LossSpikeMonitor)), None)
        if monitor is not None and monitor.last_decision is not None:
            self.z.append(monitor.last_decision.loss_z)
            self.rel.append(monitor.last_decision.loss_rel)


class RecordingSpikeDetection(SpikeDetection):
    """Lightning's SpikeDetection, recording the steps it would raise at instead of raising."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.spike_batches: list[int] = []

    def _handle_spike(self, fabric, batch_idx: int) -> None:
        self.spike_batches.append(int(batch_idx))


def compose_cfg(args, run: str, extra: list[str]):
    overrides = [
        f"model.block_size={args.block_size}", f"data.batch_size={args.batch_size}",
        f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
        f"data.max_val_windows={args.val_windows}", "data.progress=false", "sample.max_new_tokens=0",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks.progress_bar=null",
        "trainer.accelerator=cpu", f"seed={args.seed}", f"scheduler.warmup_steps={min(100, args.steps // 10)}",
    ] + extra
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(Path(args.out_dir) / run)
        cfg.paths.cache_dir = default_cache_dir()
    return cfg


def run_variant(args, name: str, schedule: dict[int, str], monitor: dict | None, lightning: str | None) -> dict:
    """One training run; returns its numbers (val loss, detections, per-step losses)."""
    extra = []
    if monitor is not None:
        extra += ["callbacks=[default,loss_spike]", f"callbacks.loss_spike.snapshot_every={args.snapshot_every}",
                  f"callbacks.loss_spike.warmup_steps={args.warmup_steps}"]
        extra += [f"callbacks.loss_spike.{k}={v}" for k, v in monitor.items()]
    cfg = compose_cfg(args, name, extra)
    protects = monitor is not None and ("skip" in monitor["actions"] or "rollback" in monitor["actions"])
    if not protects and "check_finite" in cfg.get("module", {}):
        cfg.module.check_finite = False  # LitLLM's NaN-grad stop off: no protection but the one compared
    injector = SpikeInjector(schedule, seed=args.seed)
    extra_callbacks = [injector]
    if lightning == "raise":
        extra_callbacks.append(SpikeDetection())
    elif lightning == "record":
        extra_callbacks.append(RecordingSpikeDetection())
    import lit_dtrain.train as train_mod

    build = train_mod.build_callbacks
    train_mod.build_callbacks = lambda c: build(c) + extra_callbacks
    t0 = time.perf_counter()
    halted_at = None
    try:
        metrics, objects = train(cfg)
        val_loss = metrics["val_loss"]
        trainer = objects["trainer"]
    except Exception as e:  # Lightning's SpikeDetection (or LitLLM's finite-grad guard) stopped the run
        if type(e).__name__ not in ("TrainingSpikeException", "NonFiniteError"):
            raise
        print(f"[{name}] stopped: {type(e).__name__}: {str(e)[:160]}", flush=True)
        trainer = injector.trainer
        halted_at = trainer.global_step
        val = trainer.validate(trainer.lightning_module, datamodule=trainer.datamodule, verbose=False)
        val_loss = float(val[0]["val/loss"])
    finally:
        train_mod.build_callbacks = build
    ours = next((c for c in trainer.callbacks if isinstance(c, LossSpikeMonitor)), None)
    light = next((c for c in trainer.callbacks if isinstance(c, SpikeDetection)), None)
    out = {
        "name": name, "val_loss": val_loss, "seconds": time.perf_counter() - t0, "halted_at": halted_at,
        "ours_steps": [e["step"] for e in ours.events if e["actions"]] if ours else None,
        "ours_level_shifts": [e["step"] for e in ours.events if not e["actions"]] if ours else None,
        "ours_events": ours.events if ours else None,
        "lightning_steps": getattr(light, "spike_batches", None) if light else None,
        "losses": injector.losses,
    }
    if injector.z:
        warm = [(z, r) for z, r in zip(injector.z, injector.rel) if math.isfinite(z)][args.warmup_steps:]
        out["max_loss_z"] = max(z for z, _ in warm)
        out["max_loss_rel"] = max(r for _, r in warm)
    print(f"[{name}] val_loss={val_loss:.4f} ours={out['ours_steps']} lightning={out['lightning_steps']} "
          f"halted_at={halted_at} ({out['seconds']:.0f}s)", flush=True)
    return out


def recall(detected_steps: list[int] | None, schedule: dict[int, str], slack: int = 2) -> dict[str, bool]:
    steps = detected_steps or []
    return {f"{kind}@{s}": any(s <= d <= s + slack for d in steps) for s, kind in sorted(schedule.items())}


def injection(text: str) -> tuple[int, str]:
    """An ``argparse`` type for one ``--inject`` entry ``kind:step``: ``(step, kind)``."""
    kind, sep, step = text.partition(":")
    if not sep or kind not in KINDS:
        raise argparse.ArgumentTypeError(f"expected kind:step with kind in {list(KINDS)}")
    return nonnegative_int(step), kind


def parse_schedule(entries: list[tuple[int, str]], steps: int) -> dict[int, str]:
    """``{step: kind}`` of the parsed ``--inject`` entries; ``ValueError`` for two at one step (the first was
    dropped silently) and for a step the run never reaches (it was never injected, and recall counted it missed)."""
    schedule = dict(entries)
    steps_given = [step for step, _ in entries]
    twice = sorted({step for step in steps_given if steps_given.count(step) > 1})
    if twice:
        raise ValueError(f"--inject: two injections at step(s) {twice}")
    late = sorted(s for s in schedule if s >= steps)
    if late:
        raise ValueError(f"--inject: step(s) {late} are not below --steps {steps}: the run never reaches them")
    return schedule


def plot(results: dict, schedule: dict[int, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name in ("clean", "unprotected_no_nan", "skip", "rollback"):
        if name not in results:
            continue
        losses = torch.tensor(results[name]["losses"]).nan_to_num(20.0)
        padded = torch.nn.functional.pad(losses[None, None], (10, 10), mode="replicate")[0, 0]
        rolling_median = padded.unfold(0, 21, 1).median(dim=1).values  # single-step spikes vanish, damage stays
        axes[0].plot(rolling_median.numpy(), label=name, lw=1)
        axes[1].plot(losses.numpy(), label=name, lw=0.6)
    for ax in axes:
        for s, kind in schedule.items():
            ax.axvline(s, color="k", ls=":", lw=0.8)
            ax.text(s, ax.get_ylim()[1] if ax is axes[1] else 2.95, kind, fontsize=7, rotation=90, va="top")
    axes[0].set_ylim(1.3, 3.0)
    axes[0].set_ylabel("train loss (21-step rolling median)")
    axes[1].set_ylabel("train loss per step (NaN drawn at 20)")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("optimizer step")
    axes[0].legend(loc="upper left", bbox_to_anchor=(0.12, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=2000,
                   help="optimizer steps per run (>= 2000 for the FP target)")
    p.add_argument("--block-size", type=window_int, default=64, help="tokens per sample (nano's default is 256)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="micro-batch (the default config's too)")
    p.add_argument("--val-windows", type=positive_int, default=512, help="validation windows (same for every run)")
    p.add_argument("--inject", type=comma_list(injection), default="random_tokens:610,lr_x100:1130,nan_loss:1660",
                   help="comma list kind:step (0 <= step < --steps) with kind in " + ", ".join(KINDS))
    p.add_argument("--snapshot-every", type=positive_int, default=50, help="rollback snapshot cadence")
    p.add_argument("--variants", type=comma_list(choices=VARIANTS), default=",".join(VARIANTS),
                   help="comma list of " + ", ".join(VARIANTS))
    p.add_argument("--warmup-steps", type=nonnegative_int, default=50, help="our monitor's statistics warmup")
    p.add_argument("--seed", type=seed_int, default=1337, help="train.py's seed and the injector's")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--out-dir", default="outputs/bench_spikes",
                   help="run dirs and results.json (relative paths: under the current directory; the path is printed)")
    p.add_argument("--plot", default=None,
                   help="figure path (default OUT_DIR/spikes_loss.png; '' to skip); the docs' figure is written only "
                        "when asked: --plot docs/img/spikes_loss.png")
    args = p.parse_args()
    try:
        schedule = parse_schedule(args.inject, args.steps)
    except ValueError as e:
        p.error(str(e))
    if args.warmup_steps < 2:  # was the monitor's ValueError traceback from Hydra's instantiate, at the first run
        p.error(f"--warmup-steps {args.warmup_steps}: LossSpikeMonitor needs >= 2 steps of statistics warmup")
    if args.warmup_steps >= args.steps:  # the clean run's max loss z-score was max() of no steps, after the runs
        p.error(f"--warmup-steps ({args.warmup_steps}) must be below --steps ({args.steps})")
    try:  # before the runs: an --out-dir that is a file failed at the first, a .txt --plot after the last
        if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
            raise OutputPathError(f"--out-dir {args.out_dir!r} is a file; give a directory")
        output_path(Path(args.out_dir) / "results.json", "--out-dir")  # made (or named) now: one below a file too
        args.plot = str(output_path(args.plot, "--plot", image=True)) if args.plot else args.plot
    except OutputPathError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    print(f"writing runs and results.json to {Path(args.out_dir).resolve()}", file=sys.stderr)
    no_nan = {s: k for s, k in schedule.items() if k != "nan_loss"}
    plans = {
        "clean": ({}, {"actions": "[log,rollback]"}, "record"),
        "unprotected": (schedule, {"actions": "[log]"}, "record"),
        "unprotected_no_nan": (no_nan, None, None),
        "lightning": (schedule, None, "raise"),
        "skip": (schedule, {"actions": "[log,skip]"}, None),
        "rollback": (schedule, {"actions": "[log,rollback]"}, None),
    }
    results = {}
    for name in args.variants:
        sched, monitor, lightning = plans[name]
        results[name] = run_variant(args, name, sched, monitor, lightning)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"schedule": schedule, "results": results}, default=str))
    plot_path = out_dir / "spikes_loss.png" if args.plot is None else Path(args.plot) if args.plot else None
    if plot_path is not None:
        plot(results, schedule, plot_path)

    def val(name):
        return results[name]["val_loss"] if name in results else None

    summary: dict = {"injected": len(schedule), "steps": args.steps, "block_size": args.block_size,
                     "batch_size": args.batch_size}
    for name in ("rollback", "skip", "unprotected"):
        if name in results:
            rec = recall(results[name]["ours_steps"], schedule)
            summary[f"recall_{name}"] = rec
    main_run = "rollback" if "rollback" in results else "skip" if "skip" in results else None
    summary["detected"] = sum(summary[f"recall_{main_run}"].values()) if main_run else None
    if "unprotected" in results:
        summary["lightning_passive_recall"] = recall(results["unprotected"]["lightning_steps"], schedule)
    if "clean" in results:
        summary["false_positives_clean"] = len(results["clean"]["ours_steps"])
        summary["false_positives_clean_lightning"] = len(results["clean"]["lightning_steps"])
        summary["clean_max_loss_z"] = results["clean"].get("max_loss_z")
        summary["clean_max_loss_rel"] = results["clean"].get("max_loss_rel")
    if "lightning" in results:
        summary["lightning_halted_at"] = results["lightning"]["halted_at"]
        summary["val_loss_lightning"] = val("lightning")
    for name in ("clean", "unprotected", "unprotected_no_nan", "rollback", "skip"):
        if name in results:
            summary[f"val_loss_{name}"] = val(name)
    clean = val("clean")
    if clean and math.isfinite(clean):  # a clean run that diverged gives no ratios (NaN is no JSON)
        for name in ("unprotected", "unprotected_no_nan", "rollback", "skip", "lightning"):
            v = val(name)
            if v is not None:
                summary[f"ratio_{name}_vs_clean"] = v / clean if math.isfinite(v) else None  # was the string 'nan'
    for key, value in list(summary.items()):  # strict JSON: a diverged run's NaN becomes null + a flag
        if isinstance(value, float) and not math.isfinite(value):
            summary[key] = None
            summary[key.replace("val_loss_", "") + "_diverged"] = True
    print(f"{'variant':<20} {'val loss':>9} {'vs clean':>9}")
    for name in ("clean", "rollback", "skip", "unprotected", "unprotected_no_nan", "lightning"):
        if name in results:
            ratio = summary.get(f"ratio_{name}_vs_clean", 1.0 if name == "clean" and clean else None)
            cells = [f"{x:.4f}" if isinstance(x, float) and math.isfinite(x) else "-" for x in (val(name), ratio)]
            print(f"{name:<20} {cells[0]:>9} {cells[1]:>9}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
