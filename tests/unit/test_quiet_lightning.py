import logging
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_dtrain.train import quiet_lightning_noise


def test_lightning_adverts_and_unactionable_warnings_are_silenced(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning_noise()
        quiet_lightning_noise()  # idempotent
        with caplog.at_level(logging.INFO):
            rank_zero_info("💡 Tip: For seamless cloud logging, try installing [litlogger]")
            rank_zero_info("GPU available: False, used: False")
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("It is recommended to use `self.log('val/ppl', ..., sync_dist=True)` ...", stacklevel=1)
        warnings.warn("It is recommended to use `self.log('train/x', ..., sync_dist=True)` ...", stacklevel=1)
        warnings.warn("Checkpoint directory /o/runs/r/checkpoints exists and is not empty.", stacklevel=1)  # resume
        warnings.warn("The dirpath has changed from '/o/runs/a/checkpoints' to '/o/runs/b/checkpoints', therefore "
                      "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` "
                      "won't be reloaded. Only `best_model_path` will be reloaded.", stacklevel=1)  # a decay branch
    assert "Tip" not in caplog.text and "GPU available" in caplog.text
    assert [str(w.message)[:45] for w in caught] == ["It is recommended to use `self.log('train/x',"]
    assert len(logging.getLogger("lightning.pytorch.utilities.rank_zero").filters) == 1
