"""Whether a finished ``train(cfg)`` diverged, for its summary: with ``module.check_finite=false`` (and no spike monitor
to stop it) a run whose loss went NaN trains on to ``max_steps`` as asked, but it exited 0 with ``val_loss`` null in
``summary.json`` and a summary line and ``checkpoint`` naming a ``last.ckpt`` that ``AtomicCheckpointIO`` never wrote
(the weights were NaN), as if it had finished well.

:class:`NonFiniteLossWatch` notes the first step whose training loss is not finite (on the device: no host sync per
step); :func:`report_divergence` adds ``diverged`` and ``first_nonfinite_step`` to the metrics, points
``checkpoint`` at the file that holds the newest finite state (null: none), and warns at the end.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import lightning as L
import torch

from lit_dtrain.checkpoint import nonfinite_tensors
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.train")  # train(cfg)'s logger


class NonFiniteLossWatch(L.Callback):
    """The first optimizer step (completed steps before it) whose training loss was NaN/inf, or None.

    It keeps each batch's loss (detached, on its device) and checks them ``fold_every`` at a time, a handful of tensor
    ops per fold and none per batch; :attr:`first_step` checks the rest. It checked each batch on its own, 6 small
    tensor ops and a host-to-device copy per batch (0.27 ms of host time of a ``model=nano data.block_size=64`` step
    on a loaded 2-core machine, ~20 us with everything in cache)."""

    def __init__(self, fold_every: int = 64) -> None:
        self.fold_every = fold_every
        self._first: torch.Tensor | None = None  # -1: none yet; on the loss's device
        self._step = 0
        self._losses: list[torch.Tensor] = []  # the batches' losses not checked yet, and their steps
        self._steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not torch.is_tensor(loss):  # a skipped step (training_step returned None)
            return
        loss = loss.detach()
        # one number per batch, non-finite exactly when some element is: NaN and inf survive abs().amax()
        self._losses.append(loss.reshape(()) if loss.numel() == 1 else loss.abs().amax())
        self._steps.append(self._step)
        if len(self._losses) >= self.fold_every:
            self._fold()

    def _fold(self) -> None:
        if not self._losses:
            return
        bad = ~torch.isfinite(torch.stack(self._losses))  # (stack promotes mixed float dtypes)
        device = bad.device
        steps = torch.tensor(self._steps, dtype=torch.long, device=device)
        first_here = steps[bad.to(torch.uint8).argmax()]  # the chunk's first bad batch (argmax: the first maximum)
        if self._first is None:
            self._first = torch.full((), -1, dtype=torch.long, device=device)
        self._first = torch.where((self._first < 0) & bad.any(), first_here, self._first)
        self._losses, self._steps = [], []

    @property
    def first_step(self) -> int | None:
        self._fold()
        first = -1 if self._first is None else int(self._first)
        return None if first < 0 else first


def report_divergence(metrics: dict, module: L.LightningModule, watch: NonFiniteLossWatch | None,
                      ckpt_dir: str | Path) -> None:
    """Add ``diverged`` (the final weights or the validation loss are not finite) and ``first_nonfinite_step`` (the
    first step whose training loss was not finite, also in a run a spike monitor kept finite) to ``metrics``; where
    the final weights are not finite (their ``last.ckpt`` was not written), set ``checkpoint`` to the newest finite
    checkpoint of ``ckpt_dir`` (None: none), and log a warning that the run diverged (rank 0)."""
    from lit_dtrain.checkpoint import checkpoint_global_step
    from lit_dtrain.resume import newest_step_checkpoint

    names = [name for name, _ in module.named_parameters()]
    bad_weights = nonfinite_tensors(dict(module.named_parameters()), names)
    first = watch.first_step if watch is not None else None
    val_loss = metrics.get("val_loss")
    diverged = bool(bad_weights) or not (isinstance(val_loss, float) and math.isfinite(val_loss))
    metrics["diverged"] = diverged
    metrics["first_nonfinite_step"] = first
    if not diverged:
        return
    kept = "the final checkpoint is"
    if bad_weights:
        newest = newest_step_checkpoint(Path(ckpt_dir)) if Path(ckpt_dir).is_dir() else None
        metrics["checkpoint"] = str(newest) if newest is not None else None
        kept = (f"no checkpoint holds them; the newest finite one is {newest} "
                f"(step {checkpoint_global_step(newest, verify=False)})"
                if newest is not None else "no checkpoint holds them, and there is no finite checkpoint")
        kept = f"the final weights are not finite (NaN/inf in {len(bad_weights)} parameter(s), the first " \
               f"{bad_weights[0]!r}): {kept}"
    else:
        kept = f"the final weights are finite, but val_loss is {val_loss}: {kept} {metrics.get('checkpoint')}"
    at = f" from step {first} on (its training loss was the first NaN/inf)" if first is not None else ""
    # a fact of the run: every rank reaches it (the weights are the same), rank 0 says it
    log_once(log, logging.WARNING, "the run DIVERGED%s: %s; summary.json says \"diverged\": true", at, kept)
