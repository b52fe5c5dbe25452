"""PowerSGD resumed at another ``matrix_approximation_rank``: its warm-start Qs no longer fit and restart from
random, which a warning names (key and both ranks)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy, DiLoCo


def _strategy(rule, rank: int) -> CompressedDDPStrategy:
    codec = {"name": "powersgd", "matrix_approximation_rank": rank}
    if rule is None:
        return CompressedDDPStrategy(compressor=codec)
    return CompressedDDPStrategy(local_update=DiLoCo(sync_period=2, compressor=codec))


def _codec(strategy: CompressedDDPStrategy):
    return strategy.compressor if strategy.local_update is None else strategy.local_update.compressor


@pytest.mark.filterwarnings("ignore:.*predates per-rank parameters")  # a state written without a module
@pytest.mark.parametrize("rule", [None, "diloco"])
@pytest.mark.parametrize("rank_saved", [True, False])  # False: a checkpoint from before the rank was saved
def test_a_resume_at_another_rank_says_that_the_warm_start_restarts(tmp_path, rule, rank_saved):
    """2 gloo ranks, ``model=nano``, PowerSGD rank 4 for 4 steps, resumed with ``matrix_approximation_rank=2``: exit 0
    and not a word, while all 36 warm-start Qs restarted from random. Now rank 0 warns, naming the key and both
    ranks; a resume at the same rank keeps the Qs and says nothing."""
    written, path = _strategy(rule, 4), tmp_path / "last.ckpt"
    _codec(written).q_memory = {"w": torch.randn(8, 4), "v": torch.randn(6, 4)}
    state = written.comm_state_dict()
    if not rank_saved:
        key = "compressor" if rule is None else "local_update"
        assert state["per_rank"][0][key].pop("matrix_approximation_rank") == 4
    torch.save({CHECKPOINT_KEY: state}, path)
    key = "strategy.compressor" if rule is None else "strategy.local_update.compressor"
    resumed = _strategy(rule, 2)
    with pytest.warns(UserWarning, match=rf"^{CHECKPOINT_KEY}: the checkpoint's PowerSGD warm-start Qs \(2 matrices\) "
                                         rf"are of rank 4 and this run's {key}.matrix_approximation_rank is 2: each Q "
                                         rf"restarts from random .* resume with {key}.matrix_approximation_rank=4$"):
        resumed.load_checkpoint(path)
    same = _strategy(rule, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", ".*predates per-rank parameters")
        same.load_checkpoint(path)
    assert torch.equal(_codec(same).q_memory["w"], _codec(written).q_memory["w"])
