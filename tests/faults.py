"""Fault-injection callbacks for the reliability tests (used through Hydra: +callbacks.fault._target_=...)."""

from __future__ import annotations

import os
import signal as signal_module
import time
from pathlib import Path

import lightning as L


class KillAtStep(L.Callback):
    """Send ``signal`` to this process when the batch after ``step`` completed steps starts; with ``group``, to its
    whole process group, as a terminal sends Ctrl-C's SIGINT (every rank Lightning's launcher started)."""

    def __init__(self, step: int, signal: str = "SIGKILL", rank: int | None = None, group: bool = False) -> None:
        self.step, self.signal, self.rank, self.group = int(step), signal, rank, bool(group)
        self.fired = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.fired or trainer.global_step != self.step:
            return
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        self.fired = True
        if self.group:
            os.killpg(os.getpgrp(), getattr(signal_module, self.signal))
        else:
            os.kill(os.getpid(), getattr(signal_module, self.signal))


class SignalInValidation(L.Callback):
    """Send ``signal`` to this process at the first batch of the validation at ``step`` completed steps that
    ``stage`` runs: ``fit`` (a validation inside fit, e.g. the last one) or ``validate`` (``train()``'s final
    ``trainer.validate``); on rank ``rank`` only, when given."""

    def __init__(self, step: int, stage: str = "validate", signal: str = "SIGTERM", rank: int | None = None) -> None:
        self.step, self.stage, self.signal, self.rank = int(step), stage, signal, rank
        self.fired = False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.fired or trainer.sanity_checking or trainer.global_step != self.step or trainer.state.fn != self.stage:
            return
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        self.fired = True
        os.kill(os.getpid(), getattr(signal_module, self.signal))


class SignalAfterFit(L.Callback):
    """Send ``signal`` to this process in ``on_fit_end``, which Lightning calls after it has put back the signal
    handlers from before ``fit``: the window between ``fit`` and ``train()``'s final validation, in which the final
    ``last.ckpt`` is written; on rank ``rank`` only, when given."""

    def __init__(self, signal: str = "SIGTERM", rank: int | None = None) -> None:
        self.signal, self.rank = signal, rank

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal_module, self.signal))


def _at_the_samples_first_forward(trainer, pl_module, action) -> None:
    """Call ``action()`` at the first forward of the model after ``train()``'s final validation (from its
    ``on_validation_end``): in the end-of-run text sample, which only rank 0 draws."""
    if trainer.state.fn != "validate":
        return
    model = getattr(pl_module.model, "_orig_mod", pl_module.model)

    def hook(module, args):
        handle.remove()
        action()

    # the embedding: Llama.generate runs its modules, not its own forward
    handle = model.tok_embeddings.register_forward_pre_hook(hook)


class SignalInSample(L.Callback):
    """Send ``signal`` to this process at the first forward of the model after ``train()``'s final validation: in
    its end-of-run text sample, after the ranks last agreed on a signal (``sigterm_after_the_last_step``)."""

    def __init__(self, signal: str = "SIGTERM") -> None:
        self.signal = signal

    def on_validation_end(self, trainer, pl_module) -> None:
        signum = getattr(signal_module, self.signal)
        _at_the_samples_first_forward(trainer, pl_module, lambda: os.kill(os.getpid(), signum))


class SlowSample(L.Callback):
    """Sleep ``seconds`` at the first forward of the model after ``train()``'s final validation: rank 0's end-of-run
    sample (only it draws one) takes that long, while the other ranks wait for it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)

    def on_validation_end(self, trainer, pl_module) -> None:
        _at_the_samples_first_forward(trainer, pl_module, lambda: time.sleep(self.seconds))


class RaiseInSample(L.Callback):
    """Raise ``RuntimeError(message)`` in the end-of-run sample (rank 0's alone: a GPU out of memory there) of a
    multirun's job ``job``."""

    def __init__(self, job: int = 0, message: str = "out of memory in the sample") -> None:
        self.job, self.message = int(job), message

    def on_validation_end(self, trainer, pl_module) -> None:
        from hydra.core.hydra_config import HydraConfig

        def fail():
            raise RuntimeError(self.message)

        if HydraConfig.get().job.num == self.job:
            _at_the_samples_first_forward(trainer, pl_module, fail)


class PoisonLossAtStep(L.Callback):
    """Multiply the loss that ``training_step`` returns by ``value`` (NaN or Inf) in every micro-batch of the step
    after ``step`` completed steps (on rank ``rank`` only, when given).

    The module's ``training_step`` is wrapped for the fit, so every callback sees the poisoned loss, whatever its
    place in the list, as a bad batch would give it. (Multiplying in this callback's ``on_before_backward`` reached
    the callbacks listed before it only through the first micro-batch's tensor, where they kept that tensor, and not
    at all where they kept a copy, as ``LossSpikeMonitor`` does under ``16-mixed``.)
    """

    def __init__(self, step: int, value: float = float("nan"), rank: int | None = None) -> None:
        self.step, self.value, self.rank = int(step), float(value), rank
        self._module = None

    def setup(self, trainer, pl_module, stage) -> None:
        if stage != "fit" or self._module is not None:
            return
        original = pl_module.training_step

        def training_step(*args, **kwargs):
            out = original(*args, **kwargs)
            if trainer.global_step != self.step or (self.rank is not None and trainer.global_rank != self.rank):
                return out
            if isinstance(out, dict):
                return {**out, "loss": out["loss"] * self.value}
            return out * self.value

        pl_module.training_step = training_step  # an instance attribute: Lightning looks the hook up on the object
        self._module = pl_module

    def teardown(self, trainer, pl_module, stage) -> None:
        if self._module is not None:
            del self._module.training_step  # the class's method again
            self._module = None


class FillDiskAtStep(L.Callback):
    """Fill the filesystem holding ``path`` (a tmpfs in tests) when ``step`` steps have completed."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = int(step), Path(path)
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done or trainer.global_step != self.step:
            return
        self.done = True
        with open(self.path / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
            except OSError:
                pass


class HangAtStep(L.Callback):
    """Block rank ``rank`` for ``seconds`` when ``step`` steps have completed (a hung peer)."""

    def __init__(self, step: int, seconds: float, rank: int = 1) -> None:
        self.step, self.seconds, self.rank = int(step), float(seconds), int(rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            import time

            time.sleep(self.seconds)


class RaiseOnceAt(L.Callback):
    """Raise ``RuntimeError('interrupted at step N')`` from ``hook`` (``on_after_backward`` or
    ``on_before_optimizer_step``) the first time it runs at global step ``step``: a fit that fails mid-step, which
    the same Trainer can then be fitted again to continue."""

    def __init__(self, hook: str, step: int) -> None:
        if hook not in ("on_after_backward", "on_before_optimizer_step"):
            raise ValueError(f"RaiseOnceAt: unsupported hook {hook!r}")
        self.hook, self.step, self.raised = hook, int(step), False

    def _maybe_raise(self, hook: str, trainer) -> None:
        if hook == self.hook and trainer.global_step == self.step and not self.raised:
            self.raised = True
            raise RuntimeError(f"interrupted at step {self.step}")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._maybe_raise("on_after_backward", trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._maybe_raise("on_before_optimizer_step", trainer)


class PoisonGradAtStep(L.Callback):
    """Fill the gradient of the module's first parameter with ``value`` (NaN or Inf) in the step after ``step``
    completed steps, after its backward: a non-finite gradient under a finite loss (an overflow in backward)."""

    def __init__(self, step: int, value: float = float("nan")) -> None:
        self.step, self.value = int(step), float(value)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.fill_(self.value)


class SlowStart(L.Callback):
    """Delay rank ``rank``'s start by ``seconds`` before it connects to the other ranks (built with the config, before
    the Trainer; Lightning's launcher gives each child rank ``LOCAL_RANK``): a rank slow to import on a loaded node."""

    def __init__(self, seconds: float, rank: int = 1) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) == int(rank):
            import time

            time.sleep(float(seconds))


class HoldMemoryAtStep(L.Callback):
    """Hold ``mib`` MiB of written memory (every page touched) on every rank through optimizer step ``step``: a job
    whose peak RSS stands ``mib`` above the others'."""

    def __init__(self, step: int, mib: int) -> None:
        self.step, self.mib, self.block = int(step), int(mib), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.mib and self.block is None:
            import torch

            self.block = torch.ones(self.mib * 2**20 // 4)  # float32

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.block = None


class SignalInSetup(L.Callback):
    """Send ``signal`` to this process in the ``setup`` hook: before the fit loads the checkpoint, and before Lightning
    registers its SIGTERM handler (after that load)."""

    def __init__(self, signal: str = "SIGTERM", rank: int | None = None) -> None:
        self.signal, self.rank = signal, rank

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal_module, self.signal))


class RefuseAtLoad(L.Callback):
    """Raise ``ConfigError`` in ``on_load_checkpoint`` (while the fit restores the checkpoint, before its loops are
    restored) on rank ``rank`` only, when given; the other ranks sleep ``others_wait_s`` there first (a slow load)."""

    def __init__(self, rank: int | None = None, others_wait_s: float = 0.0) -> None:
        self.rank, self.others_wait_s = rank, float(others_wait_s)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        from lit_dtrain.errors import ConfigError

        if self.rank is None or trainer.global_rank == self.rank:
            raise ConfigError(f"refused at the load on rank {trainer.global_rank}")
        time.sleep(self.others_wait_s)
