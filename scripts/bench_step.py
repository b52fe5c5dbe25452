"""Lightning overhead: the default trainer against a minimal hand-written PyTorch loop.

Both train the same model (default ``nano`` shape) on the same batches (``LMDataModule.batch_for_step``)
with the same fused AdamW, LR schedule and gradient clipping, for K steps. The Lightning side uses the
default callbacks (ModelCheckpoint, LearningRateMonitor, progress bar, tokens/s) and the TensorBoard
logger, exactly as ``python train.py`` builds them. Rounds alternate (plain, lightning, plain, ...) so
that background load hits both alike; ms/step is the median over rounds of steady-state steps.

    python scripts/bench_step.py --steps 40 --rounds 3

Last line: JSON with lightning_ms_per_step, plain_ms_per_step, ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import open_dict

from lit_dtrain.module import LitLLM, param_groups
from lit_dtrain.train import build_callbacks

CONF = str(Path(__file__).resolve().parents[1] / "conf")


class StepTimer(L.Callback):
    """Wall-clock time at the end of every training batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.times.append(time.perf_counter())


def compose_default(out_dir: str, steps: int, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"trainer.max_steps={steps}", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = out_dir
        cfg.trainer.val_check_interval = 10**6  # no validation/checkpoints inside the timed window
        cfg.trainer.limit_val_batches = 0
        cfg.trainer.enable_model_summary = False
        if "total_steps" in cfg.scheduler:
            cfg.scheduler.total_steps = 1000  # the default run's horizon, independent of the timed K steps
    return cfg


def lightning_round(cfg, warmup: int) -> float:
    L.seed_everything(cfg.seed, verbose=False)
    dm = instantiate(cfg.data, _convert_="all")
    dm.progress = False
    module = LitLLM(instantiate(cfg.model), instantiate(cfg.optimizer), instantiate(cfg.scheduler))
    timer = StepTimer()
    trainer = instantiate(cfg.trainer, callbacks=[*build_callbacks(cfg), timer], logger=instantiate(cfg.logger))
    trainer.fit(module, datamodule=dm)
    t = timer.times
    return (t[-1] - t[warmup - 1]) / (len(t) - warmup) * 1000


def plain_round(cfg, warmup: int) -> float:
    L.seed_everything(cfg.seed, verbose=False)
    dm = instantiate(cfg.data, _convert_="all")
    dm.progress = False
    dm.prepare_data()
    dm.setup()
    model = instantiate(cfg.model)
    opt = instantiate(cfg.optimizer)(param_groups(model))
    sched = instantiate(cfg.scheduler)(opt)
    clip = cfg.trainer.gradient_clip_val
    times = []
    for step in range(cfg.trainer.max_steps):
        batch = dm.batch_for_step(step)
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()  # Lightning reads the loss every step for logging; so do we
        times.append(time.perf_counter())
    return (times[-1] - times[warmup - 1]) / (len(times) - warmup) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="steps per round")
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from timing")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each variant")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=small data.batch_size=8")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_default(tmp, args.steps, args.overrides)
        plain, light = [], []
        for r in range(args.rounds):
            plain.append(plain_round(cfg, args.warmup))
            light.append(lightning_round(cfg, args.warmup))
            print(f"round {r}: plain {plain[-1]:.1f} ms/step, lightning {light[-1]:.1f} ms/step")
    p, lt = statistics.median(plain), statistics.median(light)
    print(f"{'variant':<12}{'ms/step':>10}\n{'plain':<12}{p:>10.1f}\n{'lightning':<12}{lt:>10.1f}\nratio {lt / p:.3f}")
    print(json.dumps({"lightning_ms_per_step": round(lt, 2), "plain_ms_per_step": round(p, 2),
                      "ratio": round(lt / p, 4), "steps": args.steps, "rounds": args.rounds,
                      "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
