"""The 2-rank fits test_local_update_kept_state.py's module fixture runs in one pair of launched rank processes: the
state a local-update rule keeps from before a sync that a fit going on past that step never makes
(``_comm_state.kept_for_a_resume``), under manual optimization, a stop that ``min_steps`` overrides, a validation at
the fit's last step and a pseudo-gradient codec. Each fit writes its dumps into its own directory."""

from __future__ import annotations

import lightning as L
import torch.nn.functional as F

from lit_dtrain.strategies import CompressedDDPStrategy
from tests.dist._compressed_ddp_fit_jobs import EPOCH_UPDATES, ValidatingModule, _StopAfterStep
from tests.dist._compressed_ddp_helpers import WORLD, regression_batch


class ManualModule(ValidatingModule):
    """:class:`ValidatingModule` under manual optimization: one optimizer step per batch."""

    def __init__(self, dump_dir: str, tag: str) -> None:
        super().__init__(dump_dir, tag)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = regression_batch(self.global_step, self.global_rank)
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self.net(x), y))
        opt.step()


def _fits(tmp, local_update: dict, runs, module=ValidatingModule, **trainer_kwargs) -> None:
    """Each ``(tag, max_steps, stop, resume)`` of ``runs`` in turn: a fit of ``module`` under ``local_update`` to
    ``max_steps``, asked to stop after step ``stop`` (None: not), resumed from ``resume`` (a path under ``tmp``, or
    None), every checkpoint kept under ``tmp/tag`` (``{step}.ckpt`` after each validation, ``last.ckpt``)."""
    for tag, max_steps, stop, resume in runs:
        callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / tag, filename="{step}", save_top_k=-1,
                                                         save_last=True)]
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, max_steps=max_steps, limit_val_batches=1, num_sanity_val_steps=0,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            strategy=CompressedDDPStrategy(local_update=local_update, log_comm_metrics=False),
            callbacks=callbacks + ([_StopAfterStep(stop)] if stop else []), **trainer_kwargs,
        )
        trainer.fit(module(str(tmp), tag), ckpt_path=str(tmp / resume) if resume else None)


def _fit_manual(tmp, key: str) -> None:
    """Manual optimization: ``straight`` to 10; ``stopped`` after step 6 (Lightning's validation syncs) and
    ``resumed`` to 10; ``finished`` at 6 (its last batch syncs) and ``extended`` to 10."""
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 10, None, None), ("stopped", 10, 6, None),
                                    ("resumed", 10, None, "stopped/last.ckpt"), ("finished", 6, None, None),
                                    ("extended", 10, None, "finished/last.ckpt")), module=ManualModule)


def _fit_min_steps(tmp, key: str) -> None:
    """A validation every 5 batches: ``straight`` to 10; ``held`` asked to stop after step 2 under ``min_steps=7``
    (``min_epochs=0``: Lightning's implied 1 would hold the stop to the epoch's end), so it trains on (validating at 5
    as the straight run does) and stops after step 7 (Lightning validates then); ``from5`` and ``from7`` resume it to
    10 from its step-5 and step-7 checkpoints."""
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 10, None, None), ("held", 10, 2, None),
                                    ("from5", 10, None, "held/step=5.ckpt"), ("from7", 10, None, "held/last.ckpt")),
          val_check_interval=5, min_steps=7, min_epochs=0)


def _fit_validated_last_step(tmp, key: str) -> None:
    """A validation every 6 batches: ``straight`` to 10; ``finished`` at 6 (a validation follows its last step, as in
    the straight run) and ``extended`` to 10."""
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 10, None, None), ("finished", 6, None, None),
                     ("extended", 10, None, "finished/last.ckpt")), val_check_interval=6)


CODEC_DILOCO = {"name": "diloco", "sync_period": 4, "compressor": {"name": "int8", "error_feedback": True,
                                                                   "block_size": 64}}


def _fit_pseudo_gradient_codec(tmp, key: str) -> None:
    """DiLoCo whose pseudo-gradient goes through an error-feedback codec (rank-local residuals): ``straight`` to 10;
    ``stopped`` after step 6 and ``resumed`` to 10."""
    _fits(tmp, CODEC_DILOCO, (("straight", 10, None, None), ("stopped", 10, 6, None),
                              ("resumed", 10, None, "stopped/last.ckpt")))


def _fit_held_mid_accumulation(tmp, key: str) -> None:
    """Accumulation 2, a validation every 5 batches (after batch 5: mid-accumulation, step 2), period 4: ``straight``
    to 8; ``held`` asked to stop after step 1 under ``min_steps=6``, so it trains on; ``from_held2`` and
    ``from_straight2`` resume ``held`` and ``straight`` to 8 from the checkpoints written after their step-2
    validation."""
    _fits(tmp, EPOCH_UPDATES[key], (("straight", 8, None, None), ("held", 8, 1, None),
                                    ("from_held2", 8, None, "held/step=2.ckpt"),
                                    ("from_straight2", 8, None, "straight/step=2.ckpt")),
          accumulate_grad_batches=2, val_check_interval=5, min_steps=6, min_epochs=0)
