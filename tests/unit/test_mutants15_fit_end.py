"""``lit_dtrain.strategies.fit_end`` where the fourteenth hand mutation audit left holes (fifteenth audit): an epoch
whose ``training_step`` takes Lightning's ``dataloader_iter``, where the fetcher's ``is_last_batch`` is not known yet
during the step; the sanity check of a fit resumed between syncs; and a ``trainer.validate`` (no DDP wrap, no
communicator) of a checkpoint written between syncs."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L

from lit_dtrain.strategies import LocalSGD
from lit_dtrain.strategies.fit_end import sync_or_warn_before_validation
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


def _between_syncs(comm, sanity_checking: bool, sync_first: bool) -> tuple[SimpleNamespace, list]:
    """A strategy 2 steps after a local SGD sync at step 6; ``final_sync`` records its calls."""
    rule, synced = LocalSGD(sync_period=4), []
    rule.steps_since_sync = 2
    trainer = SimpleNamespace(global_step=6, sanity_checking=sanity_checking, should_stop=False)
    session = SimpleNamespace(comm=comm, named_params=lambda module: [], final_sync=lambda named: synced.append(6))
    module = SimpleNamespace(trainer=trainer, _trainer=trainer)
    return SimpleNamespace(local_update=rule, lightning_module=module, session=session,
                           sync_before_validation=sync_first), synced


def test_the_sanity_check_of_a_fit_resumed_between_syncs_neither_syncs_nor_warns(recwarn):
    """Lightning restores the checkpoint (and the strategy's local-update state, 2 steps after a sync) before the
    sanity check: its validation is no validation of the fit, so it neither syncs (the resumed ranks would then go on
    from the mean, not from their own parameters as a fit that never stopped does) nor says that it validates between
    syncs; the fit's own validation there does."""
    strategy, synced = _between_syncs(object(), sanity_checking=True, sync_first=True)
    sync_or_warn_before_validation(strategy)
    strategy.sync_before_validation = False
    sync_or_warn_before_validation(strategy)
    assert synced == [] and len(recwarn) == 0
    strategy.lightning_module.trainer.sanity_checking = False
    sync_or_warn_before_validation(strategy)
    assert len(recwarn) == 1 and "validating at step 6, 2 steps after" in str(recwarn[0].message)
    strategy.sync_before_validation = True
    sync_or_warn_before_validation(strategy)
    assert synced == [6]


def test_a_validation_without_a_communicator_does_not_sync():
    """``trainer.validate(ckpt_path=...)`` of a checkpoint written between syncs: the strategy loads the local-update
    state (2 steps after a sync) but Lightning wraps no DDP outside a fit, so there is no communicator to sync over
    (``final_sync`` would fail on it): the validation goes on with this rank's parameters, as restored."""
    strategy, synced = _between_syncs(None, sanity_checking=False, sync_first=True)
    sync_or_warn_before_validation(strategy)
    assert synced == []
