#!/usr/bin/env python
"""The cost of the CRC-32 check before each checkpoint load, against the load itself.

For each checkpoint: ``torch.load(weights_only=True)`` of it whole, the ``mmap`` load that reads ``global_step``
(what a resume reads of a file before loading it), and ``lit_dtrain.checkpoint.verify_checkpoint`` (every zip
member read with ``zipfile``, which compares the CRC-32 torch.save recorded); each cold (the file's pages dropped
from the page cache with ``posix_fadvise(DONTNEED)`` first: on a VM the host may still cache them) and warm, in
alternated rounds; the time is the median round.

    python scripts/bench_checkpoint_crc.py outputs/runs/RUN/checkpoints/last.ckpt
    python scripts/bench_checkpoint_crc.py a.ckpt b.ckpt --rounds 7 --threads 1

Last line: JSON with one row per (checkpoint, cache): mb, members, load_s, mmap_step_s, verify_s,
verify_per_load (the ratio), and the threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lit_dtrain.utils.args import ScriptArgumentParser, fail, positive_int  # noqa: E402


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench(path: str, cold: bool, rounds: int) -> dict:
    from lit_dtrain import checkpoint

    def verify(p: str) -> None:
        checkpoint._intact.clear()  # each round reads it whole, as a new process's first load does
        checkpoint.verify_checkpoint(p)

    ways = {
        "load_s": lambda p: torch.load(p, map_location="cpu", weights_only=True),
        "mmap_step_s": lambda p: torch.load(p, map_location="cpu", weights_only=True, mmap=True)["global_step"],
        "verify_s": verify,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            drop_from_page_cache(path) if cold else way(path)
            t0 = time.perf_counter()
            way(path)
            times[name].append(time.perf_counter() - t0)
    row = {name: round(statistics.median(t), 4) for name, t in times.items()}
    with zipfile.ZipFile(path) as archive:
        members = len(archive.infolist())
    return {"checkpoint": path, "cache": "cold" if cold else "warm", "mb": round(os.path.getsize(path) / 1e6, 1),
            "members": members, **row, "verify_per_load": round(row["verify_s"] / row["load_s"], 2)}


def not_a_zip_reason(path: str) -> str | None:
    """Why ``path`` is no zip archive that the CRC check and this benchmark can time (None: it is one): missing, a
    directory, unreadable, not a torch checkpoint, or torch's legacy format. A missing file was called "not a torch
    checkpoint (a zip archive) or cannot be read"."""
    from lit_dtrain._checkpoint_files import foreign_reason
    from lit_dtrain.checkpoint import not_a_file_reason

    if not Path(path).is_file():
        return not_a_file_reason(Path(path))
    try:
        if os.path.getsize(path) == 0:  # foreign_reason's 'binary data starting ' with no bytes after it
            return "is empty (0 bytes)"
        if zipfile.is_zipfile(path):  # False for a file it cannot open, too: read below
            return None
        reason = foreign_reason(path)
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    return reason or "is in torch's legacy format (before 1.6), not a zip archive: it holds no CRC to check"


def main(argv: list[str] | None = None) -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="torch checkpoints (.ckpt written by train.py)")
    ap.add_argument("--rounds", type=positive_int, default=5, help="alternated rounds; the median is reported")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    from lit_dtrain.checkpoint import CheckpointError, verify_checkpoint

    for path in args.checkpoints:
        if (reason := not_a_zip_reason(path)) is not None:
            fail(f"checkpoint {path!r} {reason}")
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            fail(str(e))
    torch.set_num_threads(args.threads)
    rows = []
    for path in args.checkpoints:
        for cold in (True, False):
            row = bench(path, cold, args.rounds)
            print(f"{row['mb']:8.1f} MB {row['cache']}: load {row['load_s'] * 1e3:8.1f} ms, mmap global_step "
                  f"{row['mmap_step_s'] * 1e3:7.1f} ms, CRC check {row['verify_s'] * 1e3:8.1f} ms, "
                  f"{row['verify_per_load']:.2f} of the load  {path}", flush=True)
            rows.append(row)
    print(json.dumps({"rows": rows, "threads": args.threads}))


if __name__ == "__main__":
    main()
