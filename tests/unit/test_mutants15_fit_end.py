"""``lit_dtrain.strategies.fit_end`` where the fourteenth hand mutation audit left holes (fifteenth audit): an epoch
whose ``training_step`` takes Lightning's ``dataloader_iter``, where the fetcher's ``is_last_batch`` is not known yet
during the step; the sanity check of a fit run again between syncs; and a ``trainer.validate`` (no DDP wrap, no
communicator) of a checkpoint written between syncs. The last two are real one-process fits under DiLoCo, whose sync
changes the parameters even on one rank (its outer step)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from lit_dtrain.strategies import CompressedDDPStrategy
from tests.unit.test_mutants13_fit_end import Model, Predict


class IterModel(Model):
    """``Model`` whose ``training_step`` fetches its own batch from ``dataloader_iter``."""

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return super().training_step(batch, 0)


def test_the_last_step_of_an_epoch_fetched_in_the_step_is_predicted():
    """With ``dataloader_iter`` Lightning sets ``is_last_batch`` only after the step (``_DataLoaderIterDataFetcher``):
    during the 4th and last optimizer step of a one-epoch fit it is still False, and the epoch's end is its count of
    ready batches (``current.ready == num_training_batches``, Lightning's own ``_num_ready_batches_reached``); on
    ``is_last_batch`` alone the fit's last step was not known, and ``sync_on_last_step`` never synced before its
    checkpoints."""
    predict = Predict()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[predict], max_epochs=1, limit_val_batches=0)
    trainer.fit(IterModel(4))
    assert trainer.global_step == 4
    assert predict.last == predict.forced_last == [4]


class _Interrupted(Exception):
    pass


class _InterruptAt6(L.Callback):
    """Raise once after optimizer step 6 (two steps after DiLoCo's sync at 4, period 4); records, at the start and the
    end of each sanity check, the global step, the rule's ``(steps_since_sync, num_syncs)`` and the parameters."""

    def __init__(self) -> None:
        self.raised, self.sanity = False, []

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 6 and not self.raised:
            self.raised = True
            raise _Interrupted

    def _seen(self, trainer, pl_module) -> None:
        lu = trainer.strategy.local_update
        self.sanity.append((trainer.global_step, lu.steps_since_sync, lu.num_syncs,
                            torch.cat([p.detach().flatten() for p in pl_module.parameters()])))

    on_sanity_check_start = on_sanity_check_end = _seen


class _Logged(BoringModel):
    """BoringModel logging ``val/loss`` on a fixed validation set (BoringModel's is drawn anew by each loader)."""

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 32, generator=torch.Generator().manual_seed(0))), batch_size=2)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.step(batch[0]))


def _diloco(sync_first: bool = True) -> CompressedDDPStrategy:
    return CompressedDDPStrategy(local_update={"name": "diloco", "sync_period": 4}, log_comm_metrics=False,
                                 sync_before_validation=sync_first)


def _interrupted_fit(sync_first: bool) -> tuple[L.Trainer, BoringModel, _InterruptAt6]:
    """A fit to step 10 (a validation every 4 steps, right after each sync) interrupted after step 6."""
    seen = _InterruptAt6()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, val_check_interval=4, limit_val_batches=1,
                        num_sanity_val_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, strategy=_diloco(sync_first), callbacks=[seen])
    model = _Logged()
    with pytest.raises(_Interrupted):
        trainer.fit(model)
    return trainer, model, seen


@pytest.mark.parametrize("sync_first", [True, False])
def test_the_sanity_check_of_a_fit_run_again_between_syncs_neither_syncs_nor_warns(sync_first, recwarn):
    """A fit interrupted after step 6 (2 steps after a sync) and run again on the same Trainer (a notebook's second
    ``trainer.fit``) sanity-checks at step 6 with the ranks between syncs: that validation is no validation of the fit,
    so it neither syncs (DiLoCo's outer step would move the parameters, and the fit would go on from the mean) nor
    warns that it validates between syncs. (A resume by ``ckpt_path`` restores the same state, but Lightning skips the
    sanity check of a restarting fit.) Mutated to sync there: (2, 1) became (0, 2) over the sanity check and the
    parameters moved; to warn: 'validating at step 6, 2 steps after the last diloco sync'."""
    trainer, model, seen = _interrupted_fit(sync_first)
    trainer.fit(model)
    (*counts_before, before), (*counts_after, after) = seen.sanity[-2:]  # the second fit's sanity check
    assert counts_before == counts_after == [6, 2, 1]
    assert torch.equal(before, after)
    assert not [w for w in recwarn if "validating at step" in str(w.message)]
    assert (trainer.global_step, trainer.strategy.local_update.num_syncs) == (10, 3)  # synced at 4, 8 and the end


def test_a_validation_without_a_communicator_does_not_sync(tmp_path):
    """``trainer.validate(ckpt_path=...)`` of a checkpoint written 2 steps after a sync: the strategy loads the
    local-update state but Lightning wraps no DDP outside a fit, so there is no communicator to sync over: the
    validation evaluates the parameters as saved (the plain strategy's ``val/loss`` on the same file) and the rule's
    state stays as restored. Mutated to sync anyway, ``final_sync`` failed on the missing communicator."""
    trainer, _, _ = _interrupted_fit(sync_first=True)
    trainer.save_checkpoint(tmp_path / "between.ckpt")
    validating = L.Trainer(accelerator="cpu", devices=1, limit_val_batches=1, logger=False, enable_progress_bar=False,
                           enable_model_summary=False, strategy=_diloco())
    (got,) = validating.validate(_Logged(), ckpt_path=tmp_path / "between.ckpt", verbose=False)
    plain = L.Trainer(accelerator="cpu", devices=1, limit_val_batches=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    (expected,) = plain.validate(_Logged(), ckpt_path=tmp_path / "between.ckpt", verbose=False)
    assert validating.strategy.session.comm is None
    assert (validating.strategy.local_update.steps_since_sync, validating.strategy.local_update.num_syncs) == (2, 1)
    assert got["val/loss"] == expected["val/loss"]
