"""How the FourierSampler's per-step cost and memory grow with the number of training windows N.

Each step is what training does: draw the global batch (``global_batch``), then feed back a synthetic
token loss of that batch (``observe``). No model runs, so this isolates the sampler. Variants run side by
side at each N, interleaved step by step (so machine noise hits them alike): ``uniform`` (an unfed
``RandomSampler`` draw, the floor), ``uniform_mixture`` (the same under four sources of different sizes weighted
0.4/0.3/0.2/0.1), ``moment_ratio`` (the brief's transform, the default) and
``magnitude`` (our variant, which renormalizes by the mean every step). It prints the median milliseconds
per step, the bytes per sample, and the ratio of each variant's cost at the largest N to its cost at the
smallest (``--sizes`` in any order: the rows run smallest first). The last line is JSON.

    python scripts/bench_sampler_scaling.py                      # N = 121k (the stdlib corpus), 1M, 10M
    python scripts/bench_sampler_scaling.py --sizes 100000 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lit_dtrain.data.samplers import FourierSampler, RandomSampler
from lit_dtrain.utils.args import ScriptArgumentParser, nonnegative_int, positive_int

VARIANTS = ("uniform", "uniform_mixture", "moment_ratio", "magnitude")


def make(variant: str, n: int, seed: int):
    if variant.startswith("uniform"):
        s = RandomSampler()
    else:
        s = FourierSampler(variant=variant, step_unit=1)
    base = None
    if variant == "uniform_mixture":  # four sources of different sizes, weighted 0.4/0.3/0.2/0.1
        source = torch.arange(n) * 4 // n
        share = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
        base = share[source] / torch.bincount(source, minlength=4).double()[source]
    s.setup(n, base, seed=seed)
    return s


def step_once(sampler, step: int, batch: int, T: int) -> float:
    """Seconds for one draw + observe."""
    g = torch.Generator().manual_seed(step)
    loss = torch.rand(batch, T, generator=g) * 3.0  # made before the clock starts
    t0 = time.perf_counter()
    idx = sampler.global_batch(step, batch)
    if isinstance(sampler, FourierSampler):
        sampler.observe(loss, idx, step + 1)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=positive_int, default=[121_278, 1_000_000, 10_000_000],
                    help="samples N in the sampler (its table's length), one row each")
    ap.add_argument("--batch", type=positive_int, default=8, help="global batch per step")
    ap.add_argument("--block", type=positive_int, default=256, help="tokens per window (T of the token loss)")
    ap.add_argument("--warmup", type=nonnegative_int, default=20, help="untimed steps first")
    ap.add_argument("--steps", type=positive_int, default=300, help="timed steps per variant and size")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    if args.block < 2:  # was token_loss's ValueError traceback, after the first size's samplers were built
        ap.error(f"--block {args.block}: the Fourier samplers need windows of >= 2 tokens (a spectrum of T losses)")
    args.sizes = sorted(args.sizes)  # smallest first: the growth column is largest / smallest in any given order
    torch.set_num_threads(args.threads)

    rows = []
    for n in args.sizes:
        samplers = {v: make(v, n, seed=0) for v in VARIANTS}
        times = {v: [] for v in VARIANTS}
        for step in range(args.warmup + args.steps):
            order = VARIANTS if step % 2 == 0 else VARIANTS[::-1]
            for v in order:
                t = step_once(samplers[v], step, args.batch, args.block)
                if step >= args.warmup:
                    times[v].append(t)
        for v in VARIANTS:
            s = samplers[v]
            mem = s.bytes_per_sample()["total"] if isinstance(s, FourierSampler) else 0.0
            ms = 1e3 * statistics.median(times[v])
            rows.append({"n": n, "variant": v, "ms_per_step": ms, "bytes_per_sample": mem})
            print(f"N={n:>10,}  {v:<13} {ms:8.3f} ms/step  {mem:6.1f} B/sample", flush=True)

    print("\n| variant | " + " | ".join(f"N={n:,} ms/step" for n in args.sizes) + " | largest/smallest | B/sample |")
    print("|---|" + "---|" * (len(args.sizes) + 2))
    growth = {}
    for v in VARIANTS:
        ms = [r["ms_per_step"] for r in rows if r["variant"] == v]
        mem = [r["bytes_per_sample"] for r in rows if r["variant"] == v][-1]
        growth[v] = ms[-1] / ms[0]
        print(f"| {v} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {growth[v]:.2f} | {mem:.1f} |")
    print(json.dumps({"sizes": args.sizes, "batch": args.batch, "block": args.block, "rows": rows,
                      "growth_largest_over_smallest": growth}))


if __name__ == "__main__":
    main()
