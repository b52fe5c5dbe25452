"""2-process gloo test of ``OptimizerDiagnostics`` under FSDP, where each rank holds a shard of every parameter,
gradient and Adam state: its figures were rank 0's shard's (grad RMS 0.0945 where the model's is 0.1446), logged as
the model's. They are summed over the ranks' shards now. Lightning refuses FSDP on a CPU, so the model is torch's
FullyShardedDataParallel (``device_id`` cpu, which torch 2.13 runs under gloo) and the trainer a stand-in whose
strategy is named as Lightning's FSDP and reduces as it does. A rank whose shard holds no grad (a frozen backbone's
elements alone) skipped the all-reduce, and the other rank's waited for it: every rank reduces now. So did
``AdaptiveGradClip``'s global grad norm, in the same spawn; and its clip, which scaled that rank's empty list of
grads (torch's foreach ops refuse one)."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel

from lit_dtrain.callbacks import AdaptiveGradClip, OptimizerDiagnostics
from tests.conftest import free_port, leave_rank

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one spawn: ~31 s on the shared 2-core machine


class StandInFSDPStrategy:
    """What the callbacks ask of Lightning's ``FSDPStrategy``: its device, its ranks and a summing reduce; and what
    ``LitLLM``'s clip asks, the root FSDP module (``model``)."""

    root_device = torch.device("cpu")
    world_size = 2
    model = None

    @staticmethod
    def reduce(tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        assert reduce_op == "sum"
        dist.all_reduce(tensor)
        return tensor


def _model(frozen_backbone: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[0].requires_grad_(not frozen_backbone)
    return model


def _diagnosed_step(model: torch.nn.Module, world_size: int, strategy) -> dict[str, float]:
    """Two AdamW steps on the same batch on every rank; the second is a diagnostic step. Its figures."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, eps=1e-3)
    trainer = SimpleNamespace(world_size=world_size, strategy=strategy, optimizers=[optimizer], global_step=0,
                              precision_plugin=None)
    diag = OptimizerDiagnostics(every_n_steps=2)
    diag.on_train_start(trainer, None)
    torch.manual_seed(1)
    batch = torch.randn(4, 8)
    for step in range(2):
        trainer.global_step = step
        model(batch).pow(2).mean().backward()
        diag.on_after_backward(trainer, None)
        optimizer.step()
        optimizer.zero_grad()
    return dict(diag._pending)


def _clipped_steps(model: torch.nn.Module, world_size: int, strategy, max_norm: float | None = None) -> list[float]:
    """Three AdamW steps under ``AdaptiveGradClip`` (its warmup: nothing clipped but by ``max_norm``); the grad norms
    its statistic took in."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    trainer = SimpleNamespace(world_size=world_size, strategy=strategy, optimizers=[optimizer], global_step=0,
                              precision_plugin=None, log_every_n_steps=1000)
    import lit_dtrain.callbacks.adaptive_grad_clip as clip_module

    clip = AdaptiveGradClip(warmup_steps=5, max_norm=max_norm)
    clip.on_train_start(trainer, None)
    torch.manual_seed(1)
    log_step_metrics, clip_module.log_step_metrics = clip_module.log_step_metrics, lambda *args: None  # (a clip
    try:  # writes a row: the stand-in trainer has no logger)
        for step in range(3):
            trainer.global_step = step
            model(torch.randn(4, 8)).pow(2).mean().backward()
            clip.on_before_optimizer_step(trainer, None, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            clip.on_train_batch_end(trainer, None, None, None, step)
    finally:
        clip_module.log_step_metrics = log_step_metrics
    if max_norm is None:
        return clip.stats[0].state_dict()["warm"]
    return [clip.clip_events, *(float(p.detach().sum()) for p in model.parameters() if p.requires_grad)]


def _logged_grad_norms(sharded: FullyShardedDataParallel) -> list[tuple[int, float]]:
    """``LitLLM``'s clip by norm at step 0 (its FSDP branch: the root module's ``clip_grad_norm_``), a stand-in
    trainer logging every step; the ``train/grad_norm`` rows it writes."""
    import lit_dtrain.callbacks._logging as logging_helpers
    from lit_dtrain.module import LitLLM

    optimizer = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=0.1)
    strategy = StandInFSDPStrategy()
    strategy.model = sharded
    trainer = SimpleNamespace(world_size=2, strategy=strategy, global_step=0, log_every_n_steps=1, should_stop=False)
    rows = []
    logging_helpers.log_step_metrics = lambda trainer, module, metrics, step: rows.append(
        (step, float(metrics["train/grad_norm"])))
    torch.manual_seed(1)
    sharded(torch.randn(4, 8)).pow(2).mean().backward()
    LitLLM.configure_gradient_clipping(SimpleNamespace(trainer=trainer), optimizer, 1.0, "norm")
    return rows


def _worker(rank: int, port: int, out_path: str) -> None:
    # (a bound, so that a rank left waiting in a collective the other skipped fails the test, not hangs it)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    results = {}
    for frozen in (False, True):  # a frozen backbone: rank 0's shard holds its elements alone, and no grad
        sharded = FullyShardedDataParallel(_model(frozen), device_id=torch.device("cpu"), use_orig_params=True)
        shard_numel = sum(p.numel() for p in sharded.parameters())
        shard_grads = sum(p.numel() for p in sharded.parameters() if p.requires_grad)
        figures = _diagnosed_step(sharded, 2, StandInFSDPStrategy())
        results[f"frozen={frozen}"] = {"figures": figures, "shard_numel": shard_numel, "shard_grads": shard_grads}
    sharded = FullyShardedDataParallel(_model(frozen_backbone=True), device_id=torch.device("cpu"),
                                       use_orig_params=True)
    results["clipped_norms"] = _clipped_steps(sharded, 2, StandInFSDPStrategy())
    sharded = FullyShardedDataParallel(_model(frozen_backbone=True), device_id=torch.device("cpu"),
                                       use_orig_params=True)
    results["clips"] = _clipped_steps(sharded, 2, StandInFSDPStrategy(), max_norm=1e-3)
    sharded = FullyShardedDataParallel(_model(frozen_backbone=True), device_id=torch.device("cpu"),
                                       use_orig_params=True)
    results["logged_grad_norms"] = _logged_grad_norms(sharded)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
    leave_rank()


@pytest.fixture(scope="module")
def sharded_figures(tmp_path_factory) -> list[dict]:
    """Each rank's results of every fit (one spawn)."""
    out = str(tmp_path_factory.mktemp("fsdp") / "figures")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    return [json.loads(open(f"{out}.{r}").read()) for r in range(2)]


def test_fsdp_figures_are_the_whole_models(sharded_figures):
    ranks = [r["frozen=False"] for r in sharded_figures]
    whole = _diagnosed_step(_model(), 1, SimpleNamespace())
    assert sorted(r["shard_numel"] for r in ranks) == [40, 41]  # each rank holds about half of the 81 parameters
    assert set(whole) == {"optim/0/grad_rms", "optim/0/update_to_param_rms", "optim/0/eps_dominated_frac"}
    for rank in ranks:  # every rank's figures are the unsharded model's (same batch on both ranks: same gradients)
        assert rank["figures"].keys() == whole.keys()
        for name, value in whole.items():
            assert rank["figures"][name] == pytest.approx(value, rel=1e-5), name


def test_fsdp_rank_whose_shard_holds_no_grad_still_reduces(sharded_figures):
    """A frozen ``Linear(8, 8)`` before a trained ``Linear(8, 1)`` in one FSDP unit: rank 0's 41 elements are the
    frozen layer's alone, so it holds no grad. It returned before the all-reduce, logged nothing, and rank 1's
    all-reduce failed ('Connection closed by peer'). Both ranks log the unsharded model's figures now."""
    ranks = [r["frozen=True"] for r in sharded_figures]
    whole = _diagnosed_step(_model(frozen_backbone=True), 1, SimpleNamespace())
    assert [(r["shard_numel"], r["shard_grads"]) for r in ranks] == [(41, 0), (40, 9)]
    assert set(whole) == {"optim/0/grad_rms", "optim/0/update_to_param_rms", "optim/0/eps_dominated_frac"}
    for rank in ranks:
        assert rank["figures"].keys() == whole.keys()
        for name, value in whole.items():
            assert rank["figures"][name] == pytest.approx(value, rel=1e-5), name


def test_adaptive_grad_clip_on_a_rank_whose_shard_holds_no_grad(sharded_figures):
    """The frozen backbone's fit of the test above under ``AdaptiveGradClip``: rank 0 held no grad, so its global
    grad norm returned None before the all-reduce that rank 1 waited in (gloo's timeout), and rank 0 took the step
    back out of its statistic, the one checkpointed. Both ranks' statistics took the unsharded model's norms."""
    whole = _clipped_steps(_model(frozen_backbone=True), 1, SimpleNamespace())
    assert len(whole) == 3 and len(set(whole)) == 3
    for rank in sharded_figures:
        assert rank["clipped_norms"] == pytest.approx(whole, rel=1e-5)


def test_litllm_logs_the_grad_norm_where_rank_0s_shard_holds_no_grad(sharded_figures):
    """``LitLLM`` clips through the root FSDP module, then logs ``train/grad_norm`` where the step's grads were not
    dropped. Rank 0, which writes the logs, held no grad of its own: it wrote no row (rank 1 did, unseen). Both log
    the unsharded model's norm now."""
    model = _model(frozen_backbone=True)
    torch.manual_seed(1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    whole = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
    for rank in sharded_figures:
        assert [step for step, _ in rank["logged_grad_norms"]] == [0]
        assert rank["logged_grad_norms"][0][1] == pytest.approx(whole, rel=1e-5)


def test_adaptive_grad_clip_clips_on_a_rank_whose_shard_holds_no_grad(sharded_figures):
    """The same fit clipped at every step (``max_norm=1e-3``): rank 0, holding no grad, scaled an empty list of them
    (``torch._foreach_mul_``: 'Tensor list must have at least one tensor'), and rank 1's next collective failed.
    Both ranks count the 3 clips, and their shards' parameters add up to the unsharded model's."""
    whole = _clipped_steps(_model(frozen_backbone=True), 1, SimpleNamespace(), max_norm=1e-3)
    assert whole[0] == 3
    assert [rank["clips"][0] for rank in sharded_figures] == [3, 3]
    summed = [sum(values) for values in zip(*(rank["clips"][1:] for rank in sharded_figures))]
    assert summed == pytest.approx(whole[1:], rel=1e-5)
