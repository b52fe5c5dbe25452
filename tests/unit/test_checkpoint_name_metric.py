"""The warning about a checkpoint name that shows another metric than the one ranked: not for val/ppl and val/loss,
which rank alike (val/ppl = exp(val/loss), strictly increasing)."""

from __future__ import annotations

from lit_dtrain.config_warnings import warn_if_a_checkpoint_name_shows_another_metric
from tests.unit._config_helpers import start_warnings


def test_val_ppl_and_val_loss_rank_alike_so_a_name_by_one_is_not_warned_about(tmp_path, caplog) -> None:
    warnings_for = start_warnings(warn_if_a_checkpoint_name_shows_another_metric, tmp_path, caplog)
    # the default filename shows val/loss; the best by val/ppl is the best by val/loss (this warned)
    assert warnings_for("callbacks.model_checkpoint.monitor=val/ppl") == []
    assert warnings_for("callbacks.model_checkpoint.filename='s{step}-p{val/ppl:.2f}'") == []  # ranked by val/loss
    # a metric that ranks otherwise is still named
    assert warnings_for("callbacks.model_checkpoint.monitor=val/ppl",
                        "callbacks.model_checkpoint.filename='s{step}-{train/loss:.3f}'") == [
        "callbacks.model_checkpoint ranks its checkpoints by monitor=val/ppl, but its filename "
        "'s{step}-{train/loss:.3f}' shows train/loss: the best file's name holds another metric's value; to name it by "
        "the ranked one: callbacks.model_checkpoint.filename='s{step}-{val/ppl:.3f}'"
    ]
