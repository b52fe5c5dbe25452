"""torch's intra-op thread count under several CPU ranks: real ``train.py`` runs with and without ``OMP_NUM_THREADS``.

lit_dtrain never sets torch's thread count itself. Lightning's launchers do, on every rank
(``lightning.fabric.utilities.distributed._set_num_threads_if_needed``, called by ``_SubprocessScriptLauncher.launch``
and ``_MultiProcessingLauncher``): where ``OMP_NUM_THREADS`` is unset, each rank takes ``max(1, cores // local
processes)`` threads (cores from ``os.sched_getaffinity``) and exports ``OMP_NUM_THREADS``. torchrun sets
``OMP_NUM_THREADS=1`` itself when it starts several processes per node. This script checks both the figure and the
threads each rank ends with, variants run round by round, in an order rotated by one each round (so background load
and a cold first run hit them alike):

- ``ddp_unset``: ``trainer=ddp_cpu``, ``OMP_NUM_THREADS`` unset (Lightning's choice);
- ``ddp_omp1``: the same with ``OMP_NUM_THREADS=1``;
- ``ddp_omp_all``: the same with ``OMP_NUM_THREADS=<cores>``, every rank on every core (what an unset
  variable would give without Lightning's launcher). Slow on a loaded machine: one 30-step run took 9 min on the
  2 shared cores, against ~1 min for the others (leave it out with ``--variants``);
- ``single_unset`` / ``single_omp1``: the single-process default (``trainer.max_steps`` only), without and with
  ``OMP_NUM_THREADS=1``.

Each run is ``python train.py <variant> trainer.max_steps=STEPS run_name=...`` in a fresh output dir; its training
tokens/s comes from its ``summary.json`` (measured from the first step, so imports and the corpus scan are not in
it), the process wall time from this script's clock. The threads each rank had at exit come from a
``sitecustomize`` probe put first on that run's ``PYTHONPATH``.

    python scripts/bench_threads.py --steps 30 --rounds 3

Last line: JSON with, per variant, median ``tokens_per_s``, ``wall_s`` and the ``threads`` per rank, the ratios of
those medians, and each round's ratio (``round_ratios``). Where both variants end with the same threads per rank (as
``ddp_unset`` and ``ddp_omp1`` do), the ratio is 1 up to the load: read it against the rounds' spread. Tokens/s is
wall-clock, and on a shared machine a DDP step waits for both ranks to be scheduled (2-core machine at load 12-15:
355-913 ms of wall per step for 72-86 ms of CPU).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lit_dtrain.utils.args import ScriptArgumentParser, comma_list, fail, positive_int
from lit_dtrain.utils.scripts import rotated

ROOT = Path(__file__).resolve().parents[1]
DDP = ["trainer=ddp_cpu", "model=nano", "data.block_size=64"]
VARIANTS = {  # name -> (train.py overrides, OMP_NUM_THREADS or None to unset it; "all" = every core)
    "ddp_unset": (DDP, None),
    "ddp_omp1": (DDP, "1"),
    "ddp_omp_all": (DDP, "all"),
    "single_unset": ([], None),
    "single_omp1": ([], "1"),
}
RATIOS = {  # name -> (numerator, denominator) of tokens/s
    "ddp_omp1_over_unset": ("ddp_omp1", "ddp_unset"),
    "ddp_unset_over_omp_all": ("ddp_unset", "ddp_omp_all"),
    "single_omp1_over_unset": ("single_omp1", "single_unset"),
}
PROBE = '''import atexit, json, os, sys
def _lit_dtrain_threads_probe():
    if "torch" in sys.modules:
        import torch
        rec = {"local_rank": int(os.environ.get("LOCAL_RANK", "0")), "threads": torch.get_num_threads(),
               "interop": torch.get_num_interop_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}
        with open(os.path.join(os.environ["BENCH_THREADS_PROBE"], f"{os.getpid()}.json"), "w") as f:
            json.dump(rec, f)
atexit.register(_lit_dtrain_threads_probe)
'''


def run_once(name: str, steps: int, work: Path, index: int, cores: int) -> dict:
    overrides, omp = VARIANTS[name]
    probe_out = work / f"probe-{name}-{index}"
    probe_out.mkdir()
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if omp is not None:
        env["OMP_NUM_THREADS"] = str(cores) if omp == "all" else omp
    env["PYTHONPATH"] = os.pathsep.join([str(work / "probe"), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["BENCH_THREADS_PROBE"] = str(probe_out)
    env["LIT_DTRAIN_OUTPUT"] = str(work / "out")
    run = f"{name}-{index}"
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"trainer.max_steps={steps}", f"run_name={run}",
           "trainer.enable_progress_bar=false"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:  # its output, then one line and the JSON error line (sys.exit's text had no JSON)
        print(proc.stderr[-2000:], file=sys.stderr)
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "no error text")
        fail(f"{name}: train.py failed (status {proc.returncode}): {last.strip()}", code=1)
    summary = json.loads((work / "out" / "runs" / run / "summary.json").read_text())
    ranks = sorted((json.loads(p.read_text()) for p in probe_out.glob("*.json")), key=lambda r: r["local_rank"])
    return {"tokens_per_s": summary["tokens_per_sec"], "wall_s": wall, "ranks": ranks}


def main() -> None:
    p = ScriptArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps per run")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds; each runs every variant once")
    p.add_argument("--variants", type=comma_list(choices=list(VARIANTS)), default=list(VARIANTS),
                   help="variants to run; round r starts at the r-th (rotated: no variant always runs first)")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="bench_threads-") as tmp:
        work = Path(tmp)
        (work / "probe").mkdir()
        (work / "probe" / "sitecustomize.py").write_text(PROBE)
        for r in range(args.rounds):
            for name in rotated(args.variants, r):
                res = run_once(name, args.steps, work, r, cores)
                results[name].append(res)
                threads = ",".join(str(x["threads"]) for x in res["ranks"])
                print(f"round {r + 1} {name:13s} {res['tokens_per_s']:8.0f} tokens/s  wall {res['wall_s']:6.1f} s  "
                      f"threads per rank {threads}", flush=True)
    out: dict = {"steps": args.steps, "rounds": args.rounds, "cores": cores, "load_avg_1m": os.getloadavg()[0]}
    for name, runs in results.items():
        out[name] = {"tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in runs), 1),
                     "wall_s": round(statistics.median(x["wall_s"] for x in runs), 1),
                     "threads": [x["threads"] for x in runs[-1]["ranks"]],
                     "interop": [x["interop"] for x in runs[-1]["ranks"]]}
    print(f"{'variant':13s} {'tokens/s':>9s} {'wall s':>7s}  threads per rank (interop)")
    for name in results:
        v = out[name]
        print(f"{name:13s} {v['tokens_per_s']:9.0f} {v['wall_s']:7.1f}  {v['threads']} ({v['interop']})")
    out["ratios"], out["round_ratios"] = {}, {}
    for ratio, (num, den) in RATIOS.items():
        if num in results and den in results:
            out["ratios"][ratio] = round(out[num]["tokens_per_s"] / out[den]["tokens_per_s"], 3)
            # each round's own pair too: the load drifts between rounds (one DDP variant read 1015 then 2674 tokens/s
            # with the same 81-86 ms of CPU per step), and the ratio of the medians alone hid that spread
            rounds = [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in zip(results[num], results[den])]
            out["round_ratios"][ratio] = rounds
            print(f"{ratio}: {out['ratios'][ratio]:.3f} (tokens/s; per round {', '.join(map(str, rounds))})")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
