"""Gaps found by the fifth hand mutation audit of strategies/local_updates.py: results that no other test pinned."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lit_dtrain.strategies import DiLoCo, LocalSGD
from tests.unit._compressor_helpers import TwoRankComm, make_params

CONF = Path(__file__).resolve().parents[2] / "conf" / "strategy" / "ddp_compressed"


def flat(params) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for _, p in params])


def test_diloco_built_without_arguments_takes_the_papers_outer_step():
    """``DiLoCo()`` in a project of one's own: outer lr 0.7, Nesterov momentum 0.9 (Douillard et al. 2023). A
    changed default (outer_lr 1.0) went unnoticed: every other test passes its outer arguments."""
    params = make_params()
    start = flat(params).clone()
    rule = DiLoCo()
    rule.maybe_initialize(params)
    for _, p in params:
        p.data.sub_(0.1)  # this rank's pseudo-gradient: 0.1; the other rank's: 0.3
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.3))
    synced = [rule.after_optimizer_step(params, comm) for _ in range(16)]
    assert synced == [False] * 15 + [True]  # sync_period 16
    delta = torch.full_like(start, 0.2)
    torch.testing.assert_close(flat(params), start - 0.7 * (delta + 0.9 * delta))


def test_the_rules_python_defaults_are_the_shipped_configs():
    """``strategy=ddp_compressed/<rule>`` and the class built in Python run the same rule."""
    for cls, name in ((DiLoCo, "diloco"), (LocalSGD, "local_sgd"), (LocalSGD, "local_sgd_adaptive")):
        given = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml").local_update)
        defaults = {k: v.default for k, v in inspect.signature(cls).parameters.items()}
        differ = {k: (v, defaults[k]) for k, v in given.items() if k != "_target_" and k != "adaptive"
                  and v != defaults[k]}
        assert not differ, (name, differ)


def test_adaptive_local_sgd_grows_its_period_at_a_divergence_equal_to_the_threshold():
    """"At or under ``divergence_threshold``" grows the period. Ranks at 1 and 3: mean 2, divergence
    ((1 + 1) + (1 + 1)) / 2 / (4 + 4) = 0.25 exactly."""
    params = [("w", torch.ones(2))]
    comm = TwoRankComm(lambda t: torch.full_like(t, 3.0) if t.numel() == 2 else t.clone())
    for threshold, period in ((0.25, 8), (0.2499, 2)):
        rule = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16, divergence_threshold=threshold)
        params[0][1].fill_(1.0)
        rule.synchronize(params, comm)
        assert (rule.last_divergence, rule.period) == (0.25, period), threshold
        assert params[0][1].tolist() == [2.0, 2.0]


def test_a_layer_unfrozen_at_a_diloco_resume_starts_with_zero_momentum():
    """A tensor without saved outer state (frozen at the save, trainable now) starts its outer loop where it is, with
    no momentum: the first outer step moves it by ``outer_lr * (1 + momentum) * its pseudo-gradient`` alone."""
    params = make_params()
    saved = DiLoCo(sync_period=1)
    saved.maybe_initialize(params[:1])  # "b" frozen at the save
    saved.after_optimizer_step(params[:1], TwoRankComm(lambda t: torch.full_like(t, 0.5)))
    rule = DiLoCo(sync_period=1)
    rule.load_state_dict(saved.state_dict())
    b = params[1][1]
    start = b.clone()
    rule.maybe_initialize(params)
    n = params[0][1].numel()
    assert torch.equal(rule.momentum[n:], torch.zeros_like(start)) and torch.equal(rule.outer_params[n:], start)
    b.sub_(0.1)  # this rank's pseudo-gradient 0.1, the other's 0.3: mean 0.2
    rule.after_optimizer_step(params, TwoRankComm(lambda t: torch.full_like(t, 0.3)))
    torch.testing.assert_close(b, start - 0.7 * 1.9 * 0.2)


def test_local_sgd_averages_a_layer_frozen_as_another_is_unfrozen():
    """One layer frozen and another unfrozen at the same forward (as many trainable tensors as before): the layer
    frozen since the last sync holds this rank's own copy, so it is averaged before it stops syncing for good."""
    a, b = make_params()
    rule = LocalSGD(sync_period=8)
    comm = TwoRankComm(lambda t: torch.zeros_like(t))  # the other rank's parameters: zeros
    assert rule.sync_if_trainable_changed([a], comm) is False  # the first forward: "a" trains
    start = a[1].clone()
    rule.after_optimizer_step([a], comm)
    assert rule.sync_if_trainable_changed([b], comm) is True  # "a" frozen, "b" unfrozen
    torch.testing.assert_close(a[1], start / 2)
    assert (rule.num_syncs, rule.num_early_syncs) == (1, 1)
