"""Lightning overhead: the default trainer against a minimal hand-written PyTorch loop.

Both train the same model (default ``nano`` shape) on the same batches (``LMDataModule.batch_for_step``)
with the same AdamW (``lit_dtrain.module.build_optimizer``), LR schedule and gradient clipping, for K
steps. The Lightning side uses the default callbacks (ModelCheckpoint, LearningRateMonitor, progress bar,
tokens/s), the two that ``train()`` adds and that run at every step (``LogStepSync``, ``NonFiniteLossWatch``) and the
TensorBoard logger, as ``python train.py`` builds them. Each round runs both, in an order rotated by one
(plain then lightning, lightning then plain, ...: ``lit_dtrain.utils.scripts.rotated``), so that neither always runs
first (the process's first fit) and background load hits both alike; ms/step is the median over rounds of
steady-state steps.

The device and precision come from the composed config (``trainer.accelerator``, ``trainer.precision``):
``trainer=gpu`` runs both sides on one CUDA device under bf16-mixed, the plain loop with the model and
batches on cuda, ``torch.autocast`` for forward and loss as Lightning's ``MixedPrecision`` plugin does, and
fp32 parameters. On cuda each step's clock is read after ``torch.cuda.synchronize()``, on both sides. Both sides are
one process: a config of several (``trainer.devices``, ``trainer.num_nodes``; ``experiment=compression_sweep``'s
``trainer=ddp_cpu``) is refused; ``scripts/bench_comm.py`` times DDP and its compression presets on 2 ranks.

    python scripts/bench_step.py --steps 40 --rounds 3
    python scripts/bench_step.py trainer=gpu model=small data.batch_size=64
    python scripts/bench_step.py --loss-log --steps 40 --rounds 4 --threads 1   # train/loss: self.log vs now
    python scripts/bench_step.py --hooks --steps 200 --rounds 3 --threads 1 data.block_size=64 data.batch_size=2

Last line: JSON with lightning_ms_per_step, plain_ms_per_step, ratio (lightning_ms_per_step / plain_ms_per_step, as
its key ratio_is says: above 1, Lightning is slower), lightning_tokens_per_s, plain_tokens_per_s, device, and the
main thread's CPU time per step of each side (``time.thread_time``, which a loaded machine's descheduling does not
inflate: ``lightning_cpu_ms_per_step - plain_cpu_ms_per_step`` is the host time the trainer adds). With ``--hooks``
no plain loop: the CPU time of every hook of the Lightning side per step (scripts/_bench_step_hooks.py). With
``--loss-log`` no plain loop: two Lightning variants that log ``train/loss`` through ``self.log`` at every step and
through ``log_every_step`` (scripts/_bench_step_loss_log.py; its JSON line has the CPU time of the call and of a step
for each, their ratio, and whether results were identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import ListConfig, OmegaConf, open_dict

from lit_dtrain._compose_errors import unknown_key_message
from lit_dtrain.config_keys import check_types
from lit_dtrain.config_resolvers import UNRESOLVED
from lit_dtrain.divergence import NonFiniteLossWatch
from lit_dtrain.errors import interpolation_error, unset_env_var
from lit_dtrain.module import LitLLM, build_optimizer
from lit_dtrain.train import build_callbacks
from lit_dtrain.train_callbacks import LogStepSync
from lit_dtrain.utils.args import ScriptArgumentParser, nonnegative_int, positive_int
from lit_dtrain.utils.scripts import rotated

CONF = str(Path(__file__).resolve().parents[1] / "conf")
RATIO_IS = "lightning/plain ms per step"  # the printed ratio and the JSON's said neither which side was over which


class StepTimer(L.Callback):
    """Wall-clock time at the end of every optimizer step (after ``torch.cuda.synchronize()`` on cuda), and each
    step's loss (the mean over its micro-batches). Refuses a run on another device than the plain loop's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the main thread's CPU time (time.thread_time) at the same moments
        self._losses: list[torch.Tensor] = []  # detached; read after fit, so recording them adds no sync
        self._step_loss: torch.Tensor | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type != self.device.type or trainer.world_size != 1:
            raise RuntimeError(f"Lightning trains on {pl_module.device} with {trainer.world_size} process(es), the "
                               f"plain loop on one {self.device}: set trainer.accelerator and trainer.devices=1")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs["loss"].detach()  # Lightning has divided it by accumulate_grad_batches
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # not the last micro-batch of an optimizer step
        self._losses.append(self._step_loss)
        self._step_loss = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.thread_time())

    @property
    def losses(self) -> list[float]:
        return [float(loss) for loss in self._losses]


def bench_device(cfg) -> torch.device:
    """The device Lightning picks for ``cfg.trainer.accelerator`` with one device (cuda before cpu for auto)."""
    accelerator = str(cfg.trainer.accelerator)
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if accelerator in ("gpu", "cuda", "auto"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"trainer.accelerator={accelerator}, but torch {torch.__version__} sees no CUDA device; "
                               "run it on a GPU machine, or without trainer=gpu")
        return torch.device("cuda", 0)
    raise ValueError(f"bench_step runs on trainer.accelerator cpu, gpu, cuda or auto, got {accelerator!r}")


def one_process(cfg, device: torch.device) -> None:
    """Refuse a config that trains on several processes (``trainer.devices``, ``trainer.num_nodes``): the plain loop
    is one process, and Lightning's side would re-launch this script per rank and fail inside ``fit`` on every rank
    (``experiment=compression_sweep`` sets ``trainer=ddp_cpu``)."""
    devices, nodes = cfg.trainer.devices, cfg.trainer.get("num_nodes", 1) or 1
    if str(devices) == "auto":
        count = torch.cuda.device_count() if device.type == "cuda" else 1  # Lightning's "auto": every GPU, one CPU
    elif isinstance(devices, (list, tuple, ListConfig)):
        count = len(devices)
    else:
        count = int(devices) if str(devices).lstrip("-").isdigit() else 0
        count = torch.cuda.device_count() if count == -1 and device.type == "cuda" else count
    if count != 1 or int(nodes) != 1:
        raise ValueError(f"both sides are timed in one process, and trainer.devices={devices} with "
                         f"trainer.num_nodes={nodes} is not one process: add trainer.devices=1 trainer.num_nodes=1, or "
                         "time DDP and its compression presets on 2 ranks with scripts/bench_comm.py")


def autocast_dtype(cfg) -> torch.dtype | None:
    """The autocast dtype of ``cfg.trainer.precision`` (None: fp32 without autocast)."""
    precision = str(cfg.trainer.precision)
    if precision in ("32-true", "32"):
        return None
    if precision in ("bf16-mixed", "bf16"):
        return torch.bfloat16
    raise ValueError(f"bench_step's plain loop mirrors trainer.precision 32-true or bf16-mixed, got {precision!r} "
                     "(16-mixed would need a GradScaler, *-true half-precision weights)")


def tokens_per_step(cfg) -> int:
    return int(cfg.data.batch_size) * int(cfg.data.block_size) * int(cfg.trainer.accumulate_grad_batches or 1)


READ_KEYS = ("trainer", "data", "model", "optimizer", "scheduler", "logger", "callbacks")  # not init_from: an
# experiment's ${lit.required:...} there (cpt_replay's) is nothing the bench reads


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


def lightning_round(cfg, warmup: int, device: torch.device, timer: StepTimer | None = None,
                    profiler=None) -> tuple[float, list[float]]:
    """One Lightning run: (ms per steady-state step, loss of every step); ``timer``: a StepTimer of the caller's;
    ``profiler``: a Lightning profiler for the Trainer."""
    L.seed_everything(cfg.seed, verbose=False)
    dm = instantiate(cfg.data, _convert_="all")
    dm.progress = False
    module = LitLLM(instantiate(cfg.model), instantiate(cfg.optimizer), instantiate(cfg.scheduler))
    timer = timer if timer is not None else StepTimer(device)
    callbacks = [LogStepSync(), *build_callbacks(cfg), NonFiniteLossWatch(), timer]  # train()'s per-step ones too
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=instantiate(cfg.logger), profiler=profiler)
    trainer.fit(module, datamodule=dm)
    t, cpu = timer.times, timer.cpu_times
    timer.cpu_ms = (cpu[-1] - cpu[warmup - 1]) / (len(cpu) - warmup) * 1000
    return (t[-1] - t[warmup - 1]) / (len(t) - warmup) * 1000, timer.losses


def plain_round(cfg, warmup: int, device: torch.device, cpu_ms: list | None = None) -> tuple[float, list[float]]:
    """The same training in a plain loop: (ms per steady-state step, loss of every step); appends the main thread's
    CPU ms per steady-state step to ``cpu_ms``."""
    L.seed_everything(cfg.seed, verbose=False)
    dm = instantiate(cfg.data, _convert_="all")
    dm.progress = False
    dm.prepare_data()
    dm.setup()
    model = instantiate(cfg.model).to(device)  # initialized on cpu, as LitLLM's model, then moved
    dtype = autocast_dtype(cfg)
    precision = "bf16-mixed" if dtype is torch.bfloat16 else "32-true"
    clip = cfg.trainer.gradient_clip_val
    opt = build_optimizer(instantiate(cfg.optimizer), model, clip, precision)  # LitLLM's choice of fused/foreach
    params = [p for group in opt.param_groups for p in group["params"]]  # the order Lightning clips them in
    sched = instantiate(cfg.scheduler)(opt)
    accumulate = int(cfg.trainer.accumulate_grad_batches or 1)
    # bf16-mixed as Lightning's MixedPrecision.autocast_context_manager: forward and loss, no weight-cast cache
    autocast = partial(torch.autocast, device.type, dtype=dtype, cache_enabled=False) if dtype else nullcontext
    times, cpu, losses = [], [], []
    for step in range(cfg.trainer.max_steps):
        step_loss = 0.0
        for micro in range(accumulate):
            batch = dm.batch_for_step(step * accumulate + micro)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # as Lightning's batch transfer
            with autocast():
                logits = model(batch["input_ids"])
                # LitLLM's loss: per-token fp32 cross-entropy, then the mean (bitwise the same as Lightning's)
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none").mean()
            loss = loss / accumulate  # as Lightning's automatic optimization
            loss.backward()
            step_loss = step_loss + loss.detach()
            loss.item()  # Lightning reads the loss every batch for logging; so do we
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter())
        cpu.append(time.thread_time())
        losses.append(step_loss)
    if cpu_ms is not None:
        cpu_ms.append((cpu[-1] - cpu[warmup - 1]) / (len(cpu) - warmup) * 1000)
    return (times[-1] - times[warmup - 1]) / (len(times) - warmup) * 1000, [float(x) for x in losses]


def main() -> None:
    ap = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=positive_int, default=40, help="steps per round")
    ap.add_argument("--warmup", type=positive_int, default=5, help="steps excluded from timing (>= 1, < --steps)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds of each variant")
    ap.add_argument("--threads", type=nonnegative_int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--loss-log", action="store_true", help="compare train/loss via self.log with log_every_step")
    ap.add_argument("--hooks", action="store_true", help="CPU time of every hook of the Lightning side per step")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=small data.batch_size=8")
    args = ap.parse_args()
    if args.warmup >= args.steps:  # the timing spans steps warmup..steps-1: none left (a StatisticsError at the end)
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        try:  # a bad override, a GPU config without CUDA, a precision the plain loop lacks: one line, not a traceback
            cfg = compose_default(tmp, args.steps, args.overrides)
            device = bench_device(cfg)
            one_process(cfg, device)
            autocast_dtype(cfg)  # refuse an unsupported precision before any run
            check_types(cfg)  # train.py's line for data.batch_size=abc (was a constructor's ValueError traceback)
            for key in READ_KEYS:  # '${nope}', '${oc.evn:X}': a traceback in instantiate, inside the first round
                OmegaConf.to_container(cfg[key], resolve=True) if key in cfg else None
        except UNRESOLVED as e:
            ap.error(str(interpolation_error(e)))
        except (HydraException, ValueError, RuntimeError) as e:
            if (unset := unset_env_var(e)) is not None:  # ${oc.env:X} unset: train.py's line, not OmegaConf's
                ap.error(str(unset))
            hydras = str(e).partition("\nConfig search path")[0]  # Hydra's message without its search path
            ap.error(unknown_key_message(e, CONF) or " ".join(hydras.split()))
        torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))  # as train() sets it
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"device {device} ({name}), precision {cfg.trainer.precision}, {tokens_per_step(cfg)} tokens/step")
        if args.loss_log:
            from _bench_step_loss_log import loss_log_rounds, print_json

            print_json(loss_log_rounds(sys.modules[__name__], cfg, args.rounds, args.warmup, device))
            return
        if args.hooks:
            from _bench_step_hooks import hook_rounds
            from _bench_step_hooks import print_json as print_hooks_json

            print_hooks_json(hook_rounds(sys.modules[__name__], cfg, args.rounds, args.warmup, device))
            return
        plain, light, plain_cpu, light_cpu = [], [], [], []
        for r in range(args.rounds):
            # plain ran first in every round, so it alone paid the process's first fit (the token cache, cold code)
            for side in rotated(["plain", "lightning"], r):
                if side == "plain":
                    plain.append(plain_round(cfg, args.warmup, device, plain_cpu)[0])
                else:
                    timer = StepTimer(device)
                    light.append(lightning_round(cfg, args.warmup, device, timer=timer)[0])
                    light_cpu.append(timer.cpu_ms)
            print(f"round {r}: plain {plain[-1]:.1f} ms/step ({plain_cpu[-1]:.2f} CPU), lightning {light[-1]:.1f} "
                  f"ms/step ({light_cpu[-1]:.2f} CPU)")
    p, lt = statistics.median(plain), statistics.median(light)
    pc, lc = statistics.median(plain_cpu), statistics.median(light_cpu)
    tokens = tokens_per_step(cfg)
    p_tps, lt_tps = tokens / (p / 1000), tokens / (lt / 1000)
    print(f"{'variant':<12}{'ms/step':>10}{'tokens/s':>12}{'CPU ms/step':>14}")
    print(f"{'plain':<12}{p:>10.1f}{p_tps:>12.0f}{pc:>14.2f}\n{'lightning':<12}{lt:>10.1f}{lt_tps:>12.0f}{lc:>14.2f}")
    print(f"ratio {RATIO_IS} {lt / p:.3f} (above 1: Lightning is slower); host CPU the trainer adds: {lc - pc:.2f} ms "
          "per step")
    print(json.dumps({"lightning_ms_per_step": round(lt, 2), "plain_ms_per_step": round(p, 2),
                      "ratio": round(lt / p, 4), "ratio_is": RATIO_IS, "lightning_tokens_per_s": round(lt_tps),
                      "plain_tokens_per_s": round(p_tps), "device": device.type,
                      "precision": str(cfg.trainer.precision),
                      "lightning_cpu_ms_per_step": round(lc, 3), "plain_cpu_ms_per_step": round(pc, 3),
                      "steps": args.steps, "rounds": args.rounds, "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
