"""Local-update rules (local SGD, adaptive local SGD, DiLoCo) in one process, and two-rank codec sums."""

from __future__ import annotations

import math

import pytest
import torch

from lit_dtrain.strategies import (
    BlockQuantizer,
    DiLoCo,
    HalfPrecision,
    LocalSGD,
    LoopbackCommunicator,
    TopK,
)
from tests.unit._compressor_helpers import NUMEL, SEGMENTS, TwoRankComm, TwoRankGatherComm, grad, make_params


def test_error_feedback_of_an_all_reduce_codec_keeps_only_its_own_rounding_under_two_ranks():
    """An all_reduce codec divides its payload by the world size before the sum; the residual must be this
    rank's own rounding error ``x - fp16(x)``, not ``x - fp16(x) / world`` (invisible with one rank)."""
    c = HalfPrecision("fp16", error_feedback=True)
    comm = TwoRankComm(lambda t: t.clone())  # the other rank sends the same payload
    g = grad(7)
    mean = c.reduce(g.clone(), SEGMENTS, comm, 0).wait()
    assert torch.equal(mean, g.half().float())  # the mean of two equal fp16 halves
    residual = c.residual_for(SEGMENTS, g)
    torch.testing.assert_close(residual, g - g.half().float(), rtol=0, atol=1e-7)
    assert bool((residual.abs() <= 2.0**-11 * g.abs() + 1e-7).all())


def test_topk_sums_the_ranks_sparse_vectors_where_their_indices_overlap():
    c = TopK(ratio=0.1)
    out = c.decompress_sum([[torch.tensor([1.0, 2.0]), torch.tensor([0, 3], dtype=torch.int32)],
                            [torch.tensor([10.0, 20.0]), torch.tensor([3, 4], dtype=torch.int32)]], [], 6)
    assert out.tolist() == [1.0, 0.0, 0.0, 12.0, 20.0, 0.0]
    # end to end over two ranks: the other rank sends the same top-k, so the mean is this rank's top-k
    g = grad(3)
    mean = c.reduce(g.clone(), SEGMENTS, TwoRankGatherComm(lambda t: t.clone()), 0).wait()
    kept = mean != 0
    assert int(kept.sum()) == math.ceil(0.1 * NUMEL) and torch.equal(mean[kept], g[kept])


def test_local_sgd_averages_every_period_and_counts_bytes():
    params = make_params()
    offset = torch.full((29,), 0.5)
    comm = TwoRankComm(lambda t: t + offset)  # the other rank sits 0.5 higher in every coordinate
    rule = LocalSGD(sync_period=3)
    before = torch.cat([p.view(-1) for _, p in params]).clone()
    synced = [rule.after_optimizer_step(params, comm) for _ in range(6)]
    assert synced == [False, False, True, False, False, True]
    after = torch.cat([p.view(-1) for _, p in params])
    # each sync moves to the mean of (x, x + 0.5): +0.25
    assert torch.allclose(after, before + 0.5)
    assert comm.take_step_record()["bytes"] == 2 * 4 * 29


def test_adaptive_local_sgd_grows_while_divergence_is_low_and_shrinks_when_it_rises():
    params = make_params()
    norm_sq = sum(p.pow(2).sum() for _, p in params).item()
    gap = {"value": 0.0}
    comm = TwoRankComm(lambda t: t + gap["value"] if t.numel() > 1 else t)  # divergence scalar: same on both
    rule = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16, divergence_threshold=1e-3)
    periods = []
    for _ in range(40):
        if rule.after_optimizer_step(params, comm):
            periods.append(rule.period)
    assert periods[:3] == [8, 16, 16]  # identical replicas: divergence 0 -> grow to max
    gap["value"] = 2 * math.sqrt(1e-2 * norm_sq / 29)  # relative divergence ~1e-2 > threshold
    shrunk = []
    for _ in range(40):
        if rule.after_optimizer_step(params, comm):
            shrunk.append(rule.period)
    assert rule.last_divergence > 1e-3 and shrunk[-1] == 2 and shrunk == sorted(shrunk, reverse=True)


def test_an_early_sync_of_adaptive_local_sgd_leaves_its_period_alone():
    """A sync forced before the period is over (before a validation, at the last step) measures the drift of fewer
    steps: it grew the period (divergence 0 here) at every validation of a run validating more often than it syncs."""
    params = make_params()
    comm = TwoRankComm(lambda t: t.clone())  # identical replicas: divergence 0
    rule = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16)
    rule.after_optimizer_step(params, comm)
    assert rule.after_optimizer_step(params, comm, force_sync=True)
    assert (rule.period, rule.num_syncs, rule.num_early_syncs, rule.steps_since_sync) == (4, 1, 1, 0)
    assert comm.take_step_record()["bytes"] == 4 * 29  # the average only, no divergence all-reduce
    synced = [rule.after_optimizer_step(params, comm) for _ in range(4)]  # the period restarts at the early sync
    assert synced == [False, False, False, True] and (rule.period, rule.num_early_syncs) == (8, 1)
    restored = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16)
    restored.load_state_dict(rule.state_dict())
    assert (restored.num_syncs, restored.num_early_syncs) == (2, 1)


def test_diloco_outer_nesterov_step_matches_the_formula():
    params = make_params()
    start = torch.cat([p.view(-1) for _, p in params]).clone()
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.2))  # other rank's pseudo-gradient: 0.2 everywhere
    rule = DiLoCo(sync_period=2, outer_lr=0.7, outer_momentum=0.9)
    rule.maybe_initialize(params)
    for _, p in params:  # the inner optimizer moved this rank by -0.1
        p.data.sub_(0.1)
    rule.after_optimizer_step(params, comm)
    assert rule.after_optimizer_step(params, comm) is True
    delta = torch.full_like(start, (0.1 + 0.2) / 2)  # mean pseudo-gradient
    momentum = delta  # first step: 0.9 * 0 + delta
    expected = start - 0.7 * (delta + 0.9 * momentum)
    assert torch.allclose(torch.cat([p.view(-1) for _, p in params]), expected, atol=1e-6)
    assert torch.allclose(rule.momentum, momentum)

    restored = DiLoCo(sync_period=2)
    restored.load_state_dict(rule.state_dict())
    restored.maybe_initialize(params)
    assert torch.equal(restored.outer_params, rule.outer_params) and torch.equal(restored.momentum, rule.momentum)
    assert (restored.num_syncs, restored.step) == (1, 2)


def test_diloco_names_parameters_unfrozen_after_its_outer_loop_started():
    """A layer unfrozen mid-run joins CommSession.named_params: the flat parameters no longer match the outer ones
    (a bare tensor size-mismatch RuntimeError before)."""
    params = make_params()
    rule = DiLoCo(sync_period=1)
    rule.maybe_initialize(params[:-1])  # the last tensor frozen at the first step
    with pytest.raises(RuntimeError, match=r"DiLoCo: the trainable parameters changed .*new: \['" + params[-1][0]):
        rule.after_optimizer_step(params, TwoRankComm(lambda t: t.clone()))


@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_outer_momentum_accumulates_across_syncs(nesterov):
    """The first sync has zero momentum, so only later syncs show the momentum recursion m = mu * m + delta."""
    params = make_params()
    start = torch.cat([p.view(-1) for _, p in params]).clone()
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.2))  # other rank's pseudo-gradient: 0.2 everywhere
    rule = DiLoCo(sync_period=1, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    rule.maybe_initialize(params)
    expected, momentum, delta = start.clone(), 0.0, (0.1 + 0.2) / 2  # each sync: this rank moved by -0.1
    for sync in range(3):
        for _, p in params:
            p.data.sub_(0.1)
        assert rule.after_optimizer_step(params, comm) is True
        momentum = 0.9 * momentum + delta  # 0.15, 0.285, 0.4065
        expected -= 0.7 * ((delta + 0.9 * momentum) if nesterov else momentum)
        assert torch.allclose(rule.momentum, torch.full_like(start, momentum), atol=1e-6), sync
        assert torch.allclose(torch.cat([p.view(-1) for _, p in params]), expected, atol=1e-5), sync


@pytest.mark.parametrize("rule", ["local_sgd", "diloco"])
def test_a_sync_keeps_fp64_parameters_in_fp64(rule):
    """Under 64-true every sync computed the mean (and DiLoCo its outer parameters) in fp32: every weight was rounded
    to fp32 at each sync (1.2e-7 off for N(0, 1) values; a 2-rank 64-true run's weights were fp32-representable after
    every sync). The other rank sits 2**-40 higher (DiLoCo: its pseudo-gradient outer - local is 2**-40): the mean
    moves every value by 2**-41, exact in fp64, lost in fp32."""
    torch.manual_seed(0)
    params = [("w", torch.randn(6, 5, dtype=torch.float64)), ("b", torch.randn(5, dtype=torch.float64))]
    start = torch.cat([p.view(-1) for _, p in params]).clone()
    comm = TwoRankComm(lambda t: t + 2.0**-40)
    # DiLoCo with outer lr 1 and no momentum moves the outer parameters to the mean of the ranks' parameters
    built = (LocalSGD(sync_period=1) if rule == "local_sgd"
             else DiLoCo(sync_period=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False))
    built.maybe_initialize(params)
    assert built.after_optimizer_step(params, comm) is True
    after = torch.cat([p.view(-1) for _, p in params])
    assert after.dtype == torch.float64
    assert torch.equal(after, start + 2.0**-41 if rule == "local_sgd" else start - 2.0**-41)
    if rule == "diloco":
        assert built.outer_params.dtype == built.state_dict()["outer_params"]["w"].dtype == torch.float64


def test_a_validation_between_local_update_syncs_is_named():
    """With sync_before_validation=false each rank validates its own parameters between syncs: val/loss is a mean over
    different models, and a checkpoint written after the validation holds rank 0's. Said once per strategy; nothing
    right after a sync."""
    from types import SimpleNamespace

    from lit_dtrain.strategies.fit_end import warn_validation_between_syncs

    rule = LocalSGD(sync_period=4)
    trainer = SimpleNamespace(global_step=6, sanity_checking=False)
    strategy = SimpleNamespace(local_update=rule, lightning_module=SimpleNamespace(trainer=trainer, _trainer=trainer))
    rule.steps_since_sync = 0
    assert warn_validation_between_syncs(strategy) is None
    rule.steps_since_sync = 2
    with pytest.warns(UserWarning, match="validating at step 6, 2 step"):
        assert "strategy.sync_before_validation=true" in warn_validation_between_syncs(strategy)
    assert warn_validation_between_syncs(strategy) is None  # once


def test_a_validation_by_time_is_not_guessed_in_the_step():
    """val_check_interval as a duration: each rank reads its own clock, so a guess in the step could put one rank in a
    sync's all-reduce and not the other (a fit under local updates refuses it: the next test). By batches: asked of
    Lightning's epoch loop."""
    from types import SimpleNamespace

    from lit_dtrain.strategies.fit_end import validates_after_this_step

    epoch_loop = SimpleNamespace(_skip_next_val=False, _should_check_val_fx=lambda fetcher: True)
    trainer = SimpleNamespace(training=True, sanity_checking=False, _val_check_time_interval=None,
                              fit_loop=SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher=object()))
    assert validates_after_this_step(trainer)
    trainer._val_check_time_interval = 60.0
    assert not validates_after_this_step(trainer)


@pytest.mark.parametrize("local_update", [None, "local_sgd", "diloco"])
def test_a_fit_under_local_updates_refuses_a_validation_by_time(local_update, no_group_left):
    """Lightning validates by time when each rank's own clock says so. Under a local-update rule the sync before a
    validation then comes after different steps on the ranks: a 2-rank local SGD run (one rank 50 ms per batch slower,
    ``val_check_interval={"seconds": 0.5}``) paired one rank's validation sync with another collective of the other
    rank and hung until collective_timeout_s. A per-step codec has no such sync, as plain DDP: allowed."""
    import lightning as L

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def training_step(self, batch, _):
            return self.lin(batch[0]).square().mean()

        def validation_step(self, batch, _):
            self.log("val/loss", self.lin(batch[0]).square().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    strategy = CompressedDDPStrategy(compressor="fp16" if local_update is None else None, local_update=local_update)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        val_check_interval={"seconds": 30}, strategy=strategy)
    if local_update is None:
        trainer.fit(Net(), data, data)
        assert trainer.global_step == 2
        return
    with pytest.raises(ConfigError, match=rf"^val_check_interval is a duration \(30 s\).* under {local_update} .*"
                                          "set val_check_interval in batches$"):
        trainer.fit(Net(), data, data)
    assert trainer.global_step == 0


def test_diloco_state_from_before_its_first_step_restores_a_fresh_start():
    """LossSpikeMonitor's rollback snapshot is taken at ``on_train_start``, before DiLoCo's first step, when it has
    no outer parameters yet. Restoring it (a NaN step before the next snapshot) must start the outer loop afresh
    from the restored parameters (before: 'DiLoCo state has no outer parameters for [...]' at the next step)."""
    params = make_params()
    initial = [(n, p.clone()) for n, p in params]
    comm = TwoRankComm(lambda t: torch.full_like(t, 0.2))
    rule = DiLoCo(sync_period=2, outer_lr=0.5, outer_momentum=0.5)
    snapshot = rule.state_dict()  # before the first step
    rule.maybe_initialize(params)
    for _ in range(3):
        for _, p in params:
            p.data.sub_(0.1)
        rule.after_optimizer_step(params, comm)
    rule.load_state_dict(snapshot)  # the rollback: parameters back to the initial ones, and the rule's state
    for (_, p), (_, p0) in zip(params, initial):
        p.data.copy_(p0)
    fresh, fresh_params = DiLoCo(sync_period=2, outer_lr=0.5, outer_momentum=0.5), [(n, p.clone()) for n, p in initial]
    for ps, r in ((params, rule), (fresh_params, fresh)):
        for _ in range(2):
            r.maybe_initialize(ps)
            for _, p in ps:
                p.data.sub_(0.1)
            r.after_optimizer_step(ps, comm)
    assert (rule.step, rule.num_syncs) == (fresh.step, fresh.num_syncs) == (2, 1)
    assert torch.equal(rule.outer_params, fresh.outer_params) and torch.equal(rule.momentum, fresh.momentum)
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(params, fresh_params))


def test_diloco_compresses_its_pseudo_gradient():
    params = make_params()
    comm = LoopbackCommunicator()
    rule = DiLoCo(sync_period=1, compressor=BlockQuantizer(bits=8))
    rule.maybe_initialize(params)
    for _, p in params:
        p.data.add_(0.01)
    rule.after_optimizer_step(params, comm)
    record = comm.take_step_record()
    assert record["bytes"] == 29 + 2 * 4  # 29 int8 values; a block per parameter (24 and 5 values), 2 fp32 scales
    assert rule.compressor.num_calls == 1


@pytest.mark.parametrize("make", [lambda period: LocalSGD(sync_period=period),
                                  lambda period: DiLoCo(sync_period=period)])
def test_resuming_with_another_sync_period_uses_the_configured_one(make):
    """A fixed period is configuration, not state: ``strategy.local_update.sync_period=5`` on a resume of a
    period-3 run must sync every 5 steps (it silently kept 3)."""
    params = make_params()
    comm = TwoRankComm(lambda t: t)
    old = make(3)
    old.maybe_initialize(params)
    for _ in range(4):  # synced at step 3; one step into the next period
        old.after_optimizer_step(params, comm)
    rule = make(5)
    rule.load_state_dict(old.state_dict())
    synced = [rule.after_optimizer_step(params, comm) for _ in range(9)]
    assert rule.period == 5
    assert synced == [False, False, False, True, False, False, False, False, True]  # steps 8 and 13


def test_resuming_adaptive_local_sgd_keeps_its_period_within_the_configured_bounds():
    rule = LocalSGD(sync_period=8, adaptive=True, min_period=2, max_period=64)
    rule.period = 64
    restored = LocalSGD(sync_period=4, adaptive=True, min_period=2, max_period=16)
    restored.load_state_dict(rule.state_dict())
    assert restored.period == 16  # the adapted period is state, but within this run's max_period
    rule.period = 32
    restored = LocalSGD(sync_period=8, adaptive=True, min_period=2, max_period=64)
    restored.load_state_dict(rule.state_dict())
    assert restored.period == 32



@pytest.mark.parametrize("spec", ["int8", {"name": "int8"}])
def test_diloco_builds_its_compressor_from_a_name_or_mapping(spec):
    """``strategy.local_update.compressor=int8`` (Hydra builds DiLoCo itself, not through build_local_update)
    gave DiLoCo the string, which failed only at the first sync, H steps into the run."""
    params = make_params()
    rule = DiLoCo(sync_period=1, compressor=spec)
    assert isinstance(rule.compressor, BlockQuantizer) and rule.compressor.bits == 8
    rule.maybe_initialize(params)
    for _, p in params:
        p.data.add_(0.01)
    comm = LoopbackCommunicator()
    assert rule.after_optimizer_step(params, comm) is True
    assert comm.take_step_record()["bytes"] == 29 + 2 * 4
    with pytest.raises(ValueError, match="unknown compressor 'int16'"):
        DiLoCo(compressor="int16")
    with pytest.raises(ValueError, match="compressor.bogus is not an argument of the compressor 'int8'"):
        DiLoCo(compressor={"name": "int8", "bogus": 1})


def test_a_resumed_local_update_run_counts_hook_calls_as_the_uninterrupted_run():
    """DDP hands its one initial bucket in the first step of every start and its rebuilt buckets after it. The hook
    of a local-update run (which sends no gradient) counted that one call, so after a resume ``comm/hook_calls`` and
    the checkpoint's counters stayed one below the uninterrupted run's (local SGD, 2 gloo ranks, SIGTERM at step 13:
    58 against 59 at step 29); it now counts the saved buckets, as a codec's resume does."""
    from types import SimpleNamespace

    from lit_dtrain.strategies.comm import CommSession, compressed_comm_hook

    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 2, 4)]
    names = {id(p): f"p{i}" for i, p in enumerate(params)}

    def bucket(members):
        buffer = torch.zeros(sum(params[i].numel() for i in members))
        views, offset = [], 0
        for i in members:
            views.append(buffer[offset : offset + params[i].numel()])
            offset += params[i].numel()
        return SimpleNamespace(buffer=lambda: buffer, parameters=lambda: [params[i] for i in members],
                               gradients=lambda: views)

    initial, rebuilt = [[3, 2, 1, 0]], [[0, 1], [2, 3]]  # DDP's first-step bucket, then its rebuilt ones

    def step(session, buckets):
        for members in buckets:
            compressed_comm_hook(session, bucket(members)).wait()
        session.after_optimizer_step([])

    def new_session():
        session = CommSession(local_update=LocalSGD(sync_period=8), comm=LoopbackCommunicator())
        session.names = names
        return session

    straight = new_session()
    for buckets in (initial, rebuilt, rebuilt):
        step(straight, buckets)
    stopped = new_session()
    for buckets in (initial, rebuilt):
        step(stopped, buckets)
    resumed = new_session()
    resumed.load_counters_state_dict(stopped.counters_state_dict())
    step(resumed, initial)  # a restart's first step: DDP's initial bucket again
    assert straight.hook_calls == 5 and resumed.hook_calls == straight.hook_calls
    assert resumed.counters_state_dict() == straight.counters_state_dict()
