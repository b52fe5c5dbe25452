"""Activation checkpointing policies side by side: peak activation memory, step time, RSS, FLOPs, gradients.

For each model shape (``small``: conf/model/small.yaml, d=320 x 8 blocks; ``deep``: d=384 x 12 blocks) and sequence
length (256, 1024), one Llama is built and every policy is applied to the *same* model by switching the blocks'
checkpoint mode, so all policies see the same weights and the same batch:

* peak activation memory: ``ACT`` of MemTracker's peak snapshot (and the largest ``ACT`` at any moment);
* step time (forward + backward), median of ``--repeats`` rounds that interleave the policies, so
  background load hits them alike; by default this process's CPU time with one torch thread
  (``--clock cpu``), which other processes on a shared machine disturb far less than wall time;
* peak RSS of one step (Linux ``VmHWM`` after a reset), absolute and above the RSS before the step;
* backward FLOPs (FlopCounterMode: matmul-class ops; and with pointwise ops counted, one per element);
* the largest absolute gradient difference against ``none`` (fp32).

``budget`` is planned by the callback's probe on the benchmark batch itself (``--memory-budget``).

``--device cuda`` runs the same comparison on the GPU in fp32 (``--dtype bf16``: bf16 autocast). There, step time is
wall time with ``torch.cuda.synchronize()`` around each step (``--clock cpu`` does not apply), the RSS columns are
replaced by the CUDA peak of one step above the memory allocated before it (``torch.cuda.max_memory_allocated``,
``cuda_peak_step_mib``) and its ratio to ``none``'s (``cuda_peak_ratio``); MemTracker's ``ACT`` figures are measured
as on CPU. The CPU defaults are too small for a GPU; use more tokens.

    python scripts/bench_activation_ckpt.py                     # all shapes, seq 256 and 1024 (a few minutes)
    python scripts/bench_activation_ckpt.py --shapes small --seqs 256 --repeats 3   # quick look
    python scripts/bench_activation_ckpt.py --device cuda --tokens 16384 --seqs 1024,2048 --repeats 3

The last line is one JSON object keyed by policy: ``saved_bytes_ratio`` (peak ACT of the policy over peak ACT of
``none``: the fraction of activation bytes still kept; at a size where the parameters and gradients set the memory
peak, none's peak snapshot holds under half its largest ACT, and the ratio is of the largest ACT instead:
``by_config``'s ``saved_bytes_from`` says which), ``time_ratio`` (step time over ``none``'s), ``max_abs_grad_diff``,
each the mean (ratios) or max (grad diff) over the configurations, with the per-configuration figures under
``by_config``, plus a ``targets`` entry. On CUDA each policy also has the mean ``cuda_peak_ratio``, and ``by_config``
has the CUDA peak instead of the RSS figures. """

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lit_dtrain.callbacks._checkpoint_budget import budget_plan_from_probe
from lit_dtrain.callbacks._checkpoint_policies import apply_checkpointing, every_k_plan, set_plan, uniform_plan
from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.utils.args import ScriptArgumentParser, comma_list, fail, seed_int
from lit_dtrain.utils.memory import (
    POINTWISE_OPS,
    backward_flops_by_op,
    measure_activation_memory,
    peak_rss_bytes,
    reset_peak_rss,
)
from lit_dtrain.utils.plots import OutputPathError, output_path

SHAPES = {
    "small": dict(d_model=320, n_layer=8, n_head=8, n_kv_head=4),  # conf/model/small.yaml
    "deep": dict(d_model=384, n_layer=12, n_head=8, n_kv_head=4),  # deeper and wider
}
POLICIES = ("none", "full", "every_k", "selective", "budget")
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = ScriptArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="small,deep", help="comma list of: " + ", ".join(SHAPES))
    p.add_argument("--seqs", default="256,1024", help="comma list of sequence lengths")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per batch: batch size = max(1, tokens // seq)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of policies")
    p.add_argument("--every-k", type=int, default=2, help="every_k: checkpoint every k-th block")
    p.add_argument("--memory-budget", type=float, default=0.5, help="budget: fraction of none's peak ACT")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (each round runs every policy once)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="step time for the ratios: cpu = this process's CPU time (robust to other processes\n"
                        "on a shared machine, with --threads 1); wall = elapsed time. Both are printed.")
    p.add_argument("--plot", default="",
                   help="PNG path of memory against time (relative: under the current directory; default: no plot; "
                        "the docs' figure: --plot docs/img/actckpt_memory_vs_time.png)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: model and batch on the GPU; wall-clock step time; CUDA peak memory instead of RSS")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16 = fp32 weights under bf16 autocast")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the token batch")
    args = p.parse_args(argv)
    # before any model is built: each of these was a traceback (ZeroDivisionError, StatisticsError, ...) mid-run
    for flag, value in (("--tokens", args.tokens), ("--every-k", args.every_k), ("--repeats", args.repeats),
                        ("--threads", args.threads)):
        if value < 1:
            p.error(f"{flag} must be a positive integer, got {value}")
    if not 0 < args.memory_budget <= 1:
        p.error(f"--memory-budget must be in (0, 1] (a fraction of none's peak ACT), got {args.memory_budget}")
    for flag, given, known in (("--shapes", args.shapes, SHAPES), ("--policies", args.policies, POLICIES)):
        unknown = [v for v in given.split(",") if v and v not in known]
        if unknown:
            p.error(f"{flag}: unknown {unknown}; choose from {list(known)}")
        if not any(given.split(",")):  # '' ran no configuration and printed empty results
            p.error(f"{flag} must name at least one of {list(known)}, got {given!r}")
    if "none" not in args.policies.split(","):  # every ratio and the gradient difference are against none's: nan
        p.error(f"--policies must include none (every ratio and grad diff is against none's), got {args.policies!r}")
    seqs = [s for s in args.seqs.split(",") if s]
    if not all(s.isdigit() and int(s) > 0 for s in seqs) or not seqs:
        p.error(f"--seqs must be a comma list of positive integers, got {args.seqs!r}")
    for flag, given in (("--shapes", args.shapes), ("--policies", args.policies), ("--seqs", ",".join(seqs))):
        try:  # an entry twice was a KeyError after the runs (policies) or a JSON line mixing two tables (seqs)
            comma_list()(",".join(str(int(v)) if v.isdigit() else v for v in given.split(",") if v))
        except argparse.ArgumentTypeError as e:
            p.error(f"{flag}: {e}")
    try:  # before the runs: a directory or a '.txt' --plot failed in savefig after all of them
        args.plot = str(output_path(args.plot, "--plot", image=True)) if args.plot else args.plot
    except OutputPathError as e:
        p.error(str(e))
    return args


def step_clock(args) -> str:
    """The clock of the step-time ratios: ``--clock``, except on CUDA, where the CPU time of this process
    says nothing about the GPU's work (it only counts launches and synchronize's wait), so wall time."""
    return "wall" if args.device == "cuda" else args.clock


def plan_for(policy: str, n_blocks: int, args, budget_plan: list[str] | None) -> list[str]:
    if policy == "every_k":
        return every_k_plan(n_blocks, args.every_k)
    if policy == "budget":
        return budget_plan
    return uniform_plan(n_blocks, policy)


def cuda_step_peak_bytes(step) -> int:
    """Peak CUDA memory of one ``step()`` above the memory allocated before it (the caching allocator's counters)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run_config(shape: str, seq: int, args) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # Weights and batch are drawn on the CPU and then moved, so every device starts from the same numbers.
    torch.manual_seed(args.seed)
    model = Llama(LlamaConfig(vocab_size=257, block_size=max(seq, 256), **SHAPES[shape])).to(device)
    batch = max(1, args.tokens // seq)
    ids = torch.randint(0, 257, (batch, seq + 1), generator=torch.Generator().manual_seed(args.seed)).to(device)
    blocks = list(model.blocks)
    wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"))

    def autocast():
        if args.dtype == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss():
        with autocast():
            return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())

    # CUDA runs asynchronously: wait for the GPU before every clock reading.
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        loss().backward()
        model.zero_grad(set_to_none=True)

    policies = [p for p in args.policies.split(",") if p]
    budget_plan, budget_report = None, None
    if "budget" in policies:
        t0 = time.perf_counter()
        budget_plan, budget_report = budget_plan_from_probe(loss, model, blocks, wrappers, args.memory_budget)
        budget_report["probe_seconds"] = time.perf_counter() - t0
    plans = {p: plan_for(p, len(blocks), args, budget_plan) for p in policies}

    res = {p: {"plan": plans[p]} for p in policies}
    pointwise = set(POINTWISE_OPS)
    for p in policies:  # memory, FLOPs, gradients
        set_plan(wrappers, plans[p])
        am = measure_activation_memory(step, model)
        res[p].update(peak_act_mib=am.peak_act / MiB, max_act_mib=am.max_act / MiB, peak_total_mib=am.peak_total / MiB)
        flops = backward_flops_by_op(loss)  # leaves the gradients in .grad
        res[p]["bwd_gflops_all"] = sum(flops.values()) / 1e9
        res[p]["bwd_gflops_mm"] = sum(v for op, v in flops.items() if op not in pointwise) / 1e9
        res[p]["grads"] = [q.grad.clone() for q in model.parameters()]
        model.zero_grad(set_to_none=True)
    times = {p: [] for p in policies}
    walls = {p: [] for p in policies}
    for p in policies:  # warm-up step, which also gives the peak RSS (CPU) or CUDA peak of one step
        set_plan(wrappers, plans[p])
        gc.collect()
        if cuda:
            res[p]["cuda_peak_step_mib"] = cuda_step_peak_bytes(step) / MiB
            continue
        reset_peak_rss()
        rss0 = peak_rss_bytes()
        step()
        res[p].update(peak_rss_mib=peak_rss_bytes() / MiB, step_rss_mib=(peak_rss_bytes() - rss0) / MiB)
    for _ in range(args.repeats):
        for p in policies:
            set_plan(wrappers, plans[p])
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync()
            c1, t1 = time.process_time(), time.perf_counter()
            times[p].append(c1 - c0 if step_clock(args) == "cpu" else t1 - t0)
            walls[p].append(t1 - t0)
    ref = res["none"]  # parse_args requires it
    # Where the parameters and gradients set the memory peak (small at T=16, B=2: none's peak snapshot held
    # 0.0003 MiB of ACT, its largest ACT 6.4 MiB), the peak snapshot sees no activations and every policy read 1.0:
    # the ratio is then taken from the largest ACT, and the output says so.
    source = "peak_act" if ref["peak_act_mib"] >= 0.5 * ref["max_act_mib"] else "max_act"
    for p in policies:
        r = res[p]
        r["step_s"] = statistics.median(times[p])
        r["wall_s"] = statistics.median(walls[p])
        r["saved_bytes_ratio"] = r[f"{source}_mib"] / ref[f"{source}_mib"]
        r["saved_bytes_from"] = source
        r["max_act_ratio"] = r["max_act_mib"] / ref["max_act_mib"]
        r["time_ratio"] = r["step_s"] / statistics.median(times["none"])
        r["max_abs_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(r["grads"], ref["grads"]))
        if cuda:
            r["cuda_peak_ratio"] = r["cuda_peak_step_mib"] / ref["cuda_peak_step_mib"]
    for p in policies:
        del res[p]["grads"]
    return {"shape": shape, "seq": seq, "batch": batch, "policies": res, "budget_report": budget_report}


def on_or_below_line(point: dict, full: dict, key: str = "saved_bytes_ratio") -> bool:
    """Is (time_ratio, memory) of ``point`` on or below the straight line through none (1, 1) and full?"""
    if full["time_ratio"] <= 1.0:  # full not slower than none (timing noise): no line to be below
        return False
    line = 1.0 + (full[key] - 1.0) * (point["time_ratio"] - 1.0) / (full["time_ratio"] - 1.0)
    return point[key] <= line + 1e-9


def block_level_time_at(memory: float, block_points: list[dict], key: str = "saved_bytes_ratio") -> float:
    """Step time of block-level checkpointing (none, every_k, full: piecewise linear) at equal memory."""
    pts = sorted((p[key], p["time_ratio"]) for p in block_points)  # by memory, ascending
    for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
        if m0 <= memory <= m1:
            return t0 + (t1 - t0) * (memory - m0) / max(m1 - m0, 1e-12)
    return pts[0][1] if memory < pts[0][0] else pts[-1][1]


def make_plot(configs: list[dict], path: str, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(configs)
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    markers = {"none": "o", "full": "s", "every_k": "^", "selective": "D", "budget": "*"}
    for ax, cfg in zip(axes.flat, configs):
        res = cfg["policies"]
        if "none" in res and "full" in res:
            xs = [res["none"]["time_ratio"], res["full"]["time_ratio"]]
            ys = [res["none"]["saved_bytes_ratio"], res["full"]["saved_bytes_ratio"]]
            ax.plot(xs, ys, "--", color="gray", label="none-full line")
        for p, r in res.items():
            size = 90 if p == "budget" else 55
            ax.scatter(r["time_ratio"], r["saved_bytes_ratio"], marker=markers.get(p, "x"), s=size, label=p, zorder=3)
        ax.set_title(f"{cfg['shape']}  T={cfg['seq']}  B={cfg['batch']}")
        ax.set_xlabel("step time / none")
        ax.set_ylabel("peak activation memory / none")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"Activation checkpointing: memory against time (lower-left is better){note}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            fail(f"--device cuda, but torch {torch.__version__} sees no CUDA device; run on a GPU machine or use "
                 "--device cpu")
        ignored = " (--clock cpu does not apply on CUDA)" if args.clock == "cpu" else ""
        print(f"device: {torch.cuda.get_device_name()} ({args.dtype}, torch {torch.__version__}). Step time is wall "
              f"time with torch.cuda.synchronize() around each step{ignored}; memory is MemTracker's ACT and the CUDA "
              "peak of one step (RSS n/a).")
    configs = []
    for shape in [s for s in args.shapes.split(",") if s]:
        for seq in [int(s) for s in args.seqs.split(",") if s]:
            t0 = time.perf_counter()
            cfg = run_config(shape, seq, args)
            configs.append(cfg)
            print(f"\n== {shape}  T={seq}  B={cfg['batch']}  ({time.perf_counter() - t0:.0f} s)")
            clock = step_clock(args) + " s"
            mem_cols = ("CUDA MiB", "ratio") if cuda else ("RSS MiB", "+step")  # CUDA peak of a step, or RSS
            print(f"{'policy':10s} {'peakACT MiB':>11s} {'ratio':>6s} {'maxACT':>7s} {clock:>7s} {'ratio':>6s} "
                  f"{'wall s':>6s} "
                  f"{mem_cols[0]:>8s} {mem_cols[1]:>6s} {'bwd GF mm':>9s} {'bwd GF all':>10s} {'grad diff':>9s}  plan")
            for p, r in cfg["policies"].items():
                plan = "".join({"none": ".", "selective": "s", "full": "F"}[m] for m in r["plan"])
                if cuda:
                    mem = f"{r['cuda_peak_step_mib']:8.0f} {r['cuda_peak_ratio']:6.3f}"
                else:
                    mem = f"{r['peak_rss_mib']:8.0f} {r['step_rss_mib']:6.0f}"
                print(f"{p:10s} {r['peak_act_mib']:11.1f} {r['saved_bytes_ratio']:6.3f} "
                      f"{r['max_act_ratio']:7.3f} {r['step_s']:7.3f} {r['time_ratio']:6.3f} "
                      f"{r['wall_s']:6.2f} "
                      f"{mem} {r['bwd_gflops_mm']:9.2f} "
                      f"{r['bwd_gflops_all']:10.2f} {r['max_abs_grad_diff']:9.1e}  {plan}")
            ref = cfg["policies"]["none"]
            if ref["saved_bytes_from"] == "max_act":
                print("note: ratio = largest ACT over none's (as maxACT), not peak ACT: at this size the parameters "
                      f"and gradients set the memory peak, where none holds {ref['peak_act_mib']:.4f} MiB of ACT of "
                      f"its largest {ref['max_act_mib']:.1f} MiB (saved_bytes_from: max_act)")
            if cfg["budget_report"]:
                br = cfg["budget_report"]
                print(f"budget={br['memory_budget']}: probe measured {br['measured_ratio']:.3f} of none's largest ACT "
                      f"(estimate {br['estimated_ratio']:.3f}, {len(br['tries'])} plan(s) tried, "
                      f"{br['probe_seconds']:.1f} s)")
    if args.plot and configs:
        make_plot(configs, args.plot, note=f" ({args.device}, {args.dtype}, wall time)" if cuda else "")
        print(f"\nplot: {args.plot}")

    # ---- summary keyed by policy, and the targets ----
    policies = list(configs[0]["policies"]) if configs else []
    summary: dict = {}
    mem_keys = ("cuda_peak_step_mib", "cuda_peak_ratio") if cuda else ("peak_rss_mib", "step_rss_mib")
    for p in policies:
        rows = [c["policies"][p] for c in configs]
        summary[p] = {
            "saved_bytes_ratio": statistics.mean(r["saved_bytes_ratio"] for r in rows),
            "time_ratio": statistics.mean(r["time_ratio"] for r in rows),
            "max_abs_grad_diff": max(r["max_abs_grad_diff"] for r in rows),
            "by_config": {
                f"{c['shape']}/T{c['seq']}": {k: c["policies"][p][k] for k in (
                    "saved_bytes_ratio", "saved_bytes_from", "max_act_ratio", "time_ratio",
                    "max_abs_grad_diff", "peak_act_mib", "step_s",
                    "wall_s", *mem_keys, "bwd_gflops_mm", "bwd_gflops_all")} for c in configs
            },
        }
        if cuda:
            summary[p]["cuda_peak_ratio"] = statistics.mean(r["cuda_peak_ratio"] for r in rows)
    targets = {}
    if {"none", "full", "selective"} <= set(summary):
        checks = []
        for c in configs:
            r = c["policies"]
            key = f"{c['shape']}/T{c['seq']}"
            line = on_or_below_line
            blocks = [r[p] for p in ("none", "every_k", "full") if p in r]
            row = {
                "config": key,
                "grads_le_1e-6": all(r[p]["max_abs_grad_diff"] <= 1e-6 for p in r),
                "full_saves_ge_80pct": 1 - r["full"]["saved_bytes_ratio"] >= 0.8,
                "selective_saves_ge_30pct": 1 - r["selective"]["saved_bytes_ratio"] >= 0.3,
                "selective_overhead_le_half_full": (r["selective"]["time_ratio"] - 1)
                <= 0.5 * (r["full"]["time_ratio"] - 1),
                "selective_below_line": line(r["selective"], r["full"]),
                "selective_beats_block_level": r["selective"]["time_ratio"]
                <= block_level_time_at(r["selective"]["saved_bytes_ratio"], blocks),
                "flops_none_lt_sel_lt_full_all_ops": r["none"]["bwd_gflops_all"] < r["selective"]["bwd_gflops_all"]
                < r["full"]["bwd_gflops_all"],
                # selective saves every matmul's output, so it recomputes none: its matmul FLOPs equal none's
                "flops_none_eq_sel_lt_full_mm_only": r["none"]["bwd_gflops_mm"] == r["selective"]["bwd_gflops_mm"]
                < r["full"]["bwd_gflops_mm"],
            }
            if "budget" in r:
                b = args.memory_budget
                row["budget_below_line"] = line(r["budget"], r["full"])
                row["budget_beats_block_level"] = r["budget"]["time_ratio"] <= block_level_time_at(
                    r["budget"]["saved_bytes_ratio"], blocks)
                row["budget_within_10pct_peak_act"] = abs(r["budget"]["saved_bytes_ratio"] - b) <= 0.1 * b
                row["budget_within_10pct_max_act"] = abs(r["budget"]["max_act_ratio"] - b) <= 0.1 * b
            checks.append(row)
        names = [k for k in checks[0] if k != "config"]
        targets = {k: all(row[k] for row in checks) for k in names}
        print("\ntargets (all configurations):")
        for k in names:
            bad = [row["config"] for row in checks if not row[k]]
            print(f"  {k:36s} {'PASS' if not bad else 'MISS: ' + ', '.join(bad)}")
    summary["targets"] = targets
    summary["settings"] = {"clock": step_clock(args), "threads": args.threads, "tokens": args.tokens,
                           "repeats": args.repeats, "every_k": args.every_k, "memory_budget": args.memory_budget}
    if cuda or args.dtype != "fp32":  # the CPU fp32 defaults keep the settings they always had
        summary["settings"].update(device=args.device, dtype=args.dtype, torch=torch.__version__,
                                   gpu=torch.cuda.get_device_name() if cuda else None)
    print(json.dumps(summary, separators=(",", ":")))
    return summary


if __name__ == "__main__":
    main()
