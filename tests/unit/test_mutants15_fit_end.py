"""``lit_dtrain.strategies.fit_end`` where the fourteenth hand mutation audit left holes (fifteenth audit): an epoch
whose ``training_step`` takes Lightning's ``dataloader_iter``, where the fetcher's ``is_last_batch`` is not known yet
during the step."""

from __future__ import annotations

import lightning as L

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
