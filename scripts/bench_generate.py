#!/usr/bin/env python
"""Generation speed with the key/value cache against without it (``Llama.generate(use_cache=True/False)``).

Both sample the same seeded random-init model from the same prompt, greedily, in fp32, for each shape
(``conf/model/<shape>.yaml``) and each ``--new-tokens`` count; the runs alternate (cached, uncached, cached, ...)
for ``--rounds`` rounds, so that background load hits both alike, and the time is the median round. Every pair is
checked to draw the same tokens. With ``block_size`` 256 (the model files'), 500 new tokens pass the block: from
there the window slides and every step is a full forward with the cache too, so that row's ratio is lower.

    python scripts/bench_generate.py
    python scripts/bench_generate.py --shapes nano --new-tokens 200 --rounds 5 --threads 2

Last line: JSON with one row per (shape, new_tokens): block_size, cached_tokens_per_s, uncached_tokens_per_s,
speedup, same_tokens; and the device, threads, prompt length and batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lit_dtrain.utils.args import ScriptArgumentParser, comma_list, positive_int  # noqa: E402

SHAPES = ("nano", "small", "llama_125m")


def build_model(shape: str, block_size: int | None, device: torch.device):
    """The seeded random-init model of ``conf/model/<shape>.yaml`` (``block_size`` overridden where given)."""
    overrides = [f"model={shape}"] + ([f"model.block_size={block_size}"] if block_size else [])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    torch.manual_seed(0)
    return instantiate(cfg.model).to(device).eval()


def timed_generate(model, prompt: torch.Tensor, new_tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    if prompt.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(prompt, new_tokens, temperature=0, use_cache=use_cache)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench(model, prompt: torch.Tensor, new_tokens: int, rounds: int) -> dict:
    timed_generate(model, prompt, 2, True)  # warm-up: first-call allocations and kernel selection
    timed_generate(model, prompt, 2, False)
    times = {True: [], False: []}
    same = True  # every round's pair (only the last round's was compared)
    for _ in range(rounds):
        outs = {}
        for use_cache in (True, False):
            seconds, outs[use_cache] = timed_generate(model, prompt, new_tokens, use_cache)
            times[use_cache].append(seconds)
        same = same and torch.equal(outs[True], outs[False])
    tokens = prompt.size(0) * new_tokens
    cached, uncached = (tokens / statistics.median(times[c]) for c in (True, False))
    return {"cached_tokens_per_s": round(cached, 1), "uncached_tokens_per_s": round(uncached, 1),
            "speedup": round(cached / uncached, 2), "same_tokens": same}


def main(argv: list[str] | None = None) -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=comma_list(choices=SHAPES), default=["nano", "small"],
                    help="model shapes, comma-separated (conf/model/*.yaml)")
    ap.add_argument("--new-tokens", type=positive_int, nargs="+", default=[200, 500], help="tokens to generate")
    ap.add_argument("--prompt-len", type=positive_int, default=16, help="prompt tokens")
    ap.add_argument("--batch", type=positive_int, default=1, help="prompts sampled together")
    ap.add_argument("--block-size", type=positive_int, default=None, help="model.block_size (default: the shape's)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="alternated rounds; the median is reported")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (CPU)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to sample")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes:
        model = build_model(shape, args.block_size, device)
        if args.prompt_len > model.config.block_size:
            ap.error(f"--prompt-len {args.prompt_len} exceeds the block_size {model.config.block_size} of {shape}")
        prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                               generator=torch.Generator().manual_seed(1)).to(device)
        for n in args.new_tokens:
            row = {"shape": shape, "block_size": model.config.block_size, "new_tokens": n,
                   **bench(model, prompt, n, args.rounds)}
            print(f"{shape:6s} {n:5d} new tokens: cached {row['cached_tokens_per_s']:8.1f} tok/s, uncached "
                  f"{row['uncached_tokens_per_s']:8.1f} tok/s, speedup {row['speedup']:5.2f}x, "
                  f"same tokens: {row['same_tokens']}", flush=True)
            rows.append(row)
    print(json.dumps({"rows": rows, "device": str(device), "threads": args.threads, "prompt_len": args.prompt_len,
                      "batch": args.batch}))


if __name__ == "__main__":
    main()
