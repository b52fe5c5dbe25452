"""The compressors' and local-update rules' constructors refuse a value of the wrong type in one line naming the class,
the argument and the value: a project of one's own builds them directly, past train.py's config checks."""

from __future__ import annotations

import math
import re

import pytest

from lit_dtrain.strategies import (
    BlockQuantizer,
    DiLoCo,
    HalfPrecision,
    LocalSGD,
    PowerSGD,
    ScaledSign,
    ShardedBlockQuantizer,
    TopK,
)

REFUSED = [
    # flags: bool("false") is True, so error_feedback="false" kept the residuals on
    (ScaledSign, "error_feedback", "false"), (HalfPrecision, "error_feedback", 1), (PowerSGD, "warm_start", "false"),
    (BlockQuantizer, "stochastic_rounding", "no"), (LocalSGD, "adaptive", "false"), (DiLoCo, "nesterov", None),
    # counts: True was taken as 1 and 2.5 truncated to 2; nan/inf failed inside int() naming no argument
    (TopK, "start_step", True), (PowerSGD, "matrix_approximation_rank", 2.5), (LocalSGD, "sync_period", True),
    (DiLoCo, "sync_period", math.inf), (BlockQuantizer, "seed", 1.5), (PowerSGD, "seed", -1),
    (LocalSGD, "max_period", -1), (LocalSGD, "growth_factor", 2.5), (TopK, "ratio_warmup_steps", math.nan),
    (BlockQuantizer, "block_size", "abc"), (ShardedBlockQuantizer, "bits", True),
    # real numbers: a string failed in a bare comparison ("'<' not supported between instances of 'float' and 'str'");
    # NaN passed an `if v <= 0: raise` check, True was 1.0
    (TopK, "ratio", "0.5"), (TopK, "initial_ratio", True), (PowerSGD, "min_compression_rate", math.nan),
    (PowerSGD, "orthogonalization_epsilon", -1.0), (LocalSGD, "divergence_threshold", math.nan),
    (DiLoCo, "outer_lr", math.inf), (DiLoCo, "outer_momentum", "0.9"),
]


@pytest.mark.parametrize(("cls", "name", "value"), REFUSED, ids=[f"{c.__name__}.{n}={v!r}" for c, n, v in REFUSED])
def test_a_value_of_the_wrong_type_is_refused_naming_the_class_and_the_argument(cls, name, value):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {name} must be .*, got {re.escape(repr(value))}$"):
        cls(**{name: value})


def test_the_values_the_checks_accept_are_unchanged():
    import numpy as np

    q = BlockQuantizer(bits=4.0, block_size=np.int64(64), stochastic_rounding=np.True_, seed=3, start_step=2.0)
    assert (q.bits, q.block_size, q.stochastic_rounding, q.seed, q.start_step) == (4, 64, True, 3, 2)
    t = TopK(ratio=np.float32(0.5), initial_ratio=1, ratio_warmup_steps=10)
    assert (t.ratio, t.ratio_warmup_steps) == (0.5, 10)
    p = PowerSGD(matrix_approximation_rank=2, orthogonalization_epsilon=0, min_compression_rate=1)
    assert (p.matrix_approximation_rank, p.orthogonalization_epsilon) == (2, 0.0)
    s = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=8, growth_factor=3)
    assert (s.sync_period, s.min_period, s.max_period, s.growth_factor, s.adaptive) == (4, 2, 8, 3, True)
    d = DiLoCo(sync_period=2, outer_lr=1, outer_momentum=0, nesterov=False)
    assert (d.sync_period, d.outer_lr, d.outer_momentum, d.nesterov) == (2, 1.0, 0.0, False)


def test_topks_initial_ratio_from_numpy_keeps_the_schedule_of_the_same_value_written_as_a_float():
    """TopK kept initial_ratio as given: np.float32(0.25) computed the ratio schedule in float32, and at step 49 of a
    100-step warm-up kept 474015 of 9.18M values where initial_ratio=0.25 keeps 474016."""
    import numpy as np

    given, written = (TopK(ratio=0.01, initial_ratio=v, ratio_warmup_steps=100) for v in (np.float32(0.25), 0.25))
    assert type(given.initial_ratio) is float
    assert [given.k_at(9_180_000, s) for s in range(100)] == [written.k_at(9_180_000, s) for s in range(100)]


@pytest.mark.parametrize(("name", "value"), [("log_comm_metrics", "false"), ("sync_on_last_step", "false"),
                                             ("sync_before_validation", 1)])
def test_compressed_ddps_flags_are_refused_unless_true_false_or_none(name, value):
    """CompressedDDPStrategy(local_update="local_sgd", sync_before_validation="false") synced before each validation
    (bool of a non-empty string), sync_on_last_step="false" synced at the last step."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    with pytest.raises(ValueError, match=rf"^CompressedDDPStrategy: {name} must be True or False.*, got {value!r}$"):
        CompressedDDPStrategy(local_update="local_sgd", **{name: value})
    strategy = CompressedDDPStrategy(local_update="local_sgd", sync_on_last_step=False, sync_before_validation=None)
    assert (strategy.sync_on_last_step, strategy.sync_before_validation) == (False, True)


@pytest.mark.parametrize("value", [3, [None], ["torch.nn.Linear", 0]])
def test_make_fsdps_wrap_modules_of_another_type_is_refused_in_a_line(value):
    """make_fsdp(wrap_modules=3) failed with "'int' object is not iterable"; [None] looked up a class named 'None'."""
    from lit_dtrain.strategies import make_fsdp

    with pytest.raises(ValueError, match=r"^make_fsdp: wrap_modules must be module classes or dotted class paths"):
        make_fsdp(wrap_modules=value)


@pytest.mark.parametrize("seconds", [1e10, 1e20])
def test_a_collective_timeout_past_what_torch_counts_is_refused_in_a_line(seconds):
    """A 'no timeout' written large: under train.py strategy.collective_timeout_s=1e10 failed the 2 ranks' first
    connection at once ('The client socket has timed out after 10000000000000ms', blamed on a dead rank, advising
    resume=auto: torch counts it in int64 nanoseconds); 1e20 was an OverflowError naming nothing."""
    from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp

    said = rf"^make_ddp: collective_timeout_s must be at most 1e9 seconds .*got {re.escape(repr(seconds))}$"
    with pytest.raises(ValueError, match=said):
        make_ddp(collective_timeout_s=seconds)
    with pytest.raises(ValueError, match=r"^CompressedDDPStrategy: collective_timeout_s must be at most 1e9 seconds"):
        CompressedDDPStrategy(compressor="int8", collective_timeout_s=seconds)
    assert make_ddp(collective_timeout_s=1e9)._timeout.total_seconds() == 1e9


@pytest.mark.parametrize("given", [{"initial_ratio": 0.25}, {"ratio_warmup_steps": 100}])
def test_topks_dynamic_ratio_given_half_is_refused(given):
    """strategy.compressor.initial_ratio=0.25 without ratio_warmup_steps (its config default 0) trained at ratio from
    the first step (1000 of 100000 values kept, not 25000), as ratio_warmup_steps without initial_ratio did."""
    said = rf"^TopK: {next(iter(given))} needs .* too \(the kept fraction decays .*\), got initial_ratio=.*, ratio_warm"
    with pytest.raises(ValueError, match=said):
        TopK(ratio=0.01, **given)
    assert TopK(ratio=0.01, initial_ratio=0.25, ratio_warmup_steps=100).k_at(100_000, 0) == 25_000


def test_ddps_unused_parameter_error_names_the_compressed_strategys_own_flag():
    """A project of one's own with a parameter unused in the loss (2 gloo ranks): Lightning's advice was
    strategy='ddp_find_unused_parameters_true', its plain DDPStrategy, which would replace the compressed one (no codec)
    without a word. The advice names this strategy's own find_unused_parameters=True now; other errors are kept."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(compressor="int8")
    error = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. ...")
    strategy.on_exception(error)
    assert str(error).startswith("It looks like your LightningModule has parameters that were not used")
    assert "this strategy's own flag, `CompressedDDPStrategy(..., find_unused_parameters=True)`" in str(error)
    assert "either by setting the string value `strategy='ddp_find_unused_parameters_true'`" not in str(error)
    other = ValueError("loss is nan", 3)
    strategy.on_exception(other)
    assert other.args == ("loss is nan", 3)


def test_make_ddps_unused_parameter_error_names_make_ddps_own_flag():
    """Likewise for make_ddp's EvenEpochsDDPStrategy (strategy=ddp): Lightning advised
    strategy='ddp_find_unused_parameters_true' or DDPStrategy(find_unused_parameters=True), either of which drops the
    check that the ranks' epochs are of one length (EpochLengthCheck) without a word."""
    from lit_dtrain.strategies import make_ddp

    error = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. ...")
    make_ddp().on_exception(error)
    assert str(error).startswith("It looks like your LightningModule has parameters that were not used")
    assert ("this strategy's own flag, `make_ddp(..., find_unused_parameters=True)` (in train.py's config "
            "strategy=ddp '+strategy.find_unused_parameters=true')") in str(error)
    assert "either by setting the string value" not in str(error) and "DDPStrategy(find_unused" not in str(error)
    assert "the check that the ranks' epochs are of one length" in str(error)
