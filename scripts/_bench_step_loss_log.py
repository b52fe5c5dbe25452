"""``bench_step.py --loss-log``: the host cost of logging ``train/loss``, ``self.log`` at every step (as LitLLM did
up to commit 7af25c8) against :func:`lit_dtrain.module_metrics.log_every_step` (now), in the default Lightning run.

Both variants train the same steps (``bench_step.lightning_round``); rounds alternate the order (A B, B A, ...), so
background load hits both alike. Per variant and round: the main thread's CPU time (``time.thread_time``, which a
loaded machine's descheduling does not inflate) inside the ``train/loss`` call and over the whole step, and the
wall time of a step; medians over rounds, with the spread (min-max). Both variants must give bitwise the same step
losses and the same ``train/loss`` in ``trainer.callback_metrics`` at every step; the JSON says whether they did.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager

import lightning as L
import torch

import lit_dtrain.module as lit_module
from lit_dtrain.module_metrics import log_every_step


def _self_log(module: L.LightningModule, name: str, value: torch.Tensor, batch_size: int) -> None:
    module.log(name, value, on_step=True, prog_bar=True, batch_size=batch_size)  # LitLLM's call up to 7af25c8


VARIANTS = {"self.log": _self_log, "log_every_step": log_every_step}


@contextmanager
def timed_loss_log(variant: str, warmup: int):
    """LitLLM logs ``train/loss`` through ``variant`` while inside; yields the record: CPU ns of each call after the
    first ``warmup`` steps, and every step's ``train/loss`` as ``trainer.callback_metrics`` holds it after the call."""
    record = {"ns": [], "logged": []}
    log = VARIANTS[variant]

    def timed(module, name, value, batch_size):
        t0 = time.thread_time_ns()
        log(module, name, value, batch_size)
        spent = time.thread_time_ns() - t0
        if module.trainer.global_step >= warmup:
            record["ns"].append(spent)
        record["logged"].append(module.trainer.callback_metrics[name].clone())  # (outside the timed part)

    saved, lit_module.log_every_step = lit_module.log_every_step, timed
    try:
        yield record
    finally:
        lit_module.log_every_step = saved


def loss_log_rounds(bench, cfg, rounds: int, warmup: int, device: torch.device) -> dict:
    """Alternated rounds of both variants; prints a table and returns the JSON summary."""
    per = {v: {"log_us": [], "step_cpu_ms": [], "step_wall_ms": []} for v in VARIANTS}
    losses, logged = {}, {}
    for r in range(rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            timer = bench.StepTimer(device)
            with timed_loss_log(variant, warmup) as record:
                wall_ms, step_losses = bench.lightning_round(cfg, warmup, device, timer=timer)
            cpu = timer.cpu_times
            per[variant]["log_us"].append(sum(record["ns"]) / len(record["ns"]) / 1e3)
            per[variant]["step_cpu_ms"].append((cpu[-1] - cpu[warmup - 1]) / (len(cpu) - warmup) * 1e3)
            per[variant]["step_wall_ms"].append(wall_ms)
            losses.setdefault(variant, step_losses)
            logged.setdefault(variant, [float(x) for x in record["logged"]])
        print(f"round {r}: " + ", ".join(f"{v} {per[v]['log_us'][-1]:.0f} us/step in the call, "
                                         f"{per[v]['step_cpu_ms'][-1]:.1f} ms CPU/step" for v in order))
    old, new = (per[v] for v in VARIANTS)
    med = {v: {k: statistics.median(x) for k, x in per[v].items()} for v in VARIANTS}
    print(f"{'variant':<16}{'train/loss call (us CPU/step)':>32}{'step (ms CPU)':>16}{'step (ms wall)':>16}")
    for v in VARIANTS:
        spread = {k: f"{min(x):.4g}-{max(x):.4g}" for k, x in per[v].items()}
        print(f"{v:<16}{med[v]['log_us']:>20.1f} ({spread['log_us']}){med[v]['step_cpu_ms']:>9.2f} "
              f"({spread['step_cpu_ms']}){med[v]['step_wall_ms']:>9.1f} ({spread['step_wall_ms']})")
    identical = losses["self.log"] == losses["log_every_step"] and logged["self.log"] == logged["log_every_step"]
    ratio = statistics.median(new["log_us"]) / statistics.median(old["log_us"])
    saved_ms = (statistics.median(old["log_us"]) - statistics.median(new["log_us"])) / 1e3
    print(f"ratio (log_every_step / self.log) of the call's CPU time {ratio:.3f}: {saved_ms:.3f} ms CPU saved per "
          f"step, {saved_ms / med['self.log']['step_cpu_ms'] * 100:.2f} % of a step's CPU; losses and logged "
          f"train/loss {'bitwise identical' if identical else 'DIFFER'}")
    return {"mode": "loss_log", "self_log_us_per_step": round(med["self.log"]["log_us"], 1),
            "log_every_step_us_per_step": round(med["log_every_step"]["log_us"], 1), "ratio": round(ratio, 4),
            "ratio_is": "log_every_step/self.log CPU time of the call", "saved_ms_cpu_per_step": round(saved_ms, 3),
            "step_cpu_ms": {v: round(med[v]["step_cpu_ms"], 2) for v in VARIANTS},
            "step_wall_ms": {v: round(med[v]["step_wall_ms"], 2) for v in VARIANTS},
            "log_us_range": {v: [round(min(per[v]["log_us"]), 1), round(max(per[v]["log_us"]), 1)] for v in VARIANTS},
            "identical": identical, "rounds": rounds, "device": device.type, "torch_threads": torch.get_num_threads()}


def print_json(summary: dict) -> None:
    print(json.dumps(summary))
