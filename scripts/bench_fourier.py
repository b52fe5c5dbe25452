#!/usr/bin/env python
"""Uniform sampling vs FourierSampler: steps to the uniform run's final val loss, final val loss, overhead.

Every run trains the same tiny Llama from the same seed for the same number of steps on the same corpus;
only the sampler differs. Validation is always the uniform, held-out split (documents held out by hash),
evaluated every ``--eval-every`` steps. Corpora:

* ``stdlib`` (a): the default corpus (the running Python's stdlib sources);
* ``mixture`` (b): a heterogeneous corpus generated at run time into a temp dir: real code (stdlib ``.py``),
  real prose (the language reference text shipped in ``pydoc_data``), near-duplicate boilerplate (generated
  license headers + log lines with small random substitutions) and segments of random printable characters.
  Its size (``--mixture-kb``) is chosen so that the 256-token runs see it about twice: a per-sample table can
  only act on samples it has seen (the stdlib corpus, by contrast, is seen ~0.02 times).

Variants (the ablation): ``uniform`` (drawn by the same inverse CDF and generator stream as the Fourier sampler,
so the comparison is paired: with equal probabilities both draw the same batches); ``uniform_seed2`` (uniform
with another data seed: the data-order noise); ``uniform_stagelr`` (uniform sampling with only the stage
schedule's LR multiplier: attributes what the stages do to the LR); for each of the two importance transforms
(``brief`` = moment_ratio, ``mag`` = magnitude): ``*_stages`` (mixed score + the full staged schedule),
``*_stages_nolr`` (stage bands and mix, no LR multiplier), ``*_mixed``, ``*_time``, ``*_freq`` (no stages).
The stage schedule and the cosine mix are scaled to the run: ``step_unit = steps / 50`` (the brief's 50k-step
run), ``decay_steps = 10 * step_unit``.
Block length 1024 runs a reduced set at the same tokens per step. Any Fourier variant with the suffix ``_lag1``
(e.g. ``mag_freq_lag1``; not in the default grid) runs the same sampler with ``lag=1``: each step's batch is drawn
from the table one step staler, so that ``observe`` never waits for a GPU.

Every variant runs for each of ``--seeds`` (model init and data seed); results are paired by seed and the
steps-to-target use seed-averaged val curves. Per-step overhead is measured two ways: the sampler's own time
(draw + observe, timed inside the runs), and an interleaved wall-clock comparison (one uniform step, one
Fourier step per ``--timing-lags`` lag, in rotating order; ``--timing-rounds`` rounds of ``--timing-steps``) at
block 256. Intermediate results go to ``--out`` after every run; ``--merge`` re-summarizes such files. The last line
is one JSON object.

    python scripts/bench_fourier.py --out runs.json  # the full grid: ~2-3 h on 2 busy CPU cores (3 seeds)
    python scripts/bench_fourier.py --steps 40 --corpora mixture --block-sizes 256 --variants uniform brief_stages
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import string
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet
from lit_dtrain.data.corpus import stdlib_files
from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.models import build_llama
from lit_dtrain.module import param_groups, token_loss
from lit_dtrain.schedules.lr import cosine_scheduler
from lit_dtrain.utils.args import (
    ScriptArgumentParser,
    nonnegative_int,
    positive_float,
    positive_int,
    read_json_file,
)
from lit_dtrain.utils.plots import OutputPathError, output_path

# ablation -> (score, stages, stage LR multiplier)
SCORE_ABLATION = {"stages": ("mixed", True, True), "stages_nolr": ("mixed", True, False),
                  "mixed": ("mixed", False, False), "time": ("time", False, False),
                  "freq": ("frequency", False, False)}
ALL_VARIANTS = ["uniform", "uniform_seed2", "uniform_stagelr"] + [
    f"{v}_{a}" for v in ("brief", "mag") for a in SCORE_ABLATION
]
LONG_VARIANTS = ["uniform", "uniform_seed2", "uniform_stagelr", "brief_stages", "mag_mixed"]
# Oracle references (mixture only, not samplers): uniform sampling with the random-character source's draw share
# scaled by a known factor, i.e. what a sampler that recognised the noise segments perfectly could do at best by
# down-weighting them. 0.5 is about the share mag_freq reaches (7 % vs 15 %).
ORACLE_RANDOM_SCALE = {"oracle_halfrandom": 0.5, "oracle_norandom": 0.0}
ALL_VARIANTS += list(ORACLE_RANDOM_SCALE)
# any Fourier variant with ``_lag1``: the same sampler with lag=1 (draws from the table one step staler, so that
# observe never waits for a GPU); not in the default grid
LAG_SUFFIX = "_lag1"
LAG_VARIANTS = [v + LAG_SUFFIX for v in ALL_VARIANTS if not v.startswith(("uniform", "oracle"))]
MIXTURE_SHARES = {"code": 0.35, "prose": 0.35, "boilerplate": 0.15, "random": 0.15}


# ---- corpus (b) ---------------------------------------------------------------------------------------------
def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size) if text[i : i + size].strip()]


def _boilerplate_doc(rng: random.Random) -> str:
    company = rng.choice(["Acme Corp", "Initech", "Globex", "Umbrella Labs", "Hooli"])
    head = (
        f"# Copyright (c) {rng.randint(2015, 2025)} {company}. All rights reserved.\n"
        f"# Licensed under the {rng.choice(['Apache', 'MIT', 'BSD'])} License. See LICENSE in the project root.\n"
        f"# Auto-generated by codegen v{rng.randint(1, 3)}.{rng.randint(0, 9)}.{rng.randint(0, 20)}; "
        "DO NOT EDIT.\n\n"
    )
    lines = []
    for _ in range(18):
        lines.append(
            f"[2024-03-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
            f"{rng.randint(0, 59):02d}] INFO  service={rng.choice(['auth', 'billing', 'search'])} "
            f"request_id={rng.getrandbits(32):08x} status={rng.choice([200, 200, 200, 404])} "
            f"latency_ms={rng.randint(3, 250)}\n"
        )
    return head + "".join(lines)


def make_mixture(root: Path, total_kb: int, seed: int = 0, doc_chars: int = 2048) -> dict[str, Path]:
    """Write the four parts of corpus (b) under ``root``; returns {part: directory}. Deterministic."""
    rng = random.Random(seed)
    budget = {k: int(total_kb * 1024 * share) for k, share in MIXTURE_SHARES.items()}
    docs: dict[str, list[str]] = {k: [] for k in budget}
    for path in stdlib_files()[::5]:  # real code
        if sum(map(len, docs["code"])) >= budget["code"]:
            break
        docs["code"] += _chunks(path.read_text(errors="replace"), doc_chars)
    import pydoc_data.topics as topics  # real prose: the language reference shipped with CPython

    for key in sorted(topics.topics):
        if sum(map(len, docs["prose"])) >= budget["prose"]:
            break
        docs["prose"] += _chunks(topics.topics[key], doc_chars)
    while sum(map(len, docs["boilerplate"])) < budget["boilerplate"]:
        docs["boilerplate"].append(_boilerplate_doc(rng))
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    while sum(map(len, docs["random"])) < budget["random"]:
        line = lambda: "".join(rng.choice(alphabet) for _ in range(79)) + "\n"  # noqa: E731
        docs["random"].append("".join(line() for _ in range(doc_chars // 80)))
    dirs = {}
    for part, texts in docs.items():
        d = root / part
        d.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(texts):
            (d / f"{part}_{i:05d}.txt").write_text(text)
        dirs[part] = d
    return dirs


# ---- runs ---------------------------------------------------------------------------------------------------
class PairedUniformSampler(FourierSampler):
    """Uniform sampling drawn by the FourierSampler's own inverse-CDF code from the same generator stream: it is
    never fed, so every sample keeps the prior and the distribution is exactly uniform. With equal probabilities
    both draw identical batches, so a comparison differs only where the probabilities do (torch.multinomial's
    float32 CDF would drift from ours by hundreds of indices at N = 1e5)."""

    def __init__(self, stage_lr: bool = False, step_unit: float = 1000) -> None:
        # stage_lr: keep only the stage schedule's LR multiplier (sampling stays uniform): the attribution control
        super().__init__(stages=stage_lr, stage_lr=stage_lr, step_unit=step_unit, require_updates=False)


def base_variant(variant: str) -> str:
    """The variant without its ``_lag1`` suffix."""
    return variant.removesuffix(LAG_SUFFIX)


def make_sampler(variant: str, steps: int):
    unit = steps / 50
    if variant.startswith(("uniform", "oracle")):
        return PairedUniformSampler(stage_lr=variant == "uniform_stagelr", step_unit=unit)
    transform, ablation = base_variant(variant).split("_", 1)
    score, stages, stage_lr = SCORE_ABLATION[ablation]
    return FourierSampler(
        score=score, stages=stages, stage_lr=stage_lr, step_unit=unit, decay_steps=max(1, round(10 * unit)),
        variant="moment_ratio" if transform == "brief" else "magnitude", async_op=False,
        lag=int(variant.endswith(LAG_SUFFIX)),
    )


def make_datamodule(corpus: str, dirs, block: int, batch: int, seed: int, sampler, cache_dir: str,
                    random_scale: float = 1.0) -> LMDataModule:
    """``random_scale`` scales the random source's weight (its share of the draws) for the oracle references."""
    if corpus == "stdlib":
        sources = [CorpusSource()]
    else:
        sources = [CorpusSource(name=k, kind="files", paths=[str(d)],
                                weight=MIXTURE_SHARES[k] * (random_scale if k == "random" else 1.0))
                   for k, d in dirs.items()]
    dm = LMDataModule(sources=sources, block_size=block, batch_size=batch, seed=seed, cache_dir=cache_dir,
                      sampler=sampler, val_fraction=0.02 if corpus == "stdlib" else 0.15, progress=False)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def val_set(dm: LMDataModule, corpus: str, total: int) -> list[tuple[str, torch.Tensor]]:
    """Fixed held-out windows, evenly spaced over each source's val stream; per source in proportion to its
    share of the corpus (so the val set is uniform over the corpus composition). A source whose val stream holds
    no window is an error naming it (its val loss was a ZeroDivisionError in :func:`evaluate`); LMDataModule gives
    every source at least one today."""
    out = []
    for source, split in zip(dm.sources, dm.splits):
        share = 1.0 if corpus == "stdlib" else MIXTURE_SHARES[source.name]
        windows = WindowSet([split.val], dm.block_size)
        if len(windows) == 0:
            raise ValueError(f"data source {source.name!r}: its val split has {len(split.val)} tokens, no window of "
                             f"block_size+1 = {dm.block_size + 1} to evaluate on")
        n = min(len(windows), max(1, round(total * share)))
        idx = np.unique(np.linspace(0, len(windows) - 1, n).round().astype(np.int64))
        out.append((source.name, windows.gather(idx)))
    return out


@torch.no_grad()
def evaluate(model, vals, batch: int) -> tuple[float, dict]:
    model.eval()
    per, total, count = {}, 0.0, 0
    for name, w in vals:
        s = 0.0
        for i in range(0, len(w), batch):
            x = w[i : i + batch].to(_device(model))
            logits = model(x[:, :-1])
            s += float(token_loss(logits, x[:, 1:], reduction="sum"))
        ntok = w[:, 1:].numel()
        per[name] = s / ntok
        total, count = total + s, count + ntok
    model.train()
    return total / count, per


def model_for(block: int, seed: int, args):
    torch.manual_seed(seed)
    return build_llama(vocab_size=257, block_size=block, n_layer=args.n_layer, d_model=args.d_model,
                       n_head=args.n_head, n_kv_head=args.n_kv_head).to(args.device)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def on_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on ``device``; ``index`` stays where the sampler keeps its table (CPU)."""
    return {k: v if k == "index" or not torch.is_tensor(v) else v.to(device, non_blocking=True)
            for k, v in batch.items()}


def sync(device) -> None:
    """Wait for the device's queued work before reading a clock (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_step(model, opt, sched, batch, lr_mult: float) -> torch.Tensor:
    batch = on_device(batch, _device(model))
    loss_per_token = token_loss(model(batch["input_ids"]), batch["labels"])  # (B, T), LitLLM's loss
    if "loss_weight" in batch:  # as LitLLM.training_step
        loss = (loss_per_token.mean(dim=1) * batch["loss_weight"]).mean()
    else:
        loss = loss_per_token.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    saved = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] *= lr_mult
    opt.step()
    for g, lr in zip(opt.param_groups, saved):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss_per_token.detach()


def run(corpus, dirs, block, variant, seed, args) -> dict:
    batch = max(1, args.tokens_per_step // block)
    data_seed = seed + (1000 if variant == "uniform_seed2" else 0)  # the control: only the data order differs
    sampler = make_sampler(variant, args.steps)
    dm = make_datamodule(corpus, dirs, block, batch, data_seed, sampler, args.cache_dir,
                         random_scale=ORACLE_RANDOM_SCALE.get(variant, 1.0))
    vals = val_set(dm, corpus, args.val_windows * 256 // block)
    model = model_for(block, seed, args)
    opt = torch.optim.AdamW(param_groups(model), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = cosine_scheduler(opt, total_steps=args.steps, warmup_steps=max(1, args.steps // 20), min_lr_factor=0.1)
    fourier = not variant.startswith(("uniform", "oracle"))
    curve, draw_t, step_t, obs_t, seen = [], [], [], [], set()
    curve.append((0, evaluate(model, vals, args.eval_batch)[0]))
    for step in range(args.steps):
        t0 = time.perf_counter()
        b = dm.batch_for_step(step)
        t1 = time.perf_counter()
        step_loss = train_step(model, opt, sched, b, sampler.lr_multiplier(step))
        sync(args.device)
        t2 = time.perf_counter()
        if fourier:
            sampler.observe(step_loss, b["index"], step)  # the step the batch was drawn for, as the callback
        t3 = time.perf_counter()
        draw_t.append(t1 - t0)
        step_t.append(t2 - t1)
        obs_t.append(t3 - t2)
        seen.update(b["index"].tolist())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, evaluate(model, vals, args.eval_batch)[0]))
    final, per_source = evaluate(model, vals, args.eval_batch)
    out = {
        "corpus": corpus, "block": block, "variant": variant, "seed": seed, "batch": batch, "curve": curve,
        "final": final, "per_source": per_source, "num_samples": dm.num_train_samples, "unique_seen": len(seen),
        "draw_ms": 1e3 * statistics.median(draw_t), "model_ms": 1e3 * statistics.median(step_t),
        "observe_ms": 1e3 * statistics.median(obs_t),
    }
    if fourier:
        out["entropy_ratio"] = sampler.entropy() / math.log(dm.num_train_samples)  # 1.0 = uniform
        if len(dm.sources) > 1:  # share of the final distribution per source
            p = sampler.probabilities(args.steps)
            offsets = dm.train_windows.offsets
            out["final_share"] = {s.name: float(p[offsets[i] : offsets[i + 1]].sum()) for i, s in enumerate(dm.sources)}
    return out


def steps_to_target(curve, target: float) -> float | None:
    """First step where the (linearly interpolated) val curve reaches ``target``; None if it never does."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v0 <= target:
            return float(s0)
        if v1 <= target:
            return s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return None


def interleaved_timing(corpus, dirs, block, args, variant="brief_stages") -> dict:
    """Alternate one uniform and one Fourier step per ``--timing-lags`` lag (separate models and data; the order
    rotates), ``--timing-rounds`` rounds of ``--timing-steps`` steps each; the ratio of median step times per round,
    and the median over rounds (``wall_ratio``: lag 0, the brief's; ``wall_ratio_lag1``: lag 1)."""
    batch = max(1, args.tokens_per_step // block)
    setups = {}
    samplers = [("uniform", PairedUniformSampler())] + [
        ("fourier" + (LAG_SUFFIX if lag else ""), make_sampler(variant + (LAG_SUFFIX if lag else ""), args.steps))
        for lag in args.timing_lags]
    for name, sampler in samplers:
        dm = make_datamodule(corpus, dirs, block, batch, args.seeds[0], sampler, args.cache_dir)
        model = model_for(block, args.seeds[0], args)
        opt = torch.optim.AdamW(param_groups(model), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        setups[name] = (dm, model, opt, cosine_scheduler(opt, total_steps=10**6, warmup_steps=1))
    ratios, medians, step = [], [], 0
    for _ in range(args.timing_rounds):
        times = {k: [] for k in setups}
        for i in range(args.timing_steps):
            order = _rotated(list(setups), i)  # none always runs on a warm cache
            for name in order:
                dm, model, opt, sched = setups[name]
                sync(args.device)
                t0 = time.perf_counter()
                b = dm.batch_for_step(step)
                step_loss = train_step(model, opt, sched, b, dm.sampler.lr_multiplier(step))
                if name != "uniform":
                    dm.sampler.observe(step_loss, b["index"], step)
                sync(args.device)
                times[name].append(time.perf_counter() - t0)
            step += 1
        med = {k: statistics.median(v) for k, v in times.items()}
        medians.append(med)
        ratios.append({k: med[k] / med["uniform"] for k in setups if k != "uniform"})
    out = {"uniform_ms": 1e3 * statistics.median(m["uniform"] for m in medians),
           "num_samples": setups["uniform"][0].num_train_samples, "variant": variant, "device": str(args.device)}
    for name in (k for k in setups if k != "uniform"):
        suffix = name.removeprefix("fourier")  # "" (lag 0) or "_lag1"
        out[f"fourier{suffix}_ms"] = 1e3 * statistics.median(m[name] for m in medians)
        out[f"wall_ratio{suffix}"] = statistics.median(r[name] for r in ratios)
        out[f"round_ratios{suffix}"] = [round(r[name], 4) for r in ratios]
    if torch.device(args.device).type == "cuda":
        out.update(pipelined_timing(setups, args, step))
    return out


def pipelined_timing(setups: dict, args, step: int) -> dict:
    """On a GPU the per-step synchronization above hides what the sampler costs a pipelined loop: the host queues
    the next step while the device still runs this one, except where ``observe`` copies the token loss to the CPU
    table, which waits for the step. Here each sampler runs ``--timing-steps`` steps with one synchronization at the
    end (rounds alternate which goes first); the ratio of the per-round times, and the median over rounds."""
    ratios, per_step = [], {k: [] for k in setups}
    for r in range(args.timing_rounds):
        took = {}
        for name in _rotated(list(setups), r):
            dm, model, opt, sched = setups[name]
            sync(args.device)
            t0 = time.perf_counter()
            for i in range(args.timing_steps):
                b = dm.batch_for_step(step + i)
                step_loss = train_step(model, opt, sched, b, dm.sampler.lr_multiplier(step + i))
                if name != "uniform":
                    dm.sampler.observe(step_loss, b["index"], step + i)
            sync(args.device)
            took[name] = (time.perf_counter() - t0) / args.timing_steps
            per_step[name].append(took[name])
        step += args.timing_steps
        ratios.append({k: took[k] / took["uniform"] for k in setups if k != "uniform"})
    out = {"pipelined_uniform_ms": 1e3 * statistics.median(per_step["uniform"])}
    for name in (k for k in setups if k != "uniform"):
        suffix = name.removeprefix("fourier")
        out[f"pipelined_ratio{suffix}"] = statistics.median(r[name] for r in ratios)
        out[f"pipelined_round_ratios{suffix}"] = [round(r[name], 4) for r in ratios]
        out[f"pipelined_fourier{suffix}_ms"] = 1e3 * statistics.median(per_step[name])
    return out


def _rotated(names: list, i: int) -> list:
    """``names`` rotated by ``i``: over consecutive ``i`` each runs first, and after each of the others."""
    k = i % len(names)
    return names[k:] + names[:k]


def main() -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", nargs="+", default=["stdlib", "mixture"], choices=["stdlib", "mixture"])
    ap.add_argument("--block-sizes", nargs="+", type=positive_int, default=[256, 1024])
    ap.add_argument("--variants", nargs="+", default=ALL_VARIANTS, metavar="VARIANT",
                    choices=ALL_VARIANTS + LAG_VARIANTS, help=f"of {ALL_VARIANTS}, uniform included (the reference; "
                    f"a Fourier one may end in {LAG_SUFFIX})")
    ap.add_argument("--long-variants", nargs="+", default=LONG_VARIANTS, metavar="VARIANT",
                    choices=ALL_VARIANTS + LAG_VARIANTS, help="variants run at block > 256 (uniform included)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="model-init and data seeds")
    ap.add_argument("--steps", type=positive_int, default=300, help="optimizer steps per run")
    ap.add_argument("--tokens-per-step", type=positive_int, default=2048, help="batch = tokens_per_step // block")
    ap.add_argument("--eval-every", type=positive_int, default=20)
    ap.add_argument("--val-windows", type=positive_int, default=96,
                    help="held-out 256-token windows (fewer when longer)")
    ap.add_argument("--eval-batch", type=positive_int, default=16)
    ap.add_argument("--mixture-kb", type=positive_int, default=320, help="size of corpus (b)")
    ap.add_argument("--d-model", type=positive_int, default=64)
    ap.add_argument("--n-layer", type=positive_int, default=2)
    ap.add_argument("--n-head", type=positive_int, default=4)
    ap.add_argument("--n-kv-head", type=positive_int, default=2)
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--timing-steps", type=nonnegative_int, default=30,
                    help="interleaved steps per sampler and round (0: skip)")
    ap.add_argument("--timing-rounds", type=positive_int, default=3)
    ap.add_argument("--timing-lags", nargs="+", type=int, default=[0, 1], choices=[0, 1],
                    help="FourierSampler lags timed against uniform (0: the brief's; 1: observe never waits)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (1 is stable on a shared machine)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the sampler's table stays on CPU either way)")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "lit_dtrain_bench_cache"))
    ap.add_argument("--out", default=None, help="also write all results (curves included) to this JSON file")
    ap.add_argument("--merge", nargs="+", default=None, help="summarize these --out files instead of training")
    ap.add_argument("--plot", default=None, help="write seed-averaged val curves (every corpus and block) to PNG")
    args = ap.parse_args()
    check_args(ap, args)  # before any corpus is built or model trained
    torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as train.py's default matmul_precision
    if args.merge:
        loaded = [read_results(f, ap) for f in args.merge]
        runs = [r for d in loaded for r in d["runs"]]
        timing = {k: v for d in loaded for k, v in d.get("timing", {}).items()}
        args.steps = loaded[0]["args"]["steps"]
    else:
        runs, timing = train_all(args)
    summary = summarize(runs, timing, args)
    if args.plot:
        plot_curves(runs, args.plot)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "timing": timing, "runs": runs}, indent=1))
    print(json.dumps(summary))


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """The flags that argparse's types cannot check alone; each was a traceback after minutes of training, or a
    summary without a table (every table is against uniform's runs)."""
    if "uniform" not in args.variants:
        ap.error("--variants must include uniform: every figure is against uniform's runs")
    if max(args.block_sizes) > 256 and "uniform" not in args.long_variants:
        ap.error("--long-variants must include uniform when a block size is above 256 (the reference there)")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}, but torch {torch.__version__} sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device must be cpu or cuda, got {args.device!r}")
    try:
        with torch.device("meta"):  # the shape's own checks (d_model % n_head, n_head % n_kv_head), no memory
            build_llama(vocab_size=257, block_size=max(args.block_sizes), n_layer=args.n_layer,
                        d_model=args.d_model, n_head=args.n_head, n_kv_head=args.n_kv_head)
    except ValueError as e:
        ap.error(f"--d-model/--n-head/--n-kv-head: {e}")
    if args.merge and args.out:
        ap.error("--out writes the runs trained here; with --merge nothing is trained (the summary is printed)")
    try:
        for flag, path, image in (("--out", args.out, False), ("--plot", args.plot, True)):
            if path:
                setattr(args, flag[2:], str(output_path(path, flag, image=image)))
    except OutputPathError as e:
        ap.error(str(e))


def read_results(path: str, ap: argparse.ArgumentParser) -> dict:
    """A ``--merge`` file: the JSON that ``--out`` writes; a missing, garbage or foreign one is named."""
    try:
        results = read_json_file(path, "--merge", "--out")
    except ValueError as e:
        ap.error(str(e))
    if not (isinstance(results, dict) and isinstance(results.get("runs"), list)
            and isinstance(results.get("args"), dict) and "steps" in results["args"]):
        ap.error(f"--merge {path!r} is not an --out file of this script (expected 'args' with 'steps' and 'runs')")
    return results


def train_all(args) -> tuple[list, dict]:
    print(f"python {sysconfig.get_python_version()}, torch {torch.__version__}, threads {args.threads}, "
          f"device {args.device}")
    runs, timing = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_fourier_") as tmp:
        dirs = make_mixture(Path(tmp), args.mixture_kb, seed=0) if "mixture" in args.corpora else None
        for corpus in args.corpora:
            if args.timing_steps:
                timing[corpus] = interleaved_timing(corpus, dirs, min(args.block_sizes), args)
                print(f"[{corpus}] interleaved timing: {timing[corpus]}", flush=True)
            for block in args.block_sizes:
                variants = args.variants if block <= 256 else [v for v in args.long_variants if v in args.variants]
                if corpus != "mixture":  # the oracles reweight the mixture's random source
                    variants = [v for v in variants if v not in ORACLE_RANDOM_SCALE]
                for seed in args.seeds:
                    for variant in variants:
                        t0 = time.perf_counter()
                        r = run(corpus, dirs, block, variant, seed, args)
                        runs.append(r)
                        if args.out:  # partial results survive an interrupted run (summarize with --merge)
                            Path(args.out).write_text(json.dumps({"args": vars(args), "timing": timing, "runs": runs}))
                        print(f"[{corpus} T={block} seed={seed}] {variant:14s} final={r['final']:.4f} "
                              f"model={r['model_ms']:.1f}ms draw={r['draw_ms']:.2f}ms observe={r['observe_ms']:.2f}ms "
                              f"seen={r['unique_seen']}/{r['num_samples']} ({time.perf_counter() - t0:.0f}s)",
                              flush=True)
    return runs, timing


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _round(x, digits: int = 1):
    return None if x is None else round(x, digits)


def _std(xs):
    xs = [x for x in xs if x is not None]
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mean_curve(runs: list) -> list:
    """Val curve averaged over seeds (runs share their eval steps)."""
    steps = [s for s, _ in runs[0]["curve"]]
    return [(s, _mean([dict(r["curve"])[s] for r in runs])) for s in steps]


def summarize(runs: list, timing: dict, args) -> dict:
    """Tables per (corpus, block): each variant against uniform, paired by seed, and on seed-averaged curves.

    ``steps_to_target``: first (interpolated) eval step at which the seed-averaged val curve reaches the
    seed-averaged final val loss of uniform sampling. ``val_loss_delta_pct``: mean over seeds of the paired
    difference of final val loss vs uniform (negative is better), with its standard deviation.
    """
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["corpus"], r["block"]), {}).setdefault(r["variant"], {})[r["seed"]] = r
    out = {"steps": args.steps}
    for (corpus, block), by_variant in groups.items():
        uniform = by_variant.get("uniform")
        if not uniform:
            continue
        seeds = sorted(uniform)
        target = _mean([uniform[s]["final"] for s in seeds])
        uniform_steps = steps_to_target(mean_curve([uniform[s] for s in seeds]), target)
        base_ms = _mean([uniform[s]["draw_ms"] + uniform[s]["model_ms"] for s in seeds])
        base_draw = _mean([uniform[s]["draw_ms"] for s in seeds])
        print(f"\n== {corpus}, T={block}, seeds {seeds}: uniform final {target:.4f} (reached at step "
              f"{uniform_steps}) ==")
        print(f"  {'variant':17s} {'final':>8s} {'Δ% mean±sd':>14s} {'steps→tgt':>9s} {'saved%':>7s} "
              f"{'sampler ms':>10s} {'H/Hmax':>7s}  per-seed Δ%")
        table = {}
        for name, by_seed in by_variant.items():
            common = [s for s in seeds if s in by_seed]
            deltas = [100 * (by_seed[s]["final"] - uniform[s]["final"]) / uniform[s]["final"] for s in common]
            steps = steps_to_target(mean_curve([by_seed[s] for s in common]), target)
            sampler_ms = _mean([by_seed[s]["draw_ms"] - base_draw + by_seed[s]["observe_ms"] for s in common])
            entry = {
                "final": _mean([by_seed[s]["final"] for s in common]),
                "val_loss_delta_pct": _mean(deltas), "val_loss_delta_sd": _std(deltas),
                "val_loss_delta_pct_per_seed": [round(d, 3) for d in deltas],
                "steps_to_target": steps,
                "steps_saved_pct": None if steps is None or not uniform_steps else 100 * (1 - steps / uniform_steps),
                "sampler_ms": sampler_ms, "sampler_overhead_pct": 100 * sampler_ms / base_ms,
                "entropy_ratio": _mean([by_seed[s].get("entropy_ratio") for s in common]),
                "per_source": {k: _mean([by_seed[s]["per_source"][k] for s in common])
                               for k in by_seed[common[0]]["per_source"]},
                "final_share": by_seed[common[0]].get("final_share"),
            }
            table[name] = entry
            saved = "n/a" if entry["steps_saved_pct"] is None else f"{entry['steps_saved_pct']:.1f}"
            steps_s = "never" if steps is None else f"{steps:.0f}"
            delta = f"{entry['val_loss_delta_pct']:7.2f}±{entry['val_loss_delta_sd']:5.2f}"
            print(f"  {name:17s} {entry['final']:8.4f} {delta} "
                  f"{steps_s:>9s} {saved:>7s} {sampler_ms:10.2f} {entry['entropy_ratio'] or 1.0:7.4f}  "
                  f"{entry['val_loss_delta_pct_per_seed']}")
        if corpus == "mixture":
            print("  per-source val loss: " + "; ".join(
                f"{n}: " + ", ".join(f"{k}={v:.3f}" for k, v in e["per_source"].items()) for n, e in table.items()
                if n in ("uniform", "brief_stages", "mag_mixed", "mag_time", "mag_freq", *ORACLE_RANDOM_SCALE)))
        key = corpus if block == min(args.block_sizes) else f"{corpus}_block{block}"
        fourier = {k: v for k, v in table.items() if not k.startswith(("uniform", "oracle"))}
        head = table.get("brief_stages") or next(iter(fourier.values()), {})
        best = min(fourier, key=lambda k: fourier[k]["val_loss_delta_pct"]) if fourier else None
        sampling = {k: v for k, v in fourier.items()
                    if not base_variant(k).endswith("_stages")}  # no stage LR multiplier
        best_sampling = min(sampling, key=lambda k: sampling[k]["val_loss_delta_pct"]) if sampling else None
        out[key] = {
            "block": block, "seeds": seeds,
            "steps_to_target_uniform": uniform_steps,
            "steps_to_target_fourier": head.get("steps_to_target"),
            "overhead_ratio": timing.get(corpus, {}).get("wall_ratio") if block == min(args.block_sizes) else None,
            "overhead_ratio_pipelined": timing.get(corpus, {}).get("pipelined_ratio")
            if block == min(args.block_sizes) else None,
            "overhead_ratio_lag1": timing.get(corpus, {}).get("wall_ratio_lag1")
            if block == min(args.block_sizes) else None,
            "overhead_ratio_pipelined_lag1": timing.get(corpus, {}).get("pipelined_ratio_lag1")
            if block == min(args.block_sizes) else None,
            "sampler_overhead_pct": head.get("sampler_overhead_pct"),
            "val_loss_delta_pct": head.get("val_loss_delta_pct"),
            "noise_val_loss_delta_pct": table.get("uniform_seed2", {}).get("val_loss_delta_pct"),
            "best_variant": best,
            "best_val_loss_delta_pct": fourier[best]["val_loss_delta_pct"] if best else None,
            "best_steps_to_target": fourier[best]["steps_to_target"] if best else None,
            "stage_lr_only_delta_pct": table.get("uniform_stagelr", {}).get("val_loss_delta_pct"),
            "best_sampling_variant": best_sampling,
            "best_sampling_delta_pct": sampling[best_sampling]["val_loss_delta_pct"] if best_sampling else None,
            "best_sampling_delta_sd": sampling[best_sampling]["val_loss_delta_sd"] if best_sampling else None,
            "variants": {k: {"delta_pct": round(v["val_loss_delta_pct"], 3), "sd": round(v["val_loss_delta_sd"], 3),
                             "steps_to_target": _round(v["steps_to_target"])} for k, v in table.items()},
        }
    for corpus, t in timing.items():
        for suffix in ("", LAG_SUFFIX):
            if f"wall_ratio{suffix}" not in t:
                continue
            print(f"[{corpus}] interleaved wall-clock ratio fourier{suffix}/uniform: {t[f'wall_ratio{suffix}']:.4f} "
                  f"(rounds {t[f'round_ratios{suffix}']}; {t['uniform_ms']:.1f} vs {t[f'fourier{suffix}_ms']:.1f} "
                  f"ms/step, N={t['num_samples']})")
            if f"pipelined_ratio{suffix}" in t:
                print(f"[{corpus}] pipelined ({args.timing_steps} steps, one sync) ratio fourier{suffix}/uniform: "
                      f"{t[f'pipelined_ratio{suffix}']:.4f} (rounds {t[f'pipelined_round_ratios{suffix}']}; "
                      f"{t['pipelined_uniform_ms']:.2f} vs {t[f'pipelined_fourier{suffix}_ms']:.2f} ms/step)")
    return out


PLOT_STYLE = {  # variant -> (color, linestyle, width)
    "uniform": ("k", "-", 2.0), "uniform_seed2": ("0.5", ":", 1.5), "uniform_stagelr": ("tab:red", "-", 3.0),
    "brief_stages": ("tab:orange", "--", 1.5), "brief_mixed": ("tab:olive", "-.", 1.0),
    "mag_mixed": ("tab:blue", "-", 1.2), "mag_time": ("tab:purple", "-", 1.2), "mag_freq": ("tab:green", "-", 1.2),
    "mag_stages": ("tab:brown", "--", 1.0), "oracle_halfrandom": ("tab:gray", "--", 1.0),
    "oracle_norandom": ("tab:gray", ":", 1.0),
}


def plot_curves(runs: list, path: str) -> None:
    """Seed-averaged val loss minus uniform's against step, one panel per (corpus, block)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in runs:
        groups.setdefault((r["corpus"], r["block"]), {}).setdefault(r["variant"], []).append(r)
    keys = sorted(groups)
    cols = min(2, len(keys))
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols + (1 if cols == 1 else 0), 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        base = dict(mean_curve(groups[key]["uniform"]))
        spread = 0.0
        for variant, (color, ls, lw) in PLOT_STYLE.items():
            for name, style in ((variant, ls), (variant + LAG_SUFFIX, (0, (1, 1)))):  # lag 1: dotted, same color
                if name in groups[key]:
                    curve = [(s, v - base[s]) for s, v in mean_curve(groups[key][name]) if s > 0]
                    ax.plot(*zip(*curve), color=color, ls=style, lw=lw, label=name)
                    spread = max([spread] + [abs(d) for _, d in curve])
        lim = min(0.4, max(0.05, 1.15 * spread))  # small effects stay visible; the grid's panels share +-0.4
        ax.set_ylim(-lim, lim)
        ax.set_title(f"{key[0]}, T={key[1]}, {len(groups[key]['uniform'])} seeds", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss minus uniform's (nats)")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5 if cols > 1 else 3, fontsize=8)
    fig.tight_layout(rect=(0, 0.08 if cols > 1 else 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
