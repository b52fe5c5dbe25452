"""PowerSGD's warm start, from the fifth hand mutation audit: the suite checked that the Qs are kept and restored,
not that reusing them does what it is for (one power-iteration step per training step, converging on a gradient that
changes slowly), nor that an undone step gives back the Qs exactly."""

from __future__ import annotations

import torch

from lit_dtrain.strategies import LoopbackCommunicator, PowerSGD
from lit_dtrain.strategies.compressors import segments_from_shapes

SEGMENTS = segments_from_shapes([("w", (40, 24))])


def matrix() -> tuple[torch.Tensor, float]:
    """A 40 x 24 matrix with singular values 1, 0.9, then 0.3 decaying; and its best rank-2 error (Eckart-Young)."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 24, generator=g))
    v, _ = torch.linalg.qr(torch.randn(24, 24, generator=g))
    s = torch.tensor([1.0, 0.9] + [0.3 * 0.8**i for i in range(22)])
    m = (u * s) @ v.T
    return m, float(torch.linalg.matrix_norm(m - (u[:, :2] * s[:2]) @ v[:, :2].T))


def errors(warm_start: bool, steps: int = 6) -> list[float]:
    m, best = matrix()
    codec = PowerSGD(matrix_approximation_rank=2, error_feedback=False, warm_start=warm_start, min_compression_rate=1)
    out = [codec.reduce(m.reshape(-1).clone(), SEGMENTS, LoopbackCommunicator(), step).wait() for step in range(steps)]
    return [float(torch.linalg.matrix_norm(o.view(40, 24) - m)) / best for o in out]


def test_warm_start_converges_to_the_best_rank_r_approximation_of_a_steady_gradient():
    warm, cold = errors(True), errors(False)
    assert warm[0] > 1.5 and max(warm[2:]) < 1.001  # a random first Q, then the top singular subspace
    assert min(cold[2:]) > 1.1  # a fresh random Q every step stays at one power iteration


def test_undoing_a_warm_started_step_gives_back_the_previous_qs_exactly():
    m, _ = matrix()
    codec = PowerSGD(matrix_approximation_rank=2, error_feedback=False, min_compression_rate=1)
    codec.track_undo()
    codec.reduce(m.reshape(-1).clone(), SEGMENTS, LoopbackCommunicator(), 0).wait()
    kept = codec.q_memory["w"].clone()
    codec.reduce((2 * m).reshape(-1).clone(), SEGMENTS, LoopbackCommunicator(), 1).wait()
    assert not torch.equal(codec.q_memory["w"], kept)
    assert codec.undo_step() and torch.equal(codec.q_memory["w"], kept)


def test_without_warm_start_restored_qs_are_not_used():
    m, _ = matrix()
    warm = PowerSGD(matrix_approximation_rank=2, error_feedback=False, min_compression_rate=1)
    warm.reduce(m.reshape(-1).clone(), SEGMENTS, LoopbackCommunicator(), 0).wait()
    cold, fresh = (PowerSGD(matrix_approximation_rank=2, error_feedback=False, warm_start=False,
                            min_compression_rate=1) for _ in range(2))
    cold.load_state_dict(warm.state_dict())  # a state written with warm_start=True
    results = [c.reduce(m.reshape(-1).clone(), SEGMENTS, LoopbackCommunicator(), 1).wait() for c in (cold, fresh)]
    assert torch.equal(*results)
