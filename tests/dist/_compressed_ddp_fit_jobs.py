"""The fits (and their modules and callbacks) that test_compressed_ddp_fits.py's module fixture ``fits`` runs in
one pair of launched rank processes; each writes what its test reads into its own directory. The GradScaler fits are
in _compressed_ddp_scaler_jobs.py."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.strategies import CompressedDDPStrategy
from tests.dist._compressed_ddp_helpers import WORLD, TinyModule, make_net, regression_batch

EPOCH_UPDATES = {"diloco": {"name": "diloco", "sync_period": 4}, "local_sgd": {"name": "local_sgd", "sync_period": 4}}


def _fit_by_epochs(tmp: Path, key: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=2, limit_train_batches=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key]),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True)],
    )
    trainer.fit(TinyModule(str(tmp), "epochs"))


class _StopAfterStep(L.Callback):
    """Ask the fit to stop after optimizer step ``step`` (as ``EarlyStopping`` or ``max_time`` do, after the step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _fit_stopped_after_a_step(tmp: Path, key: str) -> None:
    import warnings

    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=12, logger=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key]),
        callbacks=[_StopAfterStep(6), L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", save_last=True)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModule(str(tmp), "stopped"))
    said = [str(w.message) for w in caught if "the fit stopped at step" in str(w.message)]
    torch.save(said, tmp / f"warnings_rank{trainer.global_rank}.pt")


class UnevenModule(TinyModule):
    """TinyModule whose DataLoader (one's own: ``use_distributed_sampler=False``) holds 3 batches on rank 0, 4 on 1."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(3 + self.global_rank, 1)), batch_size=1)

    def _dump(self, when: str) -> None:  # a marker only: strategy=ddp has no comm state
        (Path(self.dump_dir) / f"{self.tag}_{when}_rank{self.global_rank}").touch()


def _fit_uneven(tmp: Path, key: str) -> None:
    from lit_dtrain.strategies import make_ddp  # strategy=ddp's

    strategy = (make_ddp(collective_timeout_s=20) if key == "ddp"
                else CompressedDDPStrategy(local_update=EPOCH_UPDATES[key], collective_timeout_s=20))
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, enable_checkpointing=False, strategy=strategy,
    )
    trainer.fit(UnevenModule(str(tmp), "uneven"))


class ValidatingModule(TinyModule):
    """TinyModule with a validation on a fixed per-rank batch; dumps the parameters at each validation."""

    def validation_step(self, batch, batch_idx):
        x, y = regression_batch(10_000, self.global_rank)
        self.log("val/loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1)

    def on_validation_start(self) -> None:  # Lightning calls it before the strategy's own on_validation_start
        if not self.trainer.sanity_checking:
            self._dump(f"valstart{self.trainer.global_step}")

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._dump(f"val{self.trainer.global_step}")
            if self.global_rank == 0:
                loss = self.trainer.callback_metrics["val/loss"]
                torch.save(loss, Path(self.dump_dir) / f"loss{self.trainer.global_step}.pt")


VALIDATION_RUNS = {  # key -> (local update, accumulate_grad_batches)
    "local_sgd": ({"name": "local_sgd", "sync_period": 4}, 1),
    "diloco": ({"name": "diloco", "sync_period": 4, "outer_lr": 0.5, "outer_momentum": 0.5}, 2),
}


def _fit_validating(tmp: Path, key: str) -> None:
    local_update, accumulate = VALIDATION_RUNS[key]
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=9, val_check_interval=5, limit_val_batches=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate, strategy=CompressedDDPStrategy(local_update=local_update),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", save_top_k=-1)],
    )
    trainer.fit(ValidatingModule(str(tmp), "val"))


def _fit_resumed_after_an_early_sync(tmp: Path, key: str) -> None:
    """Fits of :class:`ValidatingModule` (period 4) whose only validation is the one Lightning runs after a stop:
    ``straight`` to step 10; ``stopped`` after step 6 (2 steps after a sync; ``last.ckpt`` written after that
    validation) and ``resumed`` from it to 10; ``finished`` at ``max_steps=6`` (its last step syncs) and ``extended``
    from its ``last.ckpt`` to 10; ``unsynced`` at ``max_steps=6`` with ``sync_on_last_step=False`` (``on_train_end``
    syncs; ``trainer.save_checkpoint`` after the fit writes ``last.ckpt``) and ``extended_unsynced`` from it;
    ``at_period_end`` at ``max_steps=8`` (a sync the straight run makes too) and ``extended_at_period_end``."""
    runs = (("straight", 10, None, None), ("stopped", 10, 6, None), ("resumed", 10, None, "stopped"),
            ("finished", 6, None, None), ("extended", 10, None, "finished"), ("unsynced", 6, None, None),
            ("extended_unsynced", 10, None, "unsynced"), ("at_period_end", 8, None, None),
            ("extended_at_period_end", 10, None, "at_period_end"))
    for tag, max_steps, stop, resume in runs:
        callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / tag, save_last=tag != "unsynced")]
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, max_steps=max_steps, limit_val_batches=1, num_sanity_val_steps=0,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key], log_comm_metrics=False,
                                           sync_on_last_step=tag != "unsynced"),
            callbacks=callbacks + ([_StopAfterStep(stop)] if stop else []),
        )
        trainer.fit(ValidatingModule(str(tmp), tag), ckpt_path=str(tmp / resume / "last.ckpt") if resume else None)
        if tag == "unsynced":
            trainer.save_checkpoint(tmp / tag / "last.ckpt")


class _BranchModule(TinyModule):
    """TinyModule with a branch (``branch``) that every rank uses only at steps 0 and 3: at the other steps it is
    unused on all ranks, so under ``find_unused_parameters=True`` DDP leaves its ``.grad`` None. Records the
    branch's error-feedback residual after every step."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.branch = nn.Linear(16, 8)
        self.seen: list[tuple[int, bool, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(self.global_step, self.global_rank)
        out = self.net(x) + (self.branch(x) if self.global_step % 3 == 0 else 0)
        return F.mse_loss(out, y)

    def on_train_start(self) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        compressor = self.trainer.strategy.compressor
        residual = compressor.residuals["branch.weight"].clone()
        server = getattr(compressor, "server_residuals", {}).get("branch.weight")  # int8_rs: this rank's share
        if server is not None:
            residual = torch.cat([residual.view(-1), server])
        self.seen.append((self.global_step - 1, self.branch.weight.grad is None, residual))

    def on_train_end(self) -> None:
        torch.save(self.seen, Path(self.dump_dir) / f"branch_rank{self.global_rank}.pt")


UNUSED_CODECS = {
    "sign": "sign",
    "topk": "topk",
    "powersgd": {"name": "powersgd", "matrix_approximation_rank": 1},
    "int8_rs": {"name": "int8_rs", "error_feedback": True, "block_size": 64},
}


def _fit_with_a_branch(tmp: Path, key: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        strategy=CompressedDDPStrategy(compressor=UNUSED_CODECS[key], find_unused_parameters=True,
                                       log_comm_metrics=False),
    )
    trainer.fit(_BranchModule(str(tmp), "branch"))


class _BranchModuleZeroedInPlace(_BranchModule):
    """:class:`_BranchModule` whose optimizer zeroes gradients in place: DDP leaves an unused branch's grad zeros."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if batch_idx % 2 == 1:  # the second of a step's 2 micro-batches: after its optimizer step
            super().on_train_batch_end(outputs, batch, batch_idx)


def _fit_with_a_branch_zeroed_in_place(tmp: Path, key: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=2,
        strategy=CompressedDDPStrategy(compressor=UNUSED_CODECS[key], find_unused_parameters=True,
                                       log_comm_metrics=False),
    )
    trainer.fit(_BranchModuleZeroedInPlace(str(tmp), "branch"))


class _FrozenFirstLayer(TinyModule):
    """TinyModule whose first layer is frozen (before the fit), or is unfrozen / frozen at step ``toggle_at``."""

    def __init__(self, dump_dir: str, tag: str, frozen: bool, toggle_at: int | None = None) -> None:
        super().__init__(dump_dir, tag)
        self.net[0].requires_grad_(not frozen)
        self.toggle_at = toggle_at

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_step == self.toggle_at:
            self.net[0].requires_grad_(not self.net[0].weight.requires_grad)


def _fit_toggling(tmp: Path, key: str, tag: str, max_steps: int, checkpoint: bool = False, **module_kwargs) -> None:
    """A 2-rank fit of :class:`_FrozenFirstLayer` under ``EPOCH_UPDATES[key]`` (period 4), with
    ``find_unused_parameters`` (DDP refuses a layer frozen mid-fit without it); ``checkpoint``: at its last step,
    ``tmp/tag/step=N.ckpt``."""
    resume = module_kwargs.pop("ckpt_path", None)
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / tag, filename="{step}",
                                                     every_n_train_steps=max_steps)] if checkpoint else []
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=checkpoint, callbacks=callbacks,
                        strategy=CompressedDDPStrategy(local_update=EPOCH_UPDATES[key], log_comm_metrics=False,
                                                       find_unused_parameters=True))
    trainer.fit(_FrozenFirstLayer(str(tmp), tag, **module_kwargs), ckpt_path=resume)


def _fit_unfrozen_at_resume(tmp: Path, key: str) -> None:
    """4 steps with ``net.0`` frozen (checkpoint at step 4), then a resume to step 8 with it trainable; for local SGD
    also a straight 8 steps that unfreezes it at step 4 (DiLoCo refuses a change of what trains within a fit)."""
    _fit_toggling(tmp, key, "frozen", 4, checkpoint=True, frozen=True)
    _fit_toggling(tmp, key, "resumed", 8, frozen=False, ckpt_path=str(tmp / "frozen" / "step=4.ckpt"))
    if key == "local_sgd":
        _fit_toggling(tmp, key, "straight", 8, frozen=True, toggle_at=4)


def _fit_frozen_between_syncs(tmp: Path, key: str) -> None:
    """Local SGD (period 4): ``net.0`` frozen at step 2, between syncs, in a straight 8-step fit; and in a resume from
    a step-2 checkpoint with ``net.0`` frozen from the start."""
    _fit_toggling(tmp, key, "straight", 8, frozen=False, toggle_at=2)
    _fit_toggling(tmp, key, "first", 2, checkpoint=True, frozen=False)
    _fit_toggling(tmp, key, "resumed", 8, frozen=True, ckpt_path=str(tmp / "first" / "step=2.ckpt"))


class _TwoOptimizers(TinyModule):
    """Manual optimization, GAN-style: ``net.g`` stepped every batch, ``net.d`` every second batch, each step with
    ``toggle_optimizer`` (which switches ``requires_grad`` off on the other optimizer's parameters)."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.automatic_optimization = False
        self.net = nn.ModuleDict({"g": make_net(), "d": nn.Linear(8, 1)})
        self.d_residuals: list[torch.Tensor] = []

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.g.parameters(), lr=0.05), torch.optim.SGD(self.net.d.parameters(), lr=0.05)]

    def training_step(self, batch, batch_idx):
        x, y = regression_batch(batch_idx, self.global_rank)
        g, d = self.net.g, self.net.d
        losses = [lambda: F.mse_loss(g(x), y) + d(g(x)).mean(), lambda: (d(g(x).detach()) ** 2).mean()]
        for opt, loss in zip(self.optimizers()[: 1 + batch_idx % 2], losses):
            self.toggle_optimizer(opt)
            self.manual_backward(loss())
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # the discriminator's residual after each batch
        codec = self.trainer.strategy.compressor
        if codec is not None:
            self.d_residuals.append(codec.residuals["net.d.weight"].clone())

    def on_train_end(self) -> None:
        super().on_train_end()
        torch.save(self.d_residuals, Path(self.dump_dir) / f"d_residuals_rank{self.global_rank}.pt")


TOGGLE_RUNS = {**EPOCH_UPDATES, "int8_ef": {"name": "int8", "error_feedback": True, "block_size": 64}}


def _fit_two_optimizers(tmp: Path, key: str) -> None:
    """12 optimizer steps (8 batches) of :class:`_TwoOptimizers` under ``TOGGLE_RUNS[key]`` (period 4)."""
    comm = {"local_update" if key in EPOCH_UPDATES else "compressor": TOGGLE_RUNS[key]}
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=12, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        strategy=CompressedDDPStrategy(**comm, log_comm_metrics=False, find_unused_parameters=True))
    trainer.fit(_TwoOptimizers(str(tmp), "gan"))
