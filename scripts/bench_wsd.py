#!/usr/bin/env python
"""WSD evidence, sized for a 2-core CPU: three experiments run in-process through ``train(cfg)``.

1. **WSD vs cosine.** Same model, data and steps; each schedule tuned for peak LR on one grid
   (``--lrs``). WSD decays with 1-sqrt over the last 20%, both to min_lr_factor 0 (conf/experiment/
   wsd_vs_cosine.yaml). Target: best WSD final val loss <= best cosine.
2. **Decay branches vs separate cosine runs.** One stable WSD run (peak LR, never decays) checkpointed at
   every branch point; for each decay fraction f (``--fractions``) three ``decay_branch`` runs of length
   L = T/4, T/2, T (branch at (1-f)L, decay fL), against three cosine runs trained to those lengths.
   Target: every branch within 1% of its cosine twin. Also checks that the f=0.2, L=T branch reproduces
   experiment 1's straight WSD run exactly.
3. **Continual pre-training.** From experiment 1's best WSD model (trained on corpus A = stdlib code),
   continue on corpus B (``--corpus-b``, default /usr/share/common-licenses: English license prose every
   Debian/Ubuntu machine has) with: cosine re-warm; WSD with 0%, 5% and 20% replay of A (the data
   mixture, conf/experiment/cpt_replay.yaml). Reports val loss on B and forgetting on A (val loss increase).

    python scripts/bench_wsd.py                 # the documented run (docs/wsd.md), ~20 min on 2 busy cores
    python scripts/bench_wsd.py --quick         # a smoke run of every code path (1-3 min)

Runs go under ``--out-dir``; plots to ``--img-dir`` (default ``--out-dir``;
``docs/img`` for the docs). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "conf")

import lightning as L  # noqa: E402

from lit_dtrain.config_resolvers import default_cache_dir  # noqa: E402
from lit_dtrain.utils.args import (  # noqa: E402
    ScriptArgumentParser,
    comma_list,
    nonnegative_int,
    positive_float,
    positive_int,
    seed_int,
    window_int,
)
from lit_dtrain.utils.plots import OutputPathError, output_path  # noqa: E402
from lit_dtrain.utils.scripts import import_beside  # noqa: E402

import_beside(__file__)  # this script's module beside it, scripts/_bench_wsd_report.py, also where a test loads it
from _bench_wsd_report import compare_runs, markdown, plots  # noqa: E402, F401 - the plots and tables of the report

MODELS = tuple(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))
MARKER = ".bench_wsd"  # in --out-dir: the dir is this script's, so it may be wiped


class SaveAtSteps(L.Callback):
    """Saves ``<dirpath>/step{N:06d}.ckpt`` right after optimizer step N, for each N in ``steps``."""

    def __init__(self, dirpath: str, steps: list[int]) -> None:
        self.dirpath, self.steps = Path(dirpath), {int(s) for s in steps}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            trainer.save_checkpoint(self.dirpath / f"step{trainer.global_step:06d}.ckpt", weights_only=False)


def decay_fraction(text: str) -> float:
    """An ``argparse`` type: a decay fraction in (0, 1)."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=320,
                   help="T: steps of experiment 1 and the longest branch (divisible by 4)")
    p.add_argument("--cpt-steps", type=positive_int, default=160, help="steps of each continual-pre-training run")
    p.add_argument("--lrs", type=comma_list(positive_float), default="1e-3,2e-3,4e-3",
                   help="peak-LR grid (comma-separated)")
    p.add_argument("--confirm-seeds", type=nonnegative_int, default=1,
                   help="extra seeds on which experiment 1's two best-LR runs are repeated (seed noise)")
    p.add_argument("--fractions", type=comma_list(decay_fraction), default="0.1,0.2,0.4",
                   help="decay fractions of the branch experiment, each in (0, 1)")
    p.add_argument("--warmup", type=nonnegative_int, default=None, help="warmup steps (default: T/20; < T/4)")
    p.add_argument("--val-every", type=positive_int, default=40, help="validation interval (steps)")
    p.add_argument("--model", choices=MODELS, default="nano", help="conf/model/ shape")
    p.add_argument("--block-size", type=window_int, default=64, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=16, help="samples per step")
    p.add_argument("--val-windows", type=positive_int, default=512, help="validation windows per corpus")
    p.add_argument("--corpus-b", default="/usr/share/common-licenses", help="corpus B of the CPT experiment")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (1 is fastest on a contended 2-core box)")
    p.add_argument("--seed", type=seed_int, default=1337, help="seed of every run")
    p.add_argument("--out-dir", default="outputs/bench_wsd",
                   help="run dirs (wiped first: an empty dir, or one this script made; relative: under the current "
                        "directory)")
    p.add_argument("--img-dir", default=None,
                   help="where wsd_*.png go (default: --out-dir; the docs' figures: --img-dir docs/img)")
    p.add_argument("--cache-dir", default=default_cache_dir(),
                   help="token cache")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every code path")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.cpt_steps, args.lrs, args.fractions = 40, 20, [3e-3, 6e-3], [0.2]
        args.val_every, args.val_windows, args.confirm_seeds = 10, 64, 1
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    if args.steps % 4:
        p.error(f"--steps must be divisible by 4 (branch lengths T/4, T/2, T), got {args.steps}")
    if args.warmup >= args.steps // 4:  # the shortest cosine run is T/4 steps: it failed after the longer ones ran
        p.error(f"--warmup ({args.warmup}) must be below --steps/4 = {args.steps // 4}, the shortest run")
    for f in args.fractions:  # a branch must start after step 0 and decay for at least one step, at every length
        for length in (args.steps // 4, args.steps // 2, args.steps):
            if not 1 <= round(f * length) < length:
                p.error(f"--fractions {f:g}: a decay of round({f:g} * {length}) = {round(f * length)} steps of the "
                        f"{length}-step branch; pick a fraction or --steps for which it is between 1 and {length - 1}")
    if not Path(args.corpus_b).exists():
        p.error(f"--corpus-b {args.corpus_b!r} does not exist; pass a directory of English text files")
    out = Path(args.out_dir).expanduser()
    if out.exists() and not wipeable(out):  # Bench wipes it: --out-dir . deleted the working directory
        p.error(f"--out-dir {args.out_dir!r} exists and was not made by this script (it is wiped first); give a new "
                "or empty directory")
    try:  # before the runs: an --img-dir that is a file failed at the first plot, after experiment 1's runs
        if args.img_dir:
            output_path(Path(args.img_dir) / "wsd_vs_cosine.png", "--img-dir")
    except OutputPathError as e:
        p.error(str(e))
    return args


def wipeable(out: Path) -> bool:
    """Whether ``out`` may be wiped: an empty dir, one with this script's marker, or a marker-less one of an earlier
    version (only run dirs ``e1_``/``e2_``/``e3_`` and ``wsd_*.png``)."""
    if not out.is_dir():
        return False
    names = [p.name for p in out.iterdir()]
    return MARKER in names or all(n.startswith(("e1_", "e2_", "e3_")) or (n.startswith("wsd_") and n.endswith(".png"))
                                  for n in names)


class Bench:
    """Composes conf/train.yaml like train.py does and runs ``train(cfg)`` in this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out_dir).expanduser().resolve()
        if self.out.exists():
            if not wipeable(self.out):
                raise ValueError(f"{self.out} was not made by bench_wsd.py; refusing to wipe it")
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        (self.out / MARKER).touch()
        self.times: dict[str, float] = {}
        self.steps_run = 0
        self.params = 0

    def base_overrides(self, seed: int | None = None) -> list[str]:
        a = self.args
        return [
            f"model={a.model}", f"model.block_size={a.block_size}", f"data.batch_size={a.batch_size}",
            f"data.max_val_windows={a.val_windows}", "data.progress=false", f"seed={a.seed if seed is None else seed}",
            f"trainer.val_check_interval={a.val_every}", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", "trainer.accelerator=cpu", "trainer.log_every_n_steps=5",
            "callbacks.progress_bar=null", "callbacks.model_checkpoint=null", "sample.max_new_tokens=0",
            f"scheduler.warmup_steps={a.warmup}",
        ]

    def run(self, name: str, overrides: list[str], save_at: list[int] | None = None, seed: int | None = None):
        from hydra import compose, initialize_config_dir
        from omegaconf import open_dict

        from lit_dtrain.checkpoint import checkpoint_global_step
        from lit_dtrain.train import train

        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=self.base_overrides(seed) + overrides)
        run_dir = self.out / name
        with open_dict(cfg):
            cfg.paths.output_dir = str(run_dir)
            cfg.paths.cache_dir = self.args.cache_dir
            if save_at:
                cfg.callbacks.save_at = {"_target_": f"{__name__}.SaveAtSteps",
                                         "dirpath": str(run_dir / "branch_points"), "steps": list(save_at)}
        t0 = time.perf_counter()
        metrics, objects = train(cfg)
        self.times[name] = time.perf_counter() - t0
        start = checkpoint_global_step(cfg.ckpt_path) if cfg.get("ckpt_path") else 0  # a decay branch starts at S
        self.steps_run += int(objects["trainer"].global_step) - start
        self.params = sum(p.numel() for p in objects["module"].model.parameters())
        print(f"[bench_wsd] {name}: val_loss={metrics['val_loss']:.4f} steps={metrics['steps']} "
              f"({self.times[name]:.0f}s)", flush=True)
        return metrics, objects


@torch.no_grad()
def eval_sources(model: torch.nn.Module, datamodule) -> dict[str, float]:
    """Mean token cross-entropy of ``model`` on each source's validation windows."""
    from lit_dtrain.module import token_loss

    model.eval()
    out = {}
    for name, loader in zip(datamodule.val_names, datamodule.val_dataloader()):
        total, count = 0.0, 0
        for batch in loader:
            loss = token_loss(model(batch["input_ids"]), batch["labels"], reduction="sum")  # LitLLM's loss
            total, count = total + float(loss), count + batch["labels"].numel()
        out[name] = total / count
    model.train()
    return out


def best_by(results: dict[float, dict]) -> float:
    return min(results, key=lambda lr: results[lr]["val_loss"])


def experiment_1(bench: Bench) -> dict:
    a = bench.args
    common = ["experiment=wsd_vs_cosine", f"trainer.max_steps={a.steps}", f"scheduler.warmup_steps={a.warmup}"]
    runs: dict[str, dict[float, dict]] = {"wsd": {}, "cosine": {}}
    for lr in a.lrs:  # interleaved, so machine-load drift hits both schedules alike
        for sched in ("wsd", "cosine"):
            metrics, _ = bench.run(f"e1_{sched}_lr{lr:g}", [*common, f"scheduler={sched}", f"optimizer.lr={lr}"])
            runs[sched][lr] = metrics
    best = {s: best_by(runs[s]) for s in runs}
    wsd, cos = runs["wsd"][best["wsd"]]["val_loss"], runs["cosine"][best["cosine"]]["val_loss"]
    edge = [s for s in best if best[s] in (min(a.lrs), max(a.lrs))]
    confirm = []
    for k in range(1, a.confirm_seeds + 1):
        seed = a.seed + k
        pair = {}
        for sched in ("wsd", "cosine"):
            m, _ = bench.run(f"e1_{sched}_lr{best[sched]:g}_seed{seed}",
                             [*common, f"scheduler={sched}", f"optimizer.lr={best[sched]}"], seed=seed)
            pair[sched] = m["val_loss"]
        confirm.append({"seed": seed, **pair, "ratio_wsd_over_cosine": pair["wsd"] / pair["cosine"]})
    return {
        "grid": a.lrs,
        "val_loss": {s: {f"{lr:g}": runs[s][lr]["val_loss"] for lr in a.lrs} for s in runs},
        "best_lr": best,
        "best_on_grid_edge": edge,
        "wsd": wsd,
        "cosine": cos,
        "ratio_wsd_over_cosine": wsd / cos,
        "target_met": wsd <= cos,
        "other_seeds": confirm,
        "dirs": {s: str(bench.out / f"e1_{s}_lr{best[s]:g}") for s in best},
    }


def experiment_2(bench: Bench, e1: dict) -> dict:
    a = bench.args
    T = a.steps
    lengths = [T // 4, T // 2, T]
    plan = {f: {Lk: (Lk - round(f * Lk), round(f * Lk)) for Lk in lengths} for f in a.fractions}  # (branch at, N)
    points = sorted({at for per_f in plan.values() for at, _ in per_f.values()})
    lr_w, lr_c = e1["best_lr"]["wsd"], e1["best_lr"]["cosine"]
    base = [f"optimizer.lr={lr_w:g}", f"scheduler.warmup_steps={a.warmup}", "scheduler.min_lr_factor=0.0"]
    stable_steps = max(points)
    # the stable run: WSD whose decay lies far beyond its last step
    bench.run("e2_stable", [*base, f"trainer.max_steps={stable_steps}", f"scheduler.total_steps={100 * T}"],
              save_at=points)
    ckpt_dir = bench.out / "e2_stable" / "branch_points"
    branches: dict[float, dict[int, float]] = {}
    for f, per_len in plan.items():
        branches[f] = {}
        for Lk, (at, n) in per_len.items():
            m, _ = bench.run(f"e2_branch_f{f:g}_L{Lk}", [*base, f"decay_branch.ckpt={ckpt_dir / f'step{at:06d}.ckpt'}",
                                                         f"decay_branch.steps={n}"])
            assert m["steps"] == Lk, (m["steps"], Lk)
            branches[f][Lk] = m["val_loss"]
    cosine = {T: e1["val_loss"]["cosine"][f"{lr_c:g}"]}
    for Lk in lengths[:-1]:
        m, _ = bench.run(f"e2_cosine_L{Lk}", ["scheduler=cosine", f"optimizer.lr={lr_c:g}", f"trainer.max_steps={Lk}",
                                              f"scheduler.warmup_steps={a.warmup}", "scheduler.min_lr_factor=0.0"])
        cosine[Lk] = m["val_loss"]
    per_f = {}
    for f in a.fractions:
        gaps = {Lk: branches[f][Lk] / cosine[Lk] - 1 for Lk in lengths}
        per_f[f"{f:g}"] = {
            "branch_val_loss": {str(Lk): branches[f][Lk] for Lk in lengths},
            "gap_vs_cosine": {str(Lk): gaps[Lk] for Lk in lengths},
            "all_within_1pct": all(g <= 0.01 for g in gaps.values()),
            "set_steps": (1 - f) * T + f * sum(lengths),  # one stable run to (1-f)T + the three decays
            "set_steps_over_T": ((1 - f) * T + f * sum(lengths)) / T,
        }
    reproduce = None
    if 0.2 in branches:
        reproduce = branches[0.2][T] - e1["val_loss"]["wsd"][f"{lr_w:g}"]
    return {
        "lengths": lengths,
        "cosine_val_loss": {str(Lk): cosine[Lk] for Lk in lengths},
        "cosine_set_steps_over_T": sum(lengths) / T,
        "fractions": per_f,
        "fractions_within_1pct": [f for f, r in per_f.items() if r["all_within_1pct"]],
        "branch_f0.2_LT_minus_straight_wsd": reproduce,
        "dirs": {"stable": str(bench.out / "e2_stable"),
                 "branches_f0.2": [str(bench.out / f"e2_branch_f0.2_L{Lk}") for Lk in lengths]
                 if 0.2 in branches else [],
                 "cosine": [str(bench.out / f"e2_cosine_L{Lk}") for Lk in lengths[:-1]] + [e1["dirs"]["cosine"]]},
    }


def experiment_3(bench: Bench, e1: dict) -> dict:
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.schedules.workflows import load_model_weights

    a = bench.args
    lr = e1["best_lr"]["wsd"]
    base_ckpt = Path(e1["dirs"]["wsd"]) / "checkpoints" / "last.ckpt"
    b_path = str(Path(a.corpus_b).resolve())
    common = [f"init_from={base_ckpt}", f"trainer.max_steps={a.cpt_steps}", f"optimizer.lr={lr:g}",
              f"scheduler.warmup_steps={max(1, a.cpt_steps // 10)}", "scheduler.min_lr_factor=0.0"]
    b_only = ["data=textfiles", "data.sources.0.name=licenses", f"data.sources.0.paths=[{b_path}]"]
    mixture = ["experiment=cpt_replay", f"data.sources.1.paths=[{b_path}]"]
    variants = {
        "cosine_rewarm": [*b_only, "scheduler=cosine"],
        "wsd_replay0": [*b_only, "scheduler=wsd"],
        "wsd_replay5": [*mixture, "data.sources.0.weight=5", "data.sources.1.weight=95"],
        "wsd_replay20": [*mixture, "data.sources.0.weight=20", "data.sources.1.weight=80"],
    }
    evaluator = LMDataModule(
        sources=[{"name": "stdlib", "kind": "stdlib"}, {"name": "licenses", "kind": "files", "paths": [b_path]}],
        block_size=a.block_size, batch_size=a.batch_size, seed=a.seed, max_val_windows=a.val_windows,
        val_batch_size=32, cache_dir=a.cache_dir, progress=False,
    )
    evaluator.prepare_data()
    evaluator.setup("validate")
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        mcfg = compose(config_name="train", overrides=bench.base_overrides())
    base_model = instantiate(mcfg.model)
    load_model_weights(base_model, base_ckpt)
    before = eval_sources(base_model, evaluator)
    results = {}
    for name, overrides in variants.items():
        _, objects = bench.run(f"e3_{name}", [*overrides, *common])
        after = eval_sources(objects["module"].model, evaluator)
        results[name] = {"val_loss_B": after["licenses"], "val_loss_A": after["stdlib"],
                         "forgetting_A": after["stdlib"] - before["stdlib"]}
    return {"base": {"val_loss_A": before["stdlib"], "val_loss_B": before["licenses"]}, "variants": results,
            "corpus_b": b_path, "lr": lr, "dirs": {n: str(bench.out / f"e3_{n}") for n in variants}}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lit_dtrain"):
        logging.getLogger(name).setLevel(logging.ERROR)
    bench = Bench(args)
    t0 = time.perf_counter()
    e1 = experiment_1(bench)
    e2 = experiment_2(bench, e1)
    e3 = experiment_3(bench, e1)
    images = plots(bench, e1, e2, e3)
    wall = time.perf_counter() - t0
    print(markdown(e1, e2, e3))
    sizes = {"model": args.model, "params": bench.params, "block_size": args.block_size, "batch_size": args.batch_size,
             "steps_T": args.steps, "cpt_steps": args.cpt_steps, "warmup": args.warmup, "threads": args.threads,
             "val_windows": args.val_windows, "seed": args.seed}
    print(f"sizes: {sizes}; {bench.steps_run} optimizer steps in {len(bench.times)} runs, wall {wall:.0f}s")
    result = {
        "wsd_over_cosine": round(e1["ratio_wsd_over_cosine"], 5),
        "wsd_le_cosine": e1["target_met"],
        "wsd_over_cosine_other_seeds": {c["seed"]: round(c["ratio_wsd_over_cosine"], 5) for c in e1["other_seeds"]},
        "best_lr": e1["best_lr"],
        "best_lr_on_grid_edge": e1["best_on_grid_edge"],
        "branch_gap_vs_cosine": {f: {L: round(g, 5) for L, g in r["gap_vs_cosine"].items()}
                                 for f, r in e2["fractions"].items()},
        "fractions_within_1pct": e2["fractions_within_1pct"],
        "set_steps_over_T": {**{f"wsd_f{f}": round(r["set_steps_over_T"], 4) for f, r in e2["fractions"].items()},
                             "cosine": e2["cosine_set_steps_over_T"]},
        "branch_reproduces_straight_run_diff": e2["branch_f0.2_LT_minus_straight_wsd"],
        "cpt": {n: {k: round(v, 5) for k, v in r.items()} for n, r in e3["variants"].items()},
        "cpt_base": {k: round(v, 5) for k, v in e3["base"].items()},
        "images": images,
        "sizes": sizes,
        "runs": len(bench.times),
        "steps_run": bench.steps_run,
        "wall_s": round(wall, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
