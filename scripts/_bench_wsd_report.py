"""bench_wsd.py's report of the three experiments: the plots (drawn by compare_runs.py) and the markdown tables."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import compare_runs  # scripts/compare_runs.py: bench_wsd.py puts scripts/ on sys.path

if TYPE_CHECKING:
    from bench_wsd import Bench


def plots(bench: Bench, e1: dict, e2: dict, e3: dict) -> list[str]:
    img = Path(bench.args.img_dir or bench.args.out_dir)
    out = []
    p = img / "wsd_vs_cosine.png"
    compare_runs.compare([e1["dirs"]["wsd"], e1["dirs"]["cosine"]], ["val/loss", "lr-AdamW/decay"],
                         labels=[f"WSD 1-sqrt 20% (lr {e1['best_lr']['wsd']:g})",
                                 f"cosine (lr {e1['best_lr']['cosine']:g})"],
                         out=str(p), title="WSD vs cosine, each at its best peak LR")
    out.append(str(p))
    curves = {}
    for label, d in [("stable (no decay)", e2["dirs"]["stable"])] + [
        (f"branch 20% decay, L={Lk}", d) for Lk, d in zip(e2["lengths"], e2["dirs"]["branches_f0.2"])
    ] + [(f"cosine L={Lk}", d) for Lk, d in zip(e2["lengths"], e2["dirs"]["cosine"])]:
        s = compare_runs.read_scalars(Path(d))
        at = compare_runs.steps_trained_of(Path(d), s)  # as compare() draws them: the steps trained
        curves[label] = {"val/loss": at(s.get("val/loss", [])), "lr-AdamW/decay": at(s.get("lr-AdamW/decay", []))}
    p = img / "wsd_branches.png"
    compare_runs.plot(curves, ["val/loss", "lr-AdamW/decay"], p, title="One stable run, three decay branches")
    out.append(str(p))
    curves = {}
    for name, d in e3["dirs"].items():
        s = compare_runs.read_scalars(Path(d))
        at = compare_runs.steps_trained_of(Path(d), s)
        curves[name] = {"val loss on B (licenses)": at(s.get("val/licenses/loss") or s.get("val/loss", [])),
                        "lr-AdamW/decay": at(s.get("lr-AdamW/decay", []))}
    p = img / "wsd_cpt.png"
    compare_runs.plot(curves, ["val loss on B (licenses)", "lr-AdamW/decay"], p,
                      title="Continual pre-training on B from a model trained on A")
    out.append(str(p))
    return out


def markdown(e1: dict, e2: dict, e3: dict) -> str:
    lines = ["### 1. WSD (1-sqrt, last 20%) vs cosine, peak LR tuned on the grid", "",
             "| peak LR | " + " | ".join(f"{lr:g}" for lr in e1["grid"]) + " |",
             "|---|" + "---:|" * len(e1["grid"])]
    for s in ("wsd", "cosine"):
        lines.append(f"| {s} | " + " | ".join(f"{e1['val_loss'][s][f'{lr:g}']:.4f}" for lr in e1["grid"]) + " |")
    lines += ["", f"best WSD {e1['wsd']:.4f} (lr {e1['best_lr']['wsd']:g}) vs best cosine {e1['cosine']:.4f} "
              f"(lr {e1['best_lr']['cosine']:g}): ratio {e1['ratio_wsd_over_cosine']:.4f}"]
    for c in e1["other_seeds"]:
        lines.append(f"same LRs, seed {c['seed']}: WSD {c['wsd']:.4f} vs cosine {c['cosine']:.4f}: "
                     f"ratio {c['ratio_wsd_over_cosine']:.4f}")
    lines += ["",
              "### 2. Decay branches of one stable run vs separately trained cosine runs", "",
              "| set | " + " | ".join(f"L={Lk}" for Lk in e2["lengths"]) + " | steps of the set | all within 1% |",
              "|---|" + "---:|" * len(e2["lengths"]) + "---:|---|",
              "| cosine (3 runs) | " + " | ".join(f"{e2['cosine_val_loss'][str(Lk)]:.4f}" for Lk in e2["lengths"])
              + f" | {e2['cosine_set_steps_over_T']:.2f} T | |"]
    for f, r in e2["fractions"].items():
        cells = [f"{r['branch_val_loss'][str(Lk)]:.4f} ({100 * r['gap_vs_cosine'][str(Lk)]:+.2f}%)"
                 for Lk in e2["lengths"]]
        lines.append(f"| WSD branches, {float(f) * 100:g}% decay | " + " | ".join(cells)
                     + f" | {r['set_steps_over_T']:.3f} T | {'yes' if r['all_within_1pct'] else 'no'} |")
    lines += ["", "### 3. Continual pre-training on B (from the best WSD model on A)", "",
              "| variant | val loss B | val loss A | forgetting on A |", "|---|---:|---:|---:|",
              f"| before CPT | {e3['base']['val_loss_B']:.4f} | {e3['base']['val_loss_A']:.4f} | |"]
    for name, r in e3["variants"].items():
        lines.append(f"| {name} | {r['val_loss_B']:.4f} | {r['val_loss_A']:.4f} | {r['forgetting_A']:+.4f} |")
    return "\n".join(lines) + "\n"
