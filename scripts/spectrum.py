#!/usr/bin/env python
"""Average token-loss spectrum of one or more checkpoints on a corpus, plotted to PNG with the band edges.

The brief's "spectral analysis tool to verify effective bandwidth": it computes each held-out window's
per-token loss, takes the one-sided power spectrum of the rfft along the sequence (normalized so that a
window's bins sum to the variance of its token loss, as :func:`band_energies` does), averages over windows and
plots power against frequency (cycles per window; the top axis shows the period in tokens). Vertical lines mark
the lower edges of the FourierSampler's bands for this length (solid: ``num_bands``, the bands it scores with when
the stage schedule is off; dotted: its finest layout, the stage schedule's 8 bands by default). It prints each
band's share of the energy and the effective bandwidth (the lowest bin at or below which ``--bandwidth-fraction`` of
the energy lies); the last line is one JSON object.

    python scripts/spectrum.py outputs/runs/RUN/checkpoints/last.ckpt --out spectrum.png
    python scripts/spectrum.py early.ckpt late.ckpt --files ~/corpus --block-size 1024

The held-out documents are those the run held out: ``data.val_fraction`` is read from the checkpoint (or its run's
``.hydra/config.yaml``); ``--val-fraction`` sets it, and without either a note says the default 0.02 is assumed.
The corpus and the window length are the run's too (``data.sources`` and ``data.block_size`` of the run dir's
``config_resolved.yaml``, of the first checkpoint that lies in a run dir; ``--files``/``--source`` and ``--block-size``
set them), and the band edges are those of the run's FourierSampler at that length (``max_freq``/``num_bands`` of
the sampler state in the first checkpoint that has one; ``--max-freq``/``--num-bands`` set them). Without a run
config the stdlib corpus and the model's block_size are used, and without a FourierSampler state the brief's bands
for ``T``; a line says which (a run config that is not YAML is refused, naming it). The token cache is the run's
(``data.cache_dir``; ``--cache-dir`` sets it), so the run's tokens are read, not the corpus tokenized again; the run's
``data.exclude_dirs`` (its outputs' root) are left out of the corpus, as in training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.config_resolvers import default_cache_dir
from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet
from lit_dtrain.data.corpus import CorpusError
from lit_dtrain.data.samplers import spectral
from lit_dtrain.module import token_loss
from lit_dtrain.schedules.workflows import model_from_checkpoint
from lit_dtrain.utils.args import ScriptArgumentParser, fail, positive_int, quiet_when_the_reader_goes
from lit_dtrain.utils.plots import OutputPathError, output_path, write_atomically

DEFAULT_VAL_FRACTION = 0.02  # conf/data/stdlib.yaml's data.val_fraction


def load_model(path: str, with_checkpoint: bool = False):
    """The model of a lit_dtrain checkpoint (its shape comes from the checkpoint's ``model_config``), and with
    ``with_checkpoint`` the checkpoint dict too."""
    try:  # a missing, truncated, foreign or weightless file, or NaN weights: one line naming it, not a traceback
        model, ckpt = model_from_checkpoint(path)
    except CheckpointError as e:
        fail(str(e))
    return (model, ckpt) if with_checkpoint else model


def trained_val_fraction(path: str, ckpt: dict) -> tuple[float | None, str]:
    """The ``data.val_fraction`` the checkpoint's run held out, and where it was found: the datamodule state in
    the checkpoint (``LMDataModule``, recorded since it was added there), else the run's ``.hydra/config.yaml``
    (``<run>/checkpoints/x.ckpt``); ``(None, ...)`` when neither has it."""
    state = ckpt.get("LMDataModule")
    if isinstance(state, dict) and isinstance(state.get("val_fraction"), (int, float)):
        return float(state["val_fraction"]), "the checkpoint"
    config = Path(path).expanduser().resolve().parent.parent / ".hydra" / "config.yaml"
    value = (run_data_config(path, ".hydra/config.yaml") or {}).get("val_fraction")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), str(config)
    return None, "nowhere"


def run_data_config(path: str, name: str = "config_resolved.yaml") -> dict | None:
    """``data`` of the checkpoint's run config ``<run>/<name>`` (``<run>/checkpoints/x.ckpt``), or None without one.
    A run config that is not YAML, not UTF-8 text or not a mapping (cut short, edited) is one line naming it: it was
    a YAMLError or UnicodeDecodeError traceback, or taken for no run config, and left out it would measure another
    corpus than the run's."""
    config = Path(path).expanduser().resolve().parent.parent / name
    import yaml

    try:
        text = config.read_text()
    except OSError:  # no run dir: a copied-out checkpoint
        return None
    except UnicodeDecodeError as e:  # binary, or another encoding: a traceback (it was skipped before YAML was checked)
        unreadable_run_config(config, path, f"is not UTF-8 text (byte {e.start})")
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        unreadable_run_config(config, path, f"is not valid YAML{where}")
    if not isinstance(loaded, dict):  # empty or a list: it was taken for no run config ('no run config beside the
        # checkpoint'), and the stdlib corpus was measured at the model's block_size, not the run's window length
        unreadable_run_config(config, path, "is empty" if loaded is None else
                              f"is a YAML {type(loaded).__name__}, not a mapping of config keys")
    data = loaded.get("data")
    if data is not None and not isinstance(data, dict):  # 'data: 5' was taken for no run config, as 'sources: 5' was
        unreadable_run_config(config, path, f"has data={data!r}, not a mapping of data keys")
    return data


def unreadable_run_config(config: Path, path: str, what: str) -> None:
    """Refuse the run config ``config`` of checkpoint ``path`` that ``what`` says cannot be read, in one line."""
    fail(f"the run config {str(config)!r} of checkpoint {path!r} {what} (cut short or edited?): spectrum.py reads "
         "the run's corpus and window length from it; repair it, or copy the checkpoint out of its run dir and give "
         "the corpus with --files and the length with --block-size")


def described(source: CorpusSource) -> str:
    """The corpus line's words for a run's source (it printed the dataclass: ``CorpusSource(name='text', ...)``)."""
    what = "the stdlib" if source.kind == "stdlib" else f"files {', '.join(map(str, source.paths))}"
    pattern = f" (pattern {source.pattern!r})" if source.pattern != "*" else ""
    return f"source {source.name or source.kind!r}: {what}{pattern}"


def run_source(data: dict | None, name: str | None) -> CorpusSource | None:
    """The run's corpus source (``--source`` picks one of a mixture's), or None when the run config has none. An
    edited ``data.sources`` that is no list of mappings (``sources: 5``) or lists none (``sources: []``, ``data: {}``)
    is one line naming it: it was dropped and the corpus line said 'no run config beside the checkpoint' over the
    stdlib corpus."""
    listed = (data or {}).get("sources")
    listed = [] if listed is None else listed  # 'sources: 0' or '{}' was read as none listed: no run config, it said
    bad = [f"data.sources={listed!r}"] if not isinstance(listed, list) else [
        f"data.sources.{i}={s!r}" for i, s in enumerate(listed) if not isinstance(s, dict)]
    if data is not None and not listed:  # 'sources: []' or 'data: {}' (every run lists one): no run config, it said
        bad = [f"data.sources={data['sources']!r}" if "sources" in data else "no data.sources"]
    if bad:
        fail(f"the run's config_resolved.yaml has {bad[0]}, not a list of sources (edited?): repair it, or give the "
             "corpus with --files")
    sources = listed
    if not sources:
        if name is not None:
            fail(f"--source {name}: the run's config_resolved.yaml lists no data.sources")
        return None
    names = [str(s.get("name")) for s in sources]
    if name is None and len(sources) > 1:
        fail(f"the run trained on a mixture of sources {names}: pick one with --source NAME (or give the corpus "
             "with --files)")
    if name is not None and name not in names:
        fail(f"--source {name!r} is not one of the run's sources {names}")
    chosen = sources[names.index(name) if name is not None else 0]
    keys = ("name", "kind", "paths", "pattern")
    try:
        return CorpusSource(**{k: chosen[k] for k in keys if k in chosen})
    except (CorpusError, TypeError, ValueError) as e:  # an edited run config: it was a traceback
        fail(f"the run's data.sources entry {chosen} is not a corpus source ({e}); give the corpus with --files")


def run_exclude_dirs(data: dict | None) -> list[str] | None:
    """The run's ``data.exclude_dirs`` (the dirs never read as corpus text: its outputs' root), or None. One dir
    (``data.exclude_dirs=/runs``, as the config takes it) is a list of one: it was read as no exclusion."""
    dirs = (data or {}).get("exclude_dirs")
    dirs = [dirs] if isinstance(dirs, str) else dirs
    return [str(d) for d in dirs] if isinstance(dirs, list) else None


def sampler_bands(ckpt: dict, seq_len: int) -> tuple[int, int, int] | None:
    """``(max_freq, num_bands, fine_bands)`` of the checkpoint's FourierSampler state when it was bound to windows of
    ``seq_len`` tokens, else None."""
    state = ckpt.get("LMDataModule")
    sampler = state.get("sampler") if isinstance(state, dict) else None
    if not isinstance(sampler, dict) or int(sampler.get("seq_len") or 0) != seq_len:
        return None
    max_freq, num_bands, fine = (int(sampler.get(k) or 0) for k in ("max_freq", "num_bands", "fine_bands"))
    return (max_freq, num_bands, max(fine, num_bands)) if max_freq > 0 and num_bands > 0 else None


def windows_of(
    args, block_size: int, val_fraction: float = DEFAULT_VAL_FRACTION, source: CorpusSource | None = None,
    exclude_dirs: list[str] | None = None,
) -> torch.Tensor:
    """``--windows`` evenly spaced windows [W, T+1] of the corpus' held-out (or train) split, with the documents
    held out by ``val_fraction`` (the trained run's, so that "held-out" means not trained on). The corpus: ``--files``,
    else ``source`` (the run's), else the stdlib corpus, without the files under ``exclude_dirs`` (the run's
    ``data.exclude_dirs``, its outputs' root: a corpus dir holding the run dir was read with its checkpoints and
    logs, another document set and split than the run's)."""
    if args.files:
        source = CorpusSource(name="files", kind="files", paths=args.files)
    dm = LMDataModule(
        sources=[source or CorpusSource()],
        block_size=block_size,
        batch_size=1,
        cache_dir=args.cache_dir,
        val_fraction=val_fraction,
        progress=False,
        exclude_dirs=exclude_dirs,
    )
    dm.prepare_data()
    stream = dm.splits[0].val if args.split == "val" else dm.splits[0].train
    ws = WindowSet([stream], block_size)
    if len(ws) == 0:
        fail(f"the {args.split} split has no window of {block_size + 1} tokens")
    idx = np.unique(np.linspace(0, len(ws) - 1, min(len(ws), args.windows)).round().astype(np.int64))
    return ws.gather(idx)


def effective_bandwidth_bin(power: np.ndarray, fraction: float) -> int:
    """The lowest bin ``b`` whose bins 1..b hold ``fraction`` of the energy of bins 1..T//2 (bin 0, the mean, is
    none). Summed in float64 and divided by the last partial sum, so that ``fraction`` 1 is the last bin: the float32
    cumulative share ended just below 1 in 6 of 12 spectra at T=64, and ``--bandwidth-fraction 1`` said bin 33,
    past the Nyquist bin 32 (period 1.9 tokens)."""
    cumulative = np.cumsum(np.asarray(power[1:], dtype=np.float64))
    return min(int(np.searchsorted(cumulative / cumulative[-1], fraction)) + 1, len(power) - 1)


@torch.no_grad()
def mean_spectrum(model, windows: torch.Tensor, batch: int) -> tuple[np.ndarray, float]:
    """Mean one-sided power per rfft bin (bins 0..T//2, Parseval-normalized) and the mean token loss."""
    powers, losses = [], []
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        loss = token_loss(model(w[:, :-1]), w[:, 1:])  # (B, T), LitLLM's loss
        powers.append(spectral.power_spectrum(loss - loss.mean(1, keepdim=True)).sum(0))
        losses.append(loss.mean(1))
    return (torch.stack(powers).sum(0) / len(windows)).numpy(), float(torch.cat(losses).mean())


@quiet_when_the_reader_goes  # `... | head`: ends as cat does
def main(argv: list[str] | None = None) -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="lit_dtrain checkpoints (last.ckpt ...), overlaid")
    ap.add_argument(
        "--files",
        nargs="+",
        default=None,
        help="corpus files/dirs/globs (default: the run's corpus, else the stdlib corpus)",
    )
    ap.add_argument("--source", default=None, help="which of the run's data.sources (needed for a mixture)")
    ap.add_argument("--split", choices=["val", "train"], default="val", help="which split's windows")
    # the integer flags are >= 1 (positive_int): 0 is not "auto", that is leaving the flag out
    ap.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="window length T (default: the run's data.block_size, else the model's)",
    )
    ap.add_argument("--windows", type=positive_int, default=128, help="windows averaged")
    ap.add_argument("--batch-size", type=positive_int, default=16, help="windows per forward")
    ap.add_argument(
        "--max-freq",
        type=positive_int,
        default=None,
        help="band edges (default: the run's FourierSampler's at T, else the brief's for T)",
    )
    ap.add_argument("--num-bands", type=positive_int, default=None,
                    help="bands drawn (default: the run's FourierSampler's at T, else the brief's)")
    ap.add_argument("--bandwidth-fraction", type=float, default=0.9,
                    help="effective bandwidth: the lowest bin at or below which this share of the energy lies")
    ap.add_argument("--labels", nargs="+", default=None, help="legend labels (default: file paths)")
    ap.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="documents held out (default: the run's data.val_fraction, from the checkpoint)",
    )
    ap.add_argument("--cache-dir", default=None,
                    help="token cache (default: the run's data.cache_dir, else LIT_DTRAIN_CACHE, ~/.cache/lit_dtrain)")
    ap.add_argument("--out", default="spectrum.png", help="PNG path")
    args = ap.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.checkpoints):  # zip() dropped the extra checkpoints
        ap.error(f"--labels has {len(args.labels)} entries but there are {len(args.checkpoints)} checkpoints")
    if not 0 < args.bandwidth_fraction <= 1:
        ap.error(f"--bandwidth-fraction must be in (0, 1], got {args.bandwidth_fraction}")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        ap.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    try:  # before the work: an unwritable --out used to be a traceback after it
        out = output_path(args.out, "--out", image=True)
    except OutputPathError as e:
        ap.error(str(e))

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
    # the run config of the first checkpoint that has one: a copied-out early.ckpt listed first took the stdlib
    # corpus at the model's block_size, though the run's last.ckpt beside it named its corpus and window length
    configs = [run_data_config(path) for path in args.checkpoints]
    first = next((i for i, config in enumerate(configs) if config is not None), 0)
    data = configs[first]
    # the run's token cache: a dir of its own under /tmp tokenized the run's whole corpus again
    args.cache_dir = args.cache_dir or str((data or {}).get("cache_dir") or "") or default_cache_dir()
    source = None if args.files else run_source(data, args.source)
    if source is not None:  # overlaid runs must be measured on one corpus
        for path, config in zip(args.checkpoints, configs):
            other = run_source(config, args.source)
            if other is not None and (other.kind, other.paths) != (source.kind, source.paths):
                ap.error(
                    f"{args.checkpoints[first]} was trained on {source.kind} {source.paths} and {path} on "
                    f"{other.kind} {other.paths}; compare them on one corpus with --files"
                )
    if args.files:
        print(f"corpus: --files {args.files}")
    else:
        print(
            f"corpus: {described(source)} (the run's, from its config_resolved.yaml)"
            if source
            else "corpus: the stdlib corpus (no run config beside the checkpoint; give the run's corpus with --files)"
        )
    trained_T = (data or {}).get("block_size")
    trained_T = trained_T if isinstance(trained_T, int) and not isinstance(trained_T, bool) and trained_T > 0 else None
    T = args.block_size or trained_T or models[0].config.block_size
    if T < 2:  # a spectrum needs 2 positions: it was a ValueError traceback from power_spectrum after the corpus
        ap.error(f"the window length (--block-size) is {T}; a token-loss spectrum needs at least 2 tokens")
    # the length's origin: without --block-size, the error named that flag for the first run's data.block_size
    origin = "--block-size" if args.block_size else (
        f"the window length (data.block_size of the run of {args.checkpoints[first]})" if trained_T
        else f"the window length (the block_size of {args.checkpoints[0]})")
    for path, model in zip(args.checkpoints, models):  # before the corpus is tokenized
        if T > model.config.block_size:
            shortest = min(m.config.block_size for m in models)
            ap.error(f"{origin} {T} exceeds the block_size {model.config.block_size} of {path}; compare them at a "
                     f"length that fits every model, e.g. --block-size {shortest}")
    run_bands = next((bands for _, ckpt in loaded if (bands := sampler_bands(ckpt, T))), None)  # the first run's
    auto_freq, auto_bands, fine = run_bands or (*spectral.default_band_config(T), 8)
    print(f"bands: the run's FourierSampler's at T={T}" if run_bands else f"bands: the brief's default for T={T}")
    max_freq = auto_freq if args.max_freq is None else args.max_freq
    num_bands = auto_bands if args.num_bands is None else args.num_bands
    try:
        windows = windows_of(args, T, val_fraction, source, run_exclude_dirs(data))
    except CorpusError as e:  # a missing --files path, a dir without files: one line naming it
        fail(str(e))
    labels = args.labels or args.checkpoints
    fig, ax = plt.subplots(figsize=(8, 4.8))
    results = []
    freqs = np.arange(T // 2 + 1)
    for model, label in zip(models, labels):
        power, mean_loss = mean_spectrum(model, windows, args.batch_size)
        band = spectral.bin_to_band(max_freq, num_bands, T).numpy()
        energy = np.array([power[band == b].sum() for b in range(num_bands)], dtype=np.float64)  # no f32 noise in JSON
        bandwidth = effective_bandwidth_bin(power, args.bandwidth_fraction)
        ax.loglog(freqs[1:], power[1:], label=f"{label} (mean loss {mean_loss:.3f})")
        results.append({"checkpoint": label, "mean_loss": mean_loss, "variance": float(power[1:].sum()),
                        "band_fractions": (energy / energy.sum()).round(4).tolist(),
                        "effective_bandwidth_bin": bandwidth})
        print(f"{label}: mean loss {mean_loss:.4f}, loss variance {power[1:].sum():.4f}, band shares "
              f"{(energy / energy.sum()).round(3).tolist()}, {args.bandwidth_fraction:.0%} of the energy at or "
              f"below bin {bandwidth} (period {T / bandwidth:.1f} tokens)")
    edges = spectral.band_lower_bins(max_freq, num_bands, T).tolist()
    for e in edges:
        ax.axvline(e, color="k", lw=1)
    for e in spectral.band_lower_bins(max_freq, fine, T).tolist():
        if e not in edges:
            ax.axvline(e, color="k", lw=0.6, ls=":")
    ax.set_xlabel(f"frequency (cycles per {T}-token window)")
    ax.set_ylabel("mean power of token loss (nats² per bin)")
    top = ax.secondary_xaxis("top", functions=(lambda f: T / np.maximum(f, 1e-9), lambda p: T / np.maximum(p, 1e-9)))
    top.set_xlabel("period (tokens)")
    ax.legend(fontsize=8)
    ax.set_title(f"Token-loss spectrum, {len(windows)} {args.split} windows; band edges: compute_bands("
                 f"{max_freq}, {num_bands}) solid, {fine} bands dotted", fontsize=9)
    fig.tight_layout()
    write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=120))
    print(f"wrote {out}")
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
                "out": str(out),
                "checkpoints": results,
            }
        )
    )


if __name__ == "__main__":
    main()
