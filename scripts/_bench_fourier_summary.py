"""bench_fourier.py's summary: each variant against uniform per corpus and block, paired by seed (the printed
tables and the JSON), and the plot of the seed-averaged val curves."""

from __future__ import annotations

import statistics

from _bench_fourier_runs import LAG_SUFFIX, ORACLE_RANDOM_SCALE, base_variant


def steps_to_target(curve, target: float) -> float | None:
    """First step where the (linearly interpolated) val curve reaches ``target``; None if it never does."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v0 <= target:
            return float(s0)
        if v1 <= target:
            return s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return None


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
                  f"(rounds {t[f'round_ratios{suffix}']}; fourier{suffix} {t[f'fourier{suffix}_ms']:.1f} vs "
                  f"uniform {t['uniform_ms']:.1f} ms/step, N={t['num_samples']})")
            if f"pipelined_ratio{suffix}" in t:
                print(f"[{corpus}] pipelined ({args.timing_steps} steps, one sync) ratio fourier{suffix}/uniform: "
                      f"{t[f'pipelined_ratio{suffix}']:.4f} (rounds {t[f'pipelined_round_ratios{suffix}']}; "
                      f"fourier{suffix} {t[f'pipelined_fourier{suffix}_ms']:.2f} vs uniform "
                      f"{t['pipelined_uniform_ms']:.2f} ms/step)")
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
