"""The GradScaler fits (16-mixed: the scale the codec is told, a step skipped for one rank's overflow, manual
optimization) that test_compressed_ddp_fits.py's module fixture ``fits`` runs in one pair of launched rank processes;
each writes what its test reads into its own directory."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lit_dtrain.strategies import CompressedDDPStrategy
from tests.dist._compressed_ddp_helpers import WORLD, TinyModule, regression_batch


class _ScaleRecord(L.Callback):
    """Halves the GradScaler's scale after step 2 (as an overflow does) and records the scale the codec was told."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float | None]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        scaler = trainer.precision_plugin.scaler
        self.seen.append((float(scaler.get_scale()), trainer.strategy.compressor.grad_scale))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            trainer.precision_plugin.scaler.update(new_scale=512.0)
        if trainer.is_global_zero and trainer.global_step == trainer.max_steps:
            torch.save(self.seen, Path(pl_module.dump_dir) / "scales.pt")


def _fit_scale_record(tmp: Path, key: str) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[_ScaleRecord()],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy=CompressedDDPStrategy(compressor=key, log_comm_metrics=False),
    )
    trainer.fit(TinyModule(str(tmp), "scale"))


OVERFLOW_CODECS = {  # every codec with error feedback (and PowerSGD's warm start, int8_rs's server residuals)
    "fp16_ef": {"name": "fp16", "error_feedback": True},
    "int8_ef": {"name": "int8", "error_feedback": True, "block_size": 64},
    "int4": {"name": "int4", "block_size": 64},
    "topk": {"name": "topk", "ratio": 0.05},
    "sign": "sign",
    "powersgd": {"name": "powersgd", "matrix_approximation_rank": 1},
    "int8_rs_ef": {"name": "int8_rs", "error_feedback": True, "block_size": 64},
}
OVERFLOW_STEP = 2


class _OverflowModule(TinyModule):
    """TinyModule whose rank 1 alone puts an inf into one value of ``net.0.weight``'s gradient at ``OVERFLOW_STEP``
    (a tensor hook: it runs before DDP's bucket sees the gradient). Records after every step the compressor's state,
    the GradScaler's scale and the parameters. Its output is multiplied by ``gain`` outside autocast: every other
    gradient is an fp16 value under 16-mixed (CPU autocast runs these layers in fp16), on which the fp16 codec's
    residual stays 0."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.gain = nn.Parameter(torch.ones(8))
        self.seen: list[dict] = []

        def poison(grad):
            if self.global_rank == 1 and self.global_step == OVERFLOW_STEP:
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        self.net[0].weight.register_hook(poison)

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(self.global_step, self.global_rank)
        with torch.autocast("cpu", enabled=False):
            return F.mse_loss(self.net(x).float() * self.gain, y)

    def on_train_start(self) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        state = self.trainer.strategy.compressor.state_dict()
        self.seen.append(
            {
                "step": self.global_step,
                "scale": float(self.trainer.precision_plugin.scaler.get_scale()),
                "state": {k: state[k] for k in ("residuals", "server_residuals", "q_memory") if k in state},
                "params": {k: v.detach().clone() for k, v in self.state_dict().items()},
            }
        )

    def on_train_end(self) -> None:
        torch.save(self.seen, Path(self.dump_dir) / f"{self.tag}_rank{self.global_rank}.pt")


def _fit_overflow(tmp: Path, tag: str) -> None:
    """A 16-mixed fit (CPU GradScaler, several DDP buckets) through the codec ``OVERFLOW_CODECS[tag]``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    _fit_16_mixed(_OverflowModule(str(tmp), tag), str(tmp), OVERFLOW_CODECS[tag], scaler, OVERFLOW_STEP + 2,
                  bucket_cap_mb=0.004)


def _fit_16_mixed(module, root: str, spec, scaler, max_steps: int, **strategy_kwargs) -> None:
    """``module`` fitted on every rank under 16-mixed with ``scaler``, through the codec ``spec``."""
    from lightning.pytorch.plugins import MixedPrecision

    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy=CompressedDDPStrategy(
            compressor=spec, collective_timeout_s=60, log_comm_metrics=False, **strategy_kwargs
        ),
    )
    trainer.fit(module)


class _ManualOverflowModule(_OverflowModule):
    """:class:`_OverflowModule` under manual optimization: its backward, so the comm hook, runs before
    ``optimizer.step`` (and before the strategy's ``optimizer_step``). Records at every reduce the loss scale the codec
    was told and the GradScaler's scale the bucket holds."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.automatic_optimization = False
        self.told: list[tuple[int, float | None, float]] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()
        opt.zero_grad()

    def on_train_start(self) -> None:
        codec, scaler = self.trainer.strategy.compressor, self.trainer.precision_plugin.scaler
        reduce = codec.reduce

        def recording(flat, segments, comm, step):
            self.told.append((step, codec.grad_scale, float(scaler.get_scale())))
            return reduce(flat, segments, comm, step)

        codec.reduce = recording

    def on_train_end(self) -> None:
        torch.save(self.told, Path(self.dump_dir) / f"told_rank{self.global_rank}.pt")


def _fit_manual(tmp: Path, tag: str) -> None:
    """The overflow fit of top-k (several buckets) under manual optimization."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    module = _ManualOverflowModule(str(tmp), "manual")
    _fit_16_mixed(module, str(tmp), OVERFLOW_CODECS[tag], scaler, OVERFLOW_STEP + 2, bucket_cap_mb=0.004)


def _fit_init_scale(tmp: Path, tag: str) -> None:
    """One 16-mixed top-k fit of 2 steps, without overflow, under a GradScaler whose ``init_scale`` (1000.1) fp32
    does not hold: the scaler keeps it as fp32 1000.0999755859375 from the first step on."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.1)
    # (the module's overflow is at step 2: never reached)
    _fit_16_mixed(_OverflowModule(str(tmp), "init_scale"), str(tmp), OVERFLOW_CODECS[tag], scaler, 2)
