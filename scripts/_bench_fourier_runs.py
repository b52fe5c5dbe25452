"""bench_fourier.py's variants and runs: the samplers of each variant, one training run with its val curve and
the sampler's own time, and the interleaved (and, on a GPU, pipelined) wall-clock timing of uniform against
Fourier steps."""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch
from _bench_fourier_corpus import MIXTURE_SHARES

from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet
from lit_dtrain.data.samplers import FourierSampler
from lit_dtrain.models import build_llama
from lit_dtrain.module import param_groups, token_loss
from lit_dtrain.schedules.lr import cosine_scheduler
from lit_dtrain.utils.scripts import rotated

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
            order = rotated(list(setups), i)  # none always runs on a warm cache
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
        for name in rotated(list(setups), r):
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
