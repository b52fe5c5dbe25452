#!/usr/bin/env python
"""Average token-loss spectrum of one or more checkpoints on a corpus, plotted to PNG with the band edges.

The brief's "spectral analysis tool to verify effective bandwidth": it computes each held-out window's
per-token loss, takes the one-sided power spectrum of the rfft along the sequence (normalized so that a
window's bins sum to the variance of its token loss, as :func:`band_energies` does), averages over windows and
plots power against frequency (cycles per window; the top axis shows the period in tokens). Vertical lines mark
the lower edges of the FourierSampler's bands for this length (solid: ``--num-bands``; dotted: the 8-band
stage layout). It prints each band's share of the energy and the effective bandwidth (the bin below which
``--bandwidth-fraction`` of the energy lies); the last line is one JSON object.

    python scripts/spectrum.py outputs/runs/RUN/checkpoints/last.ckpt --out spectrum.png
    python scripts/spectrum.py early.ckpt late.ckpt --files ~/corpus --block-size 1024

The held-out documents are those the run held out: ``data.val_fraction`` is read from the checkpoint (or its run's
``.hydra/config.yaml``); ``--val-fraction`` sets it, and without either a note says the default 0.02 is assumed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet
from lit_dtrain.data.corpus import CorpusError
from lit_dtrain.data.samplers import spectral
from lit_dtrain.schedules.workflows import model_from_checkpoint

DEFAULT_VAL_FRACTION = 0.02  # conf/data/stdlib.yaml's data.val_fraction


def load_model(path: str, with_checkpoint: bool = False):
    """The model of a lit_dtrain checkpoint (its shape comes from the checkpoint's ``model_config``), and with
    ``with_checkpoint`` the checkpoint dict too."""
    try:  # a missing, truncated, foreign or weightless file: one line naming it, not a traceback
        model, ckpt = model_from_checkpoint(path)
    except CheckpointError as e:
        raise SystemExit(str(e)) from e
    return (model, ckpt) if with_checkpoint else model


def trained_val_fraction(path: str, ckpt: dict) -> tuple[float | None, str]:
    """The ``data.val_fraction`` the checkpoint's run held out, and where it was found: the datamodule state in
    the checkpoint (``LMDataModule``, recorded since it was added there), else the run's ``.hydra/config.yaml``
    (``<run>/checkpoints/x.ckpt``); ``(None, ...)`` when neither has it."""
    state = ckpt.get("LMDataModule")
    if isinstance(state, dict) and isinstance(state.get("val_fraction"), (int, float)):
        return float(state["val_fraction"]), "the checkpoint"
    config = Path(path).expanduser().resolve().parent.parent / ".hydra" / "config.yaml"
    try:
        import yaml

        value = (yaml.safe_load(config.read_text()) or {}).get("data", {}).get("val_fraction")
    except (OSError, ValueError, AttributeError, ImportError):  # no run dir, unreadable or odd YAML
        value = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), str(config)
    return None, "nowhere"


def windows_of(args, block_size: int, val_fraction: float = DEFAULT_VAL_FRACTION) -> torch.Tensor:
    """``--windows`` evenly spaced windows [W, T+1] of the corpus' held-out (or train) split, with the documents
    held out by ``val_fraction`` (the trained run's, so that "held-out" means not trained on)."""
    source = CorpusSource(name="files", kind="files", paths=args.files) if args.files else CorpusSource()
    dm = LMDataModule(
        sources=[source],
        block_size=block_size,
        batch_size=1,
        cache_dir=args.cache_dir,
        val_fraction=val_fraction,
        progress=False,
    )
    dm.prepare_data()
    stream = dm.splits[0].val if args.split == "val" else dm.splits[0].train
    ws = WindowSet([stream], block_size)
    if len(ws) == 0:
        raise SystemExit(f"the {args.split} split has no window of {block_size + 1} tokens")
    idx = np.unique(np.linspace(0, len(ws) - 1, min(len(ws), args.windows)).round().astype(np.int64))
    return ws.gather(idx)


@torch.no_grad()
def mean_spectrum(model, windows: torch.Tensor, batch: int) -> tuple[np.ndarray, float]:
    """Mean one-sided power per rfft bin (bins 0..T//2, Parseval-normalized) and the mean token loss."""
    powers, losses = [], []
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = model(w[:, :-1])
        B, T, V = logits.shape
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, V), w[:, 1:].reshape(-1),
                                                 reduction="none").view(B, T)
        powers.append(spectral.power_spectrum(loss - loss.mean(1, keepdim=True)).sum(0))
        losses.append(loss.mean(1))
    return (torch.stack(powers).sum(0) / len(windows)).numpy(), float(torch.cat(losses).mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="lit_dtrain checkpoints (last.ckpt ...), overlaid")
    ap.add_argument("--files", nargs="*", default=None, help="corpus files/dirs/globs (default: the stdlib corpus)")
    ap.add_argument("--split", choices=["val", "train"], default="val")
    ap.add_argument("--block-size", type=int, default=None, help="window length T (default: the model's)")
    ap.add_argument("--windows", type=int, default=128, help="windows averaged")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-freq", type=int, default=None, help="band edges (default: the brief's for T)")
    ap.add_argument("--num-bands", type=int, default=None)
    ap.add_argument("--bandwidth-fraction", type=float, default=0.9)
    ap.add_argument("--labels", nargs="*", default=None, help="legend labels (default: file paths)")
    ap.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="documents held out (default: the run's data.val_fraction, from the checkpoint)",
    )
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "lit_dtrain_spectrum_cache"))
    ap.add_argument("--out", default="spectrum.png", help="PNG path")
    args = ap.parse_args(argv)
    for flag, value in (("--max-freq", args.max_freq), ("--num-bands", args.num_bands),
                        ("--block-size", args.block_size), ("--windows", args.windows),
                        ("--batch-size", args.batch_size)):
        if value is not None and value <= 0:  # not "auto": that is leaving the flag out
            ap.error(f"{flag} must be a positive integer, got {value}")
    if args.labels is not None and len(args.labels) != len(args.checkpoints):  # zip() dropped the extra checkpoints
        ap.error(f"--labels has {len(args.labels)} entries but there are {len(args.checkpoints)} checkpoints")
    if not 0 < args.bandwidth_fraction <= 1:
        ap.error(f"--bandwidth-fraction must be in (0, 1], got {args.bandwidth_fraction}")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        ap.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [load_model(p, with_checkpoint=True) for p in args.checkpoints]
    models = [model for model, _ in loaded]
    val_fraction = args.val_fraction
    if val_fraction is None:  # the held-out documents must be the ones the runs held out
        found = {p: trained_val_fraction(p, ckpt) for p, (_, ckpt) in zip(args.checkpoints, loaded)}
        known = {p: v for p, (v, _) in found.items() if v is not None}
        if len(set(known.values())) > 1:
            listed = ", ".join(f"{p}: {v}" for p, v in known.items())
            ap.error(
                f"the checkpoints were trained with different data.val_fraction ({listed}), so they held out "
                "different documents; compare them on one split with --val-fraction (or --split train)"
            )
        if known:
            path, val_fraction = next(iter(known.items()))
            print(f"val_fraction {val_fraction} (data.val_fraction of the run, from {found[path][1]})")
        else:
            val_fraction = DEFAULT_VAL_FRACTION
            print(
                f"note: {args.checkpoints[0]} records no data.val_fraction (a checkpoint from before it was "
                f"recorded, without its run's .hydra/config.yaml); assuming {val_fraction}, the default: if the "
                "run used another, pass it as --val-fraction, or its 'held-out' windows include trained ones"
            )
    T = args.block_size or models[0].config.block_size
    for path, model in zip(args.checkpoints, models):  # before the corpus is tokenized
        if T > model.config.block_size:
            ap.error(f"--block-size {T} exceeds the block_size {model.config.block_size} of {path}")
    auto_freq, auto_bands = spectral.default_band_config(T)
    max_freq = auto_freq if args.max_freq is None else args.max_freq
    num_bands = auto_bands if args.num_bands is None else args.num_bands
    try:
        windows = windows_of(args, T, val_fraction)
    except CorpusError as e:  # a missing --files path, a dir without files: one line naming it
        raise SystemExit(f"spectrum.py: {e}") from e
    labels = args.labels or args.checkpoints
    fig, ax = plt.subplots(figsize=(8, 4.8))
    results = []
    freqs = np.arange(T // 2 + 1)
    for model, label in zip(models, labels):
        power, mean_loss = mean_spectrum(model, windows, args.batch_size)
        band = spectral.bin_to_band(max_freq, num_bands, T).numpy()
        energy = np.array([power[band == b].sum() for b in range(num_bands)], dtype=np.float64)  # no f32 noise in JSON
        cumulative = np.cumsum(power[1:]) / power[1:].sum()
        bandwidth = int(np.searchsorted(cumulative, args.bandwidth_fraction) + 1)
        ax.loglog(freqs[1:], power[1:], label=f"{label} (mean loss {mean_loss:.3f})")
        results.append({"checkpoint": label, "mean_loss": mean_loss, "variance": float(power[1:].sum()),
                        "band_fractions": (energy / energy.sum()).round(4).tolist(),
                        "effective_bandwidth_bin": bandwidth})
        print(f"{label}: mean loss {mean_loss:.4f}, loss variance {power[1:].sum():.4f}, band shares "
              f"{(energy / energy.sum()).round(3).tolist()}, {args.bandwidth_fraction:.0%} of the energy below "
              f"bin {bandwidth} (period {T / bandwidth:.1f} tokens)")
    edges = spectral.band_lower_bins(max_freq, num_bands, T).tolist()
    for e in edges:
        ax.axvline(e, color="k", lw=1)
    for e in spectral.band_lower_bins(max_freq, 8, T).tolist():
        if e not in edges:
            ax.axvline(e, color="k", lw=0.6, ls=":")
    ax.set_xlabel(f"frequency (cycles per {T}-token window)")
    ax.set_ylabel("mean power of token loss (nats² per bin)")
    top = ax.secondary_xaxis("top", functions=(lambda f: T / np.maximum(f, 1e-9), lambda p: T / np.maximum(p, 1e-9)))
    top.set_xlabel("period (tokens)")
    ax.legend(fontsize=8)
    ax.set_title(f"Token-loss spectrum, {len(windows)} {args.split} windows; band edges: compute_bands("
                 f"{max_freq}, {num_bands}) solid, 8 bands dotted", fontsize=9)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    print(
        json.dumps(
            {
                "block_size": T,
                "max_freq": max_freq,
                "num_bands": num_bands,
                "band_lower_bins": edges,
                "val_fraction": val_fraction,
                "split": args.split,
                "windows": len(windows),
                "out": args.out,
                "checkpoints": results,
            }
        )
    )


if __name__ == "__main__":
    main()
