"""PowerSGD resumed at another ``matrix_approximation_rank``: its warm-start Qs no longer fit and restart from
random, which a warning names (key and both ranks)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy, DiLoCo
from lit_dtrain.strategies.comm_checkpoint import warm_start_rank_notes
from lit_dtrain.strategies.compressors import Segment


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


def _fits_as_resumed(codec, name: str, shape: tuple, saved_q: torch.Tensor) -> bool:
    """Whether ``codec`` (the resumed one) warm-starts the matrix ``name`` of ``shape`` from ``saved_q``."""
    n = shape[0]
    (segment, _, m, rank), = codec.plan([Segment(name, 0, n * (math.prod(shape) // n), shape)])[0]
    return torch.equal(codec._initial_q(segment, m, rank, 0, torch.device("cpu")), saved_q)


@pytest.mark.filterwarnings("ignore:.*predates per-rank parameters")
def test_the_warning_counts_only_the_qs_that_restart(tmp_path):
    """With ``min_compression_rate < 1`` a matrix no wider than the rank is compressed too, and its Q, ``(m, min(n,
    m, rank))``, fits both ranks: rank 4 resumed with 2, the (2, 6) matrix's Q was kept while the warning said 'each
    Q restarts'. It counts the Qs that restart now, by the model's shapes where it has them."""
    shapes = {"w": (8, 8), "narrow": (2, 6)}
    codec = {"name": "powersgd", "matrix_approximation_rank": 4, "min_compression_rate": 0.5}
    written, path = CompressedDDPStrategy(compressor=codec), tmp_path / "last.ckpt"
    written.compressor.q_memory = {"w": torch.randn(8, 4), "narrow": torch.randn(6, 2)}
    torch.save({CHECKPOINT_KEY: written.comm_state_dict()}, path)
    resumed = CompressedDDPStrategy(compressor={**codec, "matrix_approximation_rank": 2})
    with pytest.warns(UserWarning, match=r"Qs \(2 matrices\) are of rank 4 and this run's strategy.compressor."
                                         r"matrix_approximation_rank is 2: 1 of them restart \(the other 1, of "
                                         r"matrices at most 2 wide, fit both ranks and are kept\) from random"):
        resumed.load_checkpoint(path)
    saved = written.compressor.q_memory
    assert [_fits_as_resumed(resumed.compressor, k, shapes[k], saved[k]) for k in ("w", "narrow")] == [False, True]
    # up from rank 2 to 4: a Q as wide as the old rank fits where the matrix is that wide, which its shape tells
    entry = {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2,
                            "q_memory": {"w": torch.randn(8, 2), "narrow": torch.randn(6, 2)}}}
    up = CompressedDDPStrategy(compressor={**codec, "matrix_approximation_rank": 4}).compressor
    note, = warm_start_rank_notes(entry, up, None, shapes)
    assert ": 1 of them restart (the other 1, of matrices at most 2 wide" in note
    # a matrix 3 wide restarts from 2 to 4 (its Q was (6, 2), rank 4 starts (6, 3)): 'at most 4 wide' named it kept
    qs = {**entry["compressor"]["q_memory"], "mid": torch.randn(6, 2)}
    mid = {"compressor": {**entry["compressor"], "q_memory": qs}}
    note, = warm_start_rank_notes(mid, up, None, {**shapes, "mid": (3, 6)})
    assert ": 2 of them restart (the other 1, of matrices at most 2 wide" in note
    up.q_memory = dict(entry["compressor"]["q_memory"])
    assert [_fits_as_resumed(up, k, shapes[k], up.q_memory[k]) for k in ("w", "narrow")] == [False, True]
    same_width = {"compressor": {**entry["compressor"], "q_memory": {"narrow": torch.randn(6, 2)}}}
    assert warm_start_rank_notes(same_width, up, None, shapes) == []  # nothing restarts: nothing to say
