"""Compressed DDP on a slow simulated link: bytes/step, ms/step, speed-up and loss of every variant side by side.

Two gloo ranks run inside a private network namespace whose loopback is rate-limited with ``tc``
(``tbf rate 1gbit burst 512kb latency 100ms``, then ``100mbit``); they talk over 127.0.0.1 only. Both
links carry all traffic of both ranks (loopback is one shared queue), as one half-duplex link would.

Every variant trains its own copy of the same ``small`` Llama (conf/model/small.yaml, ~9.2M params,
same init) on the same batches (``LMDataModule.batch_for_step``: stdlib corpus, per-rank batch
``--batch-size`` x ``--block-size`` tokens) for the same ``--steps`` steps with the same AdamW + cosine
schedule + clipping. The variants advance round-robin in chunks of ``--chunk`` steps (in a rotating
order), so background load from other processes hits all of them alike. The native ``ddp`` baseline
is Lightning/torch's plain DDP (no hook; bytes = the fp32 gradient buckets it all-reduces); every
other variant runs through ``CommSession``, the same hook and local-update code the
``CompressedDDPStrategy`` uses, and its bytes are those handed to ``torch.distributed``.

Phase 1 (first ``--rates`` entry, default 1 Gbit/s): full training, ms/step over all steps but each
variant's first two, final train loss (mean of the last ``--chunk`` steps, both ranks) and val loss
(fixed held-out windows, after a final synchronisation of local-update variants). Phase 2 (other
rates): ``--slow-steps`` more steps per variant for timing only (losses do not depend on the link);
local-update variants time a whole number of their periods.

    python scripts/bench_comm.py                       # ~15 min on 2 busy cores
    python scripts/bench_comm.py --steps 16 --slow-steps 8 --variants ddp,int8,powersgd   # quick look
    python scripts/bench_comm.py --no-netns            # unshaped loopback (smoke test; timings meaningless)

The last line is one JSON object keyed by variant: ``bytes_ratio`` (ddp bytes / variant bytes),
``speedup`` (ddp ms / variant ms at the first rate), ``val_loss_delta_pct``, plus ``speedup_<rate>``,
``ms_per_step_<rate>``, ``bytes_per_step``, ``final_train_loss``, ``final_val_loss``, and
``comm_ms_per_step`` (first rate: wall time with a collective of the variant in flight, from
``comm/time_ms``; none for native ``ddp``, whose collectives we do not see: ``fp32_hook`` stands in).
The reference ``no_comm`` never synchronizes while it trains (local SGD with an endless period, averaged once
at the end): its ms/step is the compute floor of a step here, and its speed-up the ceiling for every codec.
Plots: ``<out>/comm_loss_curves.png``, ``<out>/comm_tradeoff.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lit_dtrain.config_resolvers import default_cache_dir
from lit_dtrain.utils.args import (
    ScriptArgumentParser,
    comma_list,
    fail,
    positive_float,
    positive_int,
    read_json_file,
    seed_int,
    window_int,
)
from lit_dtrain.utils.plots import OutputPathError, output_path
from lit_dtrain.utils.scripts import import_beside, rotated

import_beside(__file__)  # this script's module beside it, scripts/_bench_comm_report.py, also where a test loads it
from _bench_comm_report import REFERENCES, check_targets, plot, print_table, summarize  # noqa: E402, F401 - the report

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (compressor spec, local-update spec); "ddp" is native DDP without a hook
    "ddp": ("native", None),
    "fp32_hook": ("none", None),
    "fp16": ("fp16", None),
    "bf16": ("bf16", None),
    "int8": ({"name": "int8", "block_size": 256}, None),
    "int4": ({"name": "int4", "block_size": 256, "error_feedback": True}, None),
    "powersgd": ({"name": "powersgd", "matrix_approximation_rank": 4}, None),
    "topk": ({"name": "topk", "ratio": 0.01}, None),
    "topk_dynamic": ({"name": "topk", "ratio": 0.01, "initial_ratio": 0.1, "ratio_warmup_steps": 24}, None),
    "sign": ("sign", None),
    # int8 through a quantized reduce-scatter + all-gather (ZeRO++ qgZ): at 2 ranks it sends what int8 does
    "int8_rs": ({"name": "int8_rs", "block_size": 256}, None),
    "local_sgd": (None, {"name": "local_sgd", "sync_period": 8}),
    "local_sgd_adaptive": (None, {"name": "local_sgd_adaptive", "sync_period": 8, "divergence_threshold": 5e-3}),
    "diloco": (None, {"name": "diloco", "sync_period": 16}),
    # reference, not a method: the ranks never synchronize during training (averaged once at the end), so its
    # ms/step is the compute floor of a step in this set-up and its speed-up the ceiling of any codec's
    "no_comm": (None, {"name": "local_sgd", "sync_period": 1_000_000}),
}
DEFAULT_VARIANTS = "ddp,no_comm,fp32_hook,fp16,int8,powersgd,topk,topk_dynamic,sign,local_sgd,local_sgd_adaptive,diloco"
TBF = ["burst", "512kb", "latency", "100ms"]


def tc_rate(text: str) -> str:
    """An ``argparse`` type: a ``tc`` rate (``1gbit``, ``100mbit``, ``500kbps``); a typo used to fail in ``tc`` inside
    the network namespace, as a CalledProcessError traceback."""
    number = re.fullmatch(r"(\d+(?:\.\d+)?)[kmgt]?(?:bit|bps)", text, flags=re.IGNORECASE)
    if not number or not float(number.group(1)) > 0:
        raise argparse.ArgumentTypeError("expected a positive tc rate such as 1gbit, 100mbit or 500kbps")
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = ScriptArgumentParser(description=__doc__.split("\n\n")[0], epilog="Needs root (or --no-netns).",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=comma_list(choices=tuple(VARIANTS)), default=DEFAULT_VARIANTS,
                   help=f"comma list from {sorted(VARIANTS)}")
    p.add_argument("--rates", type=comma_list(tc_rate), default="1gbit,100mbit",
                   help="tc rates; the first one trains, the others time")
    p.add_argument("--steps", type=positive_int, default=48, help="training steps per variant at the first rate")
    p.add_argument("--slow-steps", type=positive_int, default=8, help="timed steps per variant at the other rates")
    p.add_argument("--chunk", type=positive_int, default=8, help="steps a variant runs before the next one's turn")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank per step")
    p.add_argument("--block-size", type=window_int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=positive_float, default=3e-3,
                   help="peak AdamW learning rate (cosine, warmup --chunk)")
    p.add_argument("--val-windows", type=positive_int, default=64, help="held-out windows for the val loss")
    p.add_argument("--seed", type=seed_int, default=1337, help="seed of the data order and the weights")
    p.add_argument("--out", default="outputs/bench_comm",
                   help="directory for the PNG plots (relative: under the current directory; the docs' figures: "
                        "--out docs/img)")
    p.add_argument("--cache-dir", default=default_cache_dir(),
                   help="token cache (default: LIT_DTRAIN_CACHE, else ~/.cache/lit_dtrain)")
    p.add_argument("--no-netns", action="store_true", help="plain loopback, no rate limit (smoke test only)")
    p.add_argument("--save-results", help="also write the raw per-step results (JSON) here")
    p.add_argument("--replot", help="skip the run: report and plot a --save-results file")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_result-file", help=argparse.SUPPRESS)
    p.add_argument("--_shaped", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variant_list = args.variants
    if "ddp" not in args.variant_list:
        p.error("the ddp baseline is needed for the ratios; keep it in --variants")
    if args.steps < 3:  # the ms/step leaves out each variant's first two steps: 2 gave a ZeroDivisionError
        p.error(f"--steps must be >= 3 (each variant's first two steps are not timed), got {args.steps}")
    if not 1 <= args.chunk < args.steps:  # the chunk is also the LR warm-up, which must end before the last step
        p.error(f"--chunk must be in [1, --steps) = [1, {args.steps}), got {args.chunk}; e.g. --steps 4 --chunk 2")
    args.rate_list = args.rates
    if args._worker:
        return args
    if args.replot:
        args.replot_results = read_results(args.replot, p)
    try:  # before the run: a --save-results that cannot be written failed after it, losing the results
        if args.save_results:
            args.save_results = str(output_path(args.save_results, "--save-results"))
        output_path(Path(args.out) / "comm_loss_curves.png", "--out")
    except OutputPathError as e:
        p.error(str(e))
    return args


def read_results(path: str, parser: argparse.ArgumentParser) -> dict:
    """The ``--save-results`` file that ``--replot`` reads; a missing, garbage or foreign file is named (it was a
    FileNotFoundError, JSONDecodeError or KeyError traceback)."""
    try:
        results = read_json_file(path, "--replot", "--save-results")
    except ValueError as e:
        parser.error(str(e))
    keys = ("dense_bytes", "params", "rates", "variants")
    if not isinstance(results, dict) or any(k not in results for k in keys) or "ddp" not in results["variants"]:
        parser.error(f"--replot {path!r} is not a --save-results file of this script (expected the keys {list(keys)} "
                     "and a 'ddp' variant)")
    return results


# ----------------------------------------------------------------------------------------------------------
# worker: one process per rank, inside the namespace
# ----------------------------------------------------------------------------------------------------------
def _set_rate(rate: str) -> None:
    subprocess.run(["tc", "qdisc", "change", "dev", "lo", "root", "tbf", "rate", rate, *TBF], check=True)


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from torch.nn.parallel import DistributedDataParallel

    from lit_dtrain.data import LMDataModule
    from lit_dtrain.module import param_groups
    from lit_dtrain.schedules.lr import cosine_lr_factor
    from lit_dtrain.strategies import CommSession, Communicator, build_compressor, build_local_update

    torch.set_num_threads(1)
    world = 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dm = LMDataModule(block_size=args.block_size, batch_size=args.batch_size, seed=args.seed,
                      max_val_windows=args.val_windows, val_batch_size=16, cache_dir=args.cache_dir, progress=False)
    if rank == 0:
        dm.prepare_data()
    dist.barrier()
    dm.setup()
    val_batches = list(dm.val_dataloader()[0])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        model_cfg = compose(config_name="train", overrides=["model=small", f"model.block_size={args.block_size}"]).model

    variants = {}
    for name in args.variant_list:
        torch.manual_seed(args.seed)
        model = instantiate(model_cfg)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        compressor, local_update = VARIANTS[name]
        session = None
        if compressor != "native":
            session = CommSession(build_compressor(compressor), build_local_update(local_update))
            session.attach(ddp, Communicator())
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
        variants[name] = {"model": model, "ddp": ddp, "session": session, "opt": opt, "step": 0,
                          "times": [], "bytes": [], "losses": [], "val": [], "periods": [],
                          "divergence": []}
    dense_bytes = sum(p.numel() * p.element_size() for p in variants["ddp"]["model"].parameters() if p.requires_grad)

    def val_loss(model) -> float:
        model.eval()
        with torch.no_grad():
            total = sum(F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten()).item()
                        for b in val_batches)
        model.train()
        return total / len(val_batches)

    def train_step(v: dict, record: list) -> None:
        step = v["step"]
        factor = cosine_lr_factor(min(step, args.steps - 1), total_steps=args.steps, warmup_steps=args.chunk)
        for group in v["opt"].param_groups:
            group["lr"] = args.lr * factor
        batch = dm.batch_for_step(step, rank, world)
        named = CommSession.named_params(v["model"]) if v["session"] is not None else None
        start = time.perf_counter()
        if named is not None:
            v["session"].before_optimizer_step(named)
        loss = F.cross_entropy(v["ddp"](batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(v["model"].parameters(), 1.0)
        v["opt"].step()
        v["opt"].zero_grad(set_to_none=True)
        sent = dense_bytes if named is None else int(v["session"].after_optimizer_step(named)["comm/bytes_per_step"])
        record.append((time.perf_counter() - start, sent, loss.item()))
        v["step"] += 1

    n_params = sum(p.numel() for p in variants["ddp"]["model"].parameters())
    results: dict = {"dense_bytes": dense_bytes, "params": n_params, "rates": args.rate_list, "variants": {}}
    names = list(variants)
    # phase 1: train every variant round-robin at the first rate
    for chunk_index, chunk_start in enumerate(range(0, args.steps, args.chunk)):
        for name in rotated(names, chunk_index):
            v = variants[name]
            dist.barrier()
            record: list = []
            for _ in range(min(args.chunk, args.steps - chunk_start)):
                train_step(v, record)
            v["times"] += [r[0] for r in record]
            v["bytes"] += [r[1] for r in record]
            v["losses"] += [r[2] for r in record]
            lu = v["session"].local_update if v["session"] is not None else None
            if lu is not None:
                v["periods"].append(lu.period)
                v["divergence"].append(getattr(lu, "last_divergence", None))
            v["val"].append((v["step"], val_loss(v["model"])))
        if rank == 0:
            print(f"[bench_comm] {args.rate_list[0]}: step {chunk_start + args.chunk}/{args.steps} done", flush=True)
    for name in names:
        v = variants[name]
        if v["session"] is not None:  # a local-update run that stopped between syncs synchronizes (counted)
            v["session"].final_sync(CommSession.named_params(v["model"]))
            v["total_bytes"] = v["session"].total_bytes
            v["comm_ms"] = v["session"].total_time_ms
        else:
            v["total_bytes"] = sum(v["bytes"])
        v["final_val"] = val_loss(v["model"])
    # phase 2: time the other rates
    slow_times: dict = {name: {} for name in names}
    for rate in args.rate_list[1:]:
        dist.barrier()
        if rank == 0 and args._shaped:
            _set_rate(rate)
        dist.barrier()
        # fp32_hook (the hook-overhead check) needs one rate; no_comm sends nothing
        for name in [n for n in names if n not in ("fp32_hook", "no_comm")]:
            v = variants[name]
            lu = v["session"].local_update if v["session"] is not None else None
            n = args.slow_steps if lu is None else lu.period * math.ceil(args.slow_steps / lu.period)
            if lu is not None and lu.steps_since_sync:  # start the window at a sync boundary
                v["session"].final_sync(CommSession.named_params(v["model"]))
            dist.barrier()
            record = []
            for _ in range(n):
                train_step(v, record)
            slow_times[name][rate] = {"ms_per_step": 1000 * sum(r[0] for r in record) / n, "steps": n,
                                      "bytes_per_step": sum(r[1] for r in record) / n}
            if rank == 0:
                print(f"[bench_comm] {rate}: {name} {slow_times[name][rate]['ms_per_step']:.0f} ms/step", flush=True)
    for name in names:
        v = variants[name]
        timed = v["times"][2:]
        results["variants"][name] = {
            "ms_per_step": {args.rate_list[0]: 1000 * sum(timed) / len(timed),
                            **{r: t["ms_per_step"] for r, t in slow_times[name].items()}},
            "bytes_per_step": v["total_bytes"] / len(v["bytes"]),
            "comm_ms_per_step": v["comm_ms"] / len(v["bytes"]) if "comm_ms" in v else None,
            "losses": v["losses"], "val": v["val"], "final_val_loss": v["final_val"], "periods": v["periods"],
            "divergence": v["divergence"],
            "slow": slow_times[name],
        }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {n: results["variants"][n]["losses"] for n in names})
    if rank == 0:
        for name in names:  # train loss: mean over both ranks
            results["variants"][name]["losses"] = [sum(x) / world for x in zip(*(g[name] for g in gathered))]
        Path(args._result_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args._shaped:
        _set_rate(args.rate_list[0])
    try:
        mp.spawn(_rank_main, args=(args, port), nprocs=2, join=True)
    except mp.ProcessRaisedException as e:  # the rank's traceback, and its last line for the parent's error line
        print(e, file=sys.stderr)
        last = next((line for line in reversed(str(e).splitlines()) if line.strip()), "no error text")
        Path(args._result_file + ".error").write_text(f"rank {e.error_index}: {last.strip()}")
        raise SystemExit(1) from None


# ----------------------------------------------------------------------------------------------------------
# parent: namespace, report, plots
# ----------------------------------------------------------------------------------------------------------
def run_in_namespace(args: argparse.Namespace, result_file: str, argv: list[str]) -> None:
    """Run the two ranks' worker with the flags ``main`` was given (``argv``: ``main(argv)``'s, else the command
    line's; the worker used to read ``sys.argv`` alone, so ``main([...])`` ran it with its caller's flags)."""
    forwarded = [a for a in argv if a != "--no-netns"]
    if "--save-results" in forwarded:  # the parent writes it
        i = forwarded.index("--save-results")
        del forwarded[i : i + 2]
    cmd = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--_worker", "--_result-file", result_file]
    if args.no_netns:
        check_worker(subprocess.run(cmd).returncode, result_file)
        return
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        fail("the network namespace needs root and iproute2 (ip, tc); use --no-netns for a smoke test")
    ns = f"lt_bench_comm_{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                        args.rate_list[0], *TBF], check=True)
        status = subprocess.run(["ip", "netns", "exec", ns, *cmd, "--_shaped"]).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    check_worker(status, result_file)


def check_worker(status: int, result_file: str) -> None:
    """End the script on a failed worker: one line naming the rank's error, and the JSON error line. It was a
    ``CalledProcessError`` traceback after the ranks' (a ``--cache-dir`` that cannot be written: 63 lines, no JSON)."""
    if status != 0:
        error = Path(result_file + ".error")
        fail(error.read_text() if error.exists() else f"the two ranks' worker ended with status {status}", code=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._worker:
        worker(args)
        return
    t0 = time.time()
    if args.replot:
        results = args.replot_results
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result_file = str(Path(tmp) / "results.json")
            run_in_namespace(args, result_file, sys.argv[1:] if argv is None else list(argv))
            results = json.loads(Path(result_file).read_text())
        if args.save_results:
            Path(args.save_results).write_text(json.dumps(results))
    summary = summarize(results, args)
    print_table(summary, results)
    plots = plot(results, summary, Path(args.out))
    targets = check_targets(summary)
    link = "UNSHAPED loopback" if args.no_netns else "tc tbf " + "/".join(results["rates"])
    print(f"\nwall {time.time() - t0:.0f}s; link {link}; plots: {', '.join(plots)}")
    print("targets at", results["rates"][0] + ":", json.dumps(targets))
    print(json.dumps({**summary, "_targets": targets}))


if __name__ == "__main__":
    main()
