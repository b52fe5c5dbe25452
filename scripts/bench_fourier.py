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
import logging
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from lit_dtrain.models import build_llama
from lit_dtrain.utils.args import (
    ScriptArgumentParser,
    nonnegative_int,
    positive_float,
    positive_int,
    read_json_file,
    seed_int,
)
from lit_dtrain.utils.plots import OutputPathError, output_path
from lit_dtrain.utils.scripts import import_beside

import_beside(__file__)  # this script's modules beside it, scripts/_bench_fourier_*.py, also where a test loads it
from _bench_fourier_corpus import MIXTURE_SHARES, make_mixture  # noqa: E402, F401 - corpus (b)
from _bench_fourier_runs import (  # noqa: E402, F401 - the variants, one run, the interleaved timing
    ALL_VARIANTS,
    LAG_SUFFIX,
    LAG_VARIANTS,
    LONG_VARIANTS,
    ORACLE_RANDOM_SCALE,
    SCORE_ABLATION,
    PairedUniformSampler,
    base_variant,
    evaluate,
    interleaved_timing,
    make_datamodule,
    make_sampler,
    model_for,
    on_device,
    pipelined_timing,
    run,
    sync,
    train_step,
    val_set,
)
from _bench_fourier_summary import PLOT_STYLE, mean_curve, plot_curves, steps_to_target, summarize  # noqa: E402, F401


def main() -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", nargs="+", default=["stdlib", "mixture"], choices=["stdlib", "mixture"],
                    help="stdlib: corpus (a), the stdlib sources; mixture: corpus (b), code, prose, boilerplate, noise")
    ap.add_argument("--block-sizes", nargs="+", type=positive_int, default=[256, 1024],
                    help="window lengths T (above 256 only --long-variants run)")
    ap.add_argument("--variants", nargs="+", default=ALL_VARIANTS, metavar="VARIANT",
                    choices=ALL_VARIANTS + LAG_VARIANTS, help=f"of {ALL_VARIANTS}, uniform included (the reference; "
                    f"a Fourier one may end in {LAG_SUFFIX})")
    ap.add_argument("--long-variants", nargs="+", default=LONG_VARIANTS, metavar="VARIANT",
                    choices=ALL_VARIANTS + LAG_VARIANTS, help="variants run at block > 256 (uniform included)")
    ap.add_argument("--seeds", nargs="+", type=seed_int, default=[0, 1, 2], help="model-init and data seeds")
    ap.add_argument("--steps", type=positive_int, default=300, help="optimizer steps per run")
    ap.add_argument("--tokens-per-step", type=positive_int, default=2048, help="batch = tokens_per_step // block")
    ap.add_argument("--eval-every", type=positive_int, default=20, help="steps between two held-out evaluations")
    ap.add_argument("--val-windows", type=positive_int, default=96,
                    help="held-out 256-token windows (fewer when longer)")
    ap.add_argument("--eval-batch", type=positive_int, default=16, help="windows per evaluation forward")
    ap.add_argument("--mixture-kb", type=positive_int, default=320, help="size of corpus (b)")
    ap.add_argument("--d-model", type=positive_int, default=64, help="model residual width")
    ap.add_argument("--n-layer", type=positive_int, default=2, help="model blocks")
    ap.add_argument("--n-head", type=positive_int, default=4, help="query heads")
    ap.add_argument("--n-kv-head", type=positive_int, default=2, help="key/value heads")
    ap.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    ap.add_argument("--timing-steps", type=nonnegative_int, default=30,
                    help="interleaved steps per sampler and round (0: skip)")
    ap.add_argument("--timing-rounds", type=positive_int, default=3,
                    help="rounds of --timing-steps (the median is reported)")
    ap.add_argument("--timing-lags", nargs="+", type=int, default=[0, 1], choices=[0, 1],
                    help="FourierSampler lags timed against uniform (0: the brief's; 1: observe never waits)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (1 is stable on a shared machine)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the sampler's table stays on CPU either way)")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "lit_dtrain_bench_cache"),
                    help="token cache of the benchmark's corpora")
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
    if min(args.block_sizes) < 2:  # was a ValueError traceback from the samplers' setup, after the corpus was built
        ap.error(f"--block-sizes {min(args.block_sizes)}: the Fourier samplers need blocks of >= 2 tokens (the rfft "
                 "of T token losses has T // 2 bins besides the mean)")
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


@contextmanager
def each_data_warning_once():
    """Pass each distinct warning of the token cache's logger once while the block runs: every run builds its own
    ``LMDataModule``, and each load of the mixture's cache warned its split again (the same line 3 times or more a
    run, where ``train.py`` loads it once)."""
    logger, seen = logging.getLogger("lit_dtrain.data.corpus"), set()

    def first_time(record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message in seen:
            return False
        seen.add(message)
        return True

    logger.addFilter(first_time)
    try:
        yield
    finally:
        logger.removeFilter(first_time)


def train_all(args) -> tuple[list, dict]:
    print(f"python {sysconfig.get_python_version()}, torch {torch.__version__}, threads {args.threads}, "
          f"device {args.device}")
    runs, timing = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_fourier_") as tmp, each_data_warning_once():
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


if __name__ == "__main__":
    main()
