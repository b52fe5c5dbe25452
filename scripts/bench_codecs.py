"""CPU cost of every gradient codec next to the compute of one training step: what no link speed can remove.

bench_comm.py measures whole steps over a slow link; this script isolates the two parts a faster link cannot
shrink, on the same model and batch (``model=small``, 9.18M params, per-rank batch ``--batch-size`` x
``--block-size`` tokens, AdamW) with one torch thread:

- ``floor``: forward + backward + AdamW of one step in one process (no DDP, no communication);
- per codec: ``Compressor.reduce`` of the model's whole gradient (one bucket, parameters in DDP's reversed
  order) in a one-rank gloo group, i.e. encoding, error feedback and decoding of one payload, with the
  collectives themselves trivial. (Gather codecs decode one payload per rank, so at W ranks they pay W
  decodes; this measures one.)

bench_comm.py runs its two ranks on two cores that share caches and memory bandwidth, so by default a second
process (``--peer``) trains the same model in a loop throughout, as the other rank would; ``--no-peer``
measures one process alone (lower: ~15-25% on our 2-core machine). Codecs and the step alternate round by
round; medians over ``--rounds``. With ``--ddp-ms`` (uncompressed
DDP's ms/step from bench_comm.py on the same machine) it also prints each codec's speed-up ceiling
``ddp_ms / (floor + codec)``: the best a codec can do when its own traffic costs nothing.

    python scripts/bench_codecs.py --ddp-ms 1020

The last line is one JSON object: ``floor_ms`` and, per codec, ``ms``, ``pct_of_floor`` and ``ceiling``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

import torch

from lit_dtrain.utils.args import ScriptArgumentParser, comma_list, positive_float, positive_int, window_int

ROOT = Path(__file__).resolve().parents[1]
CODECS = {
    "none": "none",
    "fp16": "fp16",
    "bf16": "bf16",
    "int8": {"name": "int8", "block_size": 256},
    "int4": {"name": "int4", "block_size": 256, "error_feedback": True},
    "powersgd": {"name": "powersgd", "matrix_approximation_rank": 4},
    "topk": {"name": "topk", "ratio": 0.01},
    "sign": "sign",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = ScriptArgumentParser(description=__doc__.split("\n\n")[0],
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", type=comma_list(choices=tuple(CODECS)), default=",".join(CODECS),
                   help=f"comma list from {list(CODECS)}")
    p.add_argument("--rounds", type=positive_int, default=7,
                   help="interleaved rounds (the first is dropped as warm-up)")
    p.add_argument("--batch-size", type=positive_int, default=4,
                   help="sequences per step (bench_comm.py's per-rank batch)")
    p.add_argument("--block-size", type=window_int, default=128, help="tokens per sequence")
    p.add_argument("--ddp-ms", type=positive_float, default=None,
                   help="uncompressed DDP ms/step, for the ceiling column")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                   help="run a second process training the same model meanwhile, as bench_comm.py's other rank")
    args = p.parse_args(argv)
    args.codec_list = args.codecs
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (the first round is warm-up)")
    return args


def _setup(args: argparse.Namespace):
    """``(model, optimizer, batch, train_step)``: bench_comm.py's model and per-rank batch, one torch thread."""
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model=small", f"model.block_size={args.block_size}"]).model
    torch.manual_seed(0)
    model = instantiate(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch_size, args.block_size + 1), generator=torch.Generator().manual_seed(0))

    def train_step() -> None:
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return model, opt, ids, train_step


def _peer(args: argparse.Namespace, stop, ready) -> None:
    """The other rank's load: train steps until told to stop."""
    *_, train_step = _setup(args)
    train_step()
    ready.set()
    while not stop.is_set():
        train_step()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist
    import torch.nn.functional as F

    from lit_dtrain.strategies import Communicator, build_compressor
    from lit_dtrain.strategies.compressors import segments_from_shapes

    peer_stop, peer = None, None
    if args.peer:
        ctx = mp.get_context("spawn")
        peer_stop, ready = ctx.Event(), ctx.Event()
        peer = ctx.Process(target=_peer, args=(args, peer_stop, ready), daemon=True)
        peer.start()
        if not ready.wait(timeout=300):
            raise RuntimeError("the peer process did not start training within 300 s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model, opt, ids, train_step = _setup(args)

    train_step()  # warm-up (allocates AdamW's state)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]  # DDP's bucket order
    segments = segments_from_shapes([(n, p.shape) for n, p in params])
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    grad = torch.cat([p.grad.reshape(-1) for _, p in params])  # a real gradient, not the zeroed buffers
    opt.zero_grad(set_to_none=False)
    if not grad.abs().sum() > 0:
        raise RuntimeError("the gradient is all zeros")
    comm = Communicator()
    codecs = {name: build_compressor(CODECS[name]) for name in args.codec_list}
    times: dict[str, list[float]] = {"floor": [], **{name: [] for name in codecs}}
    for r in range(args.rounds):
        t = time.perf_counter()
        train_step()
        times["floor"].append(time.perf_counter() - t)
        for name, codec in codecs.items():
            flat = grad.clone()
            t = time.perf_counter()
            codec.reduce(flat, segments, comm, r).wait()
            times[name].append(time.perf_counter() - t)
            if not torch.isfinite(flat).all():
                raise RuntimeError(f"{name}: non-finite output")
    dist.destroy_process_group()
    if peer is not None:
        peer_stop.set()
        peer.join(timeout=60)

    med = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    floor = med.pop("floor")
    print(f"model=small ({grad.numel() / 1e6:.2f}M params, {4 * grad.numel() / 1e6:.1f} MB fp32 gradient), "
          f"batch {args.batch_size}x{args.block_size}, 1 thread, median of {args.rounds - 1} rounds, "
          f"{'with' if args.peer else 'without'} a second process training meanwhile")
    print(f"step compute floor (fwd+bwd+AdamW, no communication): {floor:.1f} ms"
          + (f"; uncompressed DDP {args.ddp_ms:.0f} ms -> best possible speed-up {args.ddp_ms / floor:.2f}x"
             if args.ddp_ms else ""))
    print(f"{'codec':10s} {'ms/step':>8s} {'% of floor':>10s}" + (f" {'ceiling':>8s}" if args.ddp_ms else ""))
    result: dict = {"floor_ms": round(floor, 2), "params": grad.numel(), "peer": args.peer}
    for name, ms in med.items():
        entry = {"ms": round(ms, 2), "pct_of_floor": round(100 * ms / floor, 2)}
        if args.ddp_ms:
            entry["ceiling"] = round(args.ddp_ms / (floor + ms), 3)
        result[name] = entry
        ceiling = f" {entry['ceiling']:7.2f}x" if args.ddp_ms else ""
        print(f"{name:10s} {ms:8.1f} {entry['pct_of_floor']:9.1f}%{ceiling}")
    if args.ddp_ms:
        result["ddp_ms"] = args.ddp_ms
        result["ceiling_no_codec"] = round(args.ddp_ms / floor, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
