"""``bench_step.py --hooks``: where the host time of a default Lightning step goes, hook by hook.

A Lightning profiler (``Trainer(profiler=...)``) that reads the main thread's CPU time (``time.thread_time_ns``, which a
loaded machine's descheduling does not inflate) around every hook Lightning profiles: each callback's and the module's
hooks, the strategy's ``training_step`` and ``backward``, the optimizer step (which holds the closure: forward,
backward, the clip) and the whole batch (``run_training_batch``). Per round: each action's mean CPU time per optimizer
step over the steps after ``--warmup``; medians over rounds. Nested actions are each counted whole (the optimizer step
holds ``training_step`` and ``backward``), so the rows do not add up to the step.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import torch
from lightning.pytorch.profilers import Profiler

STEP = "run_training_batch"


class CPUTimeProfiler(Profiler):
    """Every profiled action's main-thread CPU time (ns), in call order per action."""

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[str, int] = {}
        self.durations: dict[str, list[int]] = defaultdict(list)

    def start(self, action_name: str) -> None:
        self._open[action_name] = time.thread_time_ns()

    def stop(self, action_name: str) -> None:
        now = time.thread_time_ns()
        start = self._open.pop(action_name, None)
        if start is not None:
            self.durations[action_name].append(now - start)

    def summary(self) -> str:
        return ""

    def per_step_us(self, warmup: int) -> dict[str, float]:
        """Mean CPU us per optimizer step after ``warmup`` steps, of every action that ran at least once a step."""
        steps = len(self.durations.get(STEP, ()))
        if steps <= warmup:
            return {}
        out = {}
        for name, spent in self.durations.items():
            calls_per_step = len(spent) / steps
            if calls_per_step < 1:  # (the bench validates nothing: no validation hook is left out)
                continue
            kept = spent[round(warmup * calls_per_step):]
            out[name] = sum(kept) / (steps - warmup) / 1e3
        return out


def _short(name: str) -> str:
    return name.split("{")[0] + name[name.index("}") + 1:] if "{" in name else name  # ModelCheckpoint{...}.hook


def hook_rounds(bench, cfg, rounds: int, warmup: int, device: torch.device, top: int = 25) -> dict:
    """``rounds`` Lightning rounds, each under a :class:`CPUTimeProfiler`; prints the table, returns the summary."""
    per_round: list[dict[str, float]] = []
    wall = []
    for r in range(rounds):
        profiler = CPUTimeProfiler()
        wall_ms, _ = bench.lightning_round(cfg, warmup, device, profiler=profiler)
        per_round.append(profiler.per_step_us(warmup))
        wall.append(wall_ms)
        print(f"round {r}: {per_round[-1].get(STEP, float('nan')) / 1e3:.2f} ms CPU per step, {wall_ms:.1f} ms wall")
    names = set.intersection(*(set(p) for p in per_round))
    med = {_short(n): statistics.median(p[n] for p in per_round) for n in names}
    rows = sorted(med.items(), key=lambda kv: -kv[1])[:top]
    print(f"{'us of CPU per step (median of rounds)':>40}  action")
    for name, us in rows:
        print(f"{us:>40.1f}  {name}")
    step_ms = med.get(STEP, float("nan")) / 1e3
    tokens = bench.tokens_per_step(cfg)
    print(f"a step: {step_ms:.2f} ms of CPU ({tokens / step_ms * 1e3:.0f} tokens per CPU second), "
          f"{statistics.median(wall):.1f} ms wall")
    return {"mode": "hooks", "step_cpu_ms": round(step_ms, 3), "step_wall_ms": round(statistics.median(wall), 2),
            "tokens_per_cpu_s": round(tokens / step_ms * 1e3), "hooks_us": {n: round(us, 1) for n, us in rows},
            "rounds": rounds, "device": device.type, "torch_threads": torch.get_num_threads()}


def print_json(summary: dict) -> None:
    print(json.dumps(summary))
