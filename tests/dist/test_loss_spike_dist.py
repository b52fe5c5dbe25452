"""LossSpikeMonitor under 2-process DDP (gloo, CPU, 127.0.0.1): a spike on one rank's batch, same action on both."""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port, leave_rank, make_corpus

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]

BATCH = 4



def _data(root: str):
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.data.corpus import CorpusSource

    return LMDataModule(sources=[CorpusSource(name="c", kind="files", paths=[os.path.join(root, "corpus")])],
                        block_size=32, batch_size=BATCH, cache_dir=os.path.join(root, "cache"), progress=False,
                        max_val_windows=4)


def _worker(rank: int, port: int, root: str) -> None:
    """The fits of every test below, in one process group: a spawn per test started two fresh Pythons (imports,
    gloo set-up) for fits of a few seconds. A failure in any of them fails mp.spawn, naming it. The local-update
    fits come first: the first fit's strategy creates the process group, whose timeout (their 30 s, not the 30 min
    default) every later collective keeps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    _local_update_fits(rank, root)
    _spike_fits(rank, root)
    _comm_fits(rank, root)
    leave_rank()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("spikes")
    make_corpus(root / "corpus", n_files=6, size=2000)
    _data(str(root)).prepare_data()  # build the token cache once, before the ranks start
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=2, join=True)
    return root


def _spike_fits(rank: int, root: str) -> None:
    from lit_dtrain.callbacks import AdaptiveGradClip, LossSpikeMonitor
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.schedules import cosine_scheduler

    class Inject(L.Callback):
        """Spikes only this rank's batch: logits x100 (finite) or NaN, at the given steps."""

        def __init__(self, steps: dict[int, str]) -> None:
            self.steps, self.handle = steps, None
            self.local_loss: dict[int, float] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            kind = self.steps.get(trainer.global_step)
            if kind:
                scale = float("nan") if kind == "nan" else 100.0
                self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * scale)

        def on_before_backward(self, trainer, pl_module, loss):
            self.local_loss[trainer.global_step] = float(loss.detach())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    class Record(L.Callback):
        def __init__(self, monitor, clip=None):
            self.monitor, self.clip = monitor, clip
            self.reasons, self.indices, self.params, self.thresholds = {}, {}, {}, {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.indices[trainer.global_step] = batch["index"].tolist()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - 1
            self.reasons[step] = list(self.monitor.last_decision.reasons)
            self.params[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            if self.clip is not None:
                self.thresholds[step] = self.clip.last.get("threshold")

    def fit(inject: dict[int, str], monitor, clip=None):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32))
        lit = LitLLM(model, optimizer=partial(adamw, lr=3e-3),
                     scheduler=partial(cosine_scheduler, total_steps=40, warmup_steps=2))
        injector, record = Inject(inject), Record(monitor, clip)
        callbacks = [injector, monitor] + ([clip] if clip else []) + [record]
        dm = _data(root)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12, callbacks=callbacks,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root)
        trainer.fit(lit, datamodule=dm)
        return {
            "global_step": trainer.global_step,
            "events": [(e["step"], e["actions"], e["index"], e["rolled_back_to"]) for e in monitor.events],
            "reasons": record.reasons, "indices": record.indices, "local_loss": injector.local_loss,
            "params": record.params, "excluded": sorted(monitor.excluded),
            "sampler_excluded": dm.sampler.excluded.nonzero().flatten().tolist(), "thresholds": record.thresholds,
        }

    results = {
        # a finite spike on rank 1's batch at step 6, a NaN on rank 0's batch at step 9
        "skip": fit({6: "finite"} if rank == 1 else {9: "nan"},
                    LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3), AdaptiveGradClip(warmup_steps=3)),
        "rollback": fit({8: "finite"} if rank == 1 else {},
                        LossSpikeMonitor(actions=["log", "rollback"], warmup_steps=3, snapshot_every=3)),
    }
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))


def test_spike_on_one_rank_same_action_on_both(fitted: Path) -> None:
    r0, r1 = (torch.load(fitted / f"rank{r}.pt", weights_only=False) for r in (0, 1))

    skip0, skip1 = r0["skip"], r1["skip"]
    assert skip0["global_step"] == skip1["global_step"] == 12  # the run completed on both ranks
    # the finite spike was on rank 1 only: rank 0's own loss at step 6 was ordinary
    assert skip1["local_loss"][6] > 3 * skip1["local_loss"][5]
    assert skip0["local_loss"][6] < 1.2 * skip0["local_loss"][5]
    # ... yet both ranks decided identically at every step, and took the same action
    assert skip0["reasons"] == skip1["reasons"]
    assert [s for s, r in skip0["reasons"].items() if r] == [6, 9]
    assert skip0["events"] == skip1["events"]
    assert [(s, a) for s, a, _, _ in skip0["events"]] == [(6, ["log", "skip"]), (9, ["log", "skip"])]
    # the excluded samples are both ranks' shards of the spiking global batches, on both ranks' samplers
    spiked = sorted(set(skip0["indices"][6] + skip1["indices"][6] + skip0["indices"][9] + skip1["indices"][9]))
    assert skip0["excluded"] == skip1["excluded"] == spiked
    assert skip0["sampler_excluded"] == skip1["sampler_excluded"] == spiked
    for steps_done in (7, 10):  # skipped steps leave the parameters as they were, on both ranks
        for k, v in skip0["params"][steps_done].items():
            assert torch.equal(v, skip0["params"][steps_done - 1][k]), (steps_done, k)
    for k, v in skip0["params"][12].items():
        assert torch.equal(v, skip1["params"][12][k]), k  # ranks never diverged
        assert torch.isfinite(v).all(), k
    # AdaptiveGradClip saw the same (all-reduced) grad norms: identical thresholds on both ranks
    def finite(thresholds: dict) -> dict:  # None (no threshold) while warming up
        return {s: t for s, t in thresholds.items() if t is not None}

    assert skip0["thresholds"].keys() == skip1["thresholds"].keys()
    assert finite(skip0["thresholds"]) == finite(skip1["thresholds"]) and len(finite(skip0["thresholds"])) >= 6

    rb0, rb1 = r0["rollback"], r1["rollback"]
    assert rb0["global_step"] == rb1["global_step"] == 12
    assert rb0["events"] == rb1["events"] and [(e[0], e[3]) for e in rb0["events"]] == [(8, 6)]
    for k, v in rb0["params"][9].items():  # after step 8: exactly the snapshot of step 6, on both ranks
        assert torch.equal(v, rb0["params"][6][k]) and torch.equal(v, rb1["params"][9][k]), k


def _comm_fits(rank: int, root: str) -> None:
    """Skip under error-feedback compressors and rollback under DiLoCo, on the compressed-DDP strategy."""
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.callbacks._snapshots import to_cpu
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.schedules import cosine_scheduler
    from lit_dtrain.strategies import CompressedDDPStrategy

    class Spike(L.Callback):
        """Rank 1's logits x100 at step 6."""

        def __init__(self):
            self.handle = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 6 and trainer.global_rank == 1:
                self.handle = pl_module.model.register_forward_hook(lambda m, i, out: out * 100.0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    class CommState(L.Callback):
        def __init__(self):
            self.after: dict[int, dict] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.after[trainer.global_step] = to_cpu(trainer.strategy.comm_local_state_dict())

    def fit(action: str, **strategy):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32))
        lit = LitLLM(model, optimizer=partial(adamw, lr=3e-3),
                     scheduler=partial(cosine_scheduler, total_steps=40, warmup_steps=2))
        monitor, record = LossSpikeMonitor(actions=[action], warmup_steps=3, snapshot_every=2), CommState()
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=9, logger=False, enable_checkpointing=False,
                            strategy=CompressedDDPStrategy(log_comm_metrics=False, **strategy),
                            callbacks=[Spike(), monitor, record], enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root)
        trainer.fit(lit, datamodule=_data(root))
        return {"events": [(e["step"], e["rolled_back_to"]) for e in monitor.events], "after": record.after}

    results = {
        "topk": fit("skip", compressor={"name": "topk", "ratio": 0.05}),
        "powersgd": fit("skip", compressor="powersgd"),
        "diloco": fit("rollback", local_update={"name": "diloco", "sync_period": 3}),
    }
    torch.save(results, os.path.join(root, f"comm_rank{rank}.pt"))


def _assert_state_equal(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_state_equal(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_skip_and_rollback_also_undo_the_strategys_comm_state(fitted: Path) -> None:
    """The spike's gradient must not survive in an error-feedback residual (it would be applied at the next
    step), nor DiLoCo's outer state in a rollback: both ranks end the dropped step with the state before it."""
    for rank in (0, 1):
        r = torch.load(fitted / f"comm_rank{rank}.pt", weights_only=False)
        for name in ("topk", "powersgd"):
            after = r[name]["after"]
            assert r[name]["events"] == [(6, None)], name
            # the skipped step 6 (7 steps done) leaves residuals (and PowerSGD's Qs) exactly as after step 5 ...
            _assert_state_equal(after[7]["compressor"], after[6]["compressor"], f"{name} rank {rank}")
            # ... while normal steps change them (the comparison can fail)
            with pytest.raises(AssertionError):
                _assert_state_equal(after[6]["compressor"], after[5]["compressor"], name)
        diloco = r["diloco"]
        assert diloco["events"] == [(6, 4)]  # snapshot 6 is too new (rollback_min_age=1): 4 is restored
        # outer parameters, momentum and schedule as at the snapshot (4 steps: one sync done, at step 3); the count of
        # syncs made stays 2 (comm/syncs; the sync at step 6 sent its bytes: a rollback does not un-send them)
        restored = {**diloco["after"][7]["local_update"], "num_syncs": 1}
        _assert_state_equal(restored, diloco["after"][4]["local_update"], f"rank {rank}")
        assert diloco["after"][4]["local_update"]["num_syncs"] == 1
        assert diloco["after"][6]["local_update"]["num_syncs"] == diloco["after"][7]["local_update"]["num_syncs"] == 2


def _local_update_fits(rank: int, root: str) -> None:
    """A NaN loss on rank 1 only under local updates, where gradients are not all-reduced (so only rank 1's
    grads are NaN): local SGD with ``skip`` mid-period, DiLoCo with ``rollback`` on a sync step."""
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.schedules import cosine_scheduler
    from lit_dtrain.strategies import CompressedDDPStrategy
    from tests.faults import PoisonLossAtStep

    class Record(L.Callback):
        def __init__(self):
            self.local_loss, self.params, self.syncs = {}, {}, {}

        def on_before_backward(self, trainer, pl_module, loss):
            self.local_loss[trainer.global_step] = float(loss.detach())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.params[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.syncs[trainer.global_step] = trainer.strategy.local_update.num_syncs

    def fit(action: str, nan_step: int, local_update: dict):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32))
        lit = LitLLM(model, optimizer=partial(adamw, lr=3e-3),
                     scheduler=partial(cosine_scheduler, total_steps=40, warmup_steps=2))
        monitor, record = LossSpikeMonitor(actions=["log", action], warmup_steps=3, snapshot_every=2), Record()
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=9, logger=False, enable_checkpointing=False,
                            # a rank left waiting fails the run after 30 s instead of the default 30 min
                            strategy=CompressedDDPStrategy(local_update=local_update, collective_timeout_s=30,
                                                           log_comm_metrics=False),
                            callbacks=[PoisonLossAtStep(nan_step, rank=1), monitor, record], enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, default_root_dir=root)
        trainer.fit(lit, datamodule=_data(root))
        return {"global_step": trainer.global_step, "num_spikes": monitor.num_spikes,
                "events": [(e["step"], e["actions"], e["reasons"], e["rolled_back_to"]) for e in monitor.events],
                "local_loss": record.local_loss, "params": record.params, "syncs": record.syncs}

    results = {
        # local SGD syncs after steps 2, 5, 8: step 4 is mid-period, where the ranks' parameters differ
        "local_sgd": fit("skip", 4, {"name": "local_sgd", "sync_period": 3}),
        # DiLoCo's outer step falls on step 5 itself (lr/momentum 0.5: the defaults overshoot at H = 3)
        "diloco": fit("rollback", 5, {"name": "diloco", "sync_period": 3, "outer_lr": 0.5, "outer_momentum": 0.5}),
    }
    torch.save(results, os.path.join(root, f"local_rank{rank}.pt"))


def test_nan_on_one_rank_under_local_updates_same_decision_on_both(fitted: Path) -> None:
    """Under local SGD / DiLoCo only rank 1's gradients are NaN, yet the monitor's all-reduced loss makes both
    ranks drop the step: neither waits for the other (a one-sided decision would leave a rank blocked in the next
    collective until the 30 s timeout), both end after the same steps and syncs with identical parameters."""
    r0, r1 = (torch.load(fitted / f"local_rank{r}.pt", weights_only=False) for r in (0, 1))
    for name, nan_step, action, rolled_back_to in (("local_sgd", 4, "skip", None), ("diloco", 5, "rollback", 4)):
        a, b = r0[name], r1[name]
        assert a["global_step"] == b["global_step"] == 9, name  # both ranks trained to the end
        assert math.isnan(b["local_loss"][nan_step]) and math.isfinite(a["local_loss"][nan_step]), name
        assert a["events"] == b["events"], name
        assert [(s, acts, rb) for s, acts, _, rb in a["events"]] == [(nan_step, ["log", action], rolled_back_to)]
        assert "nonfinite_loss" in a["events"][0][2], name
        assert a["num_spikes"] == b["num_spikes"] == 1, name  # the same number of dropped steps
        assert a["syncs"] == b["syncs"], name  # the same syncs at the same steps
        for k, v in a["params"][9].items():  # synchronized at the last step: identical, and no NaN got in
            assert torch.equal(v, b["params"][9][k]) and torch.isfinite(v).all(), (name, k)
    for r in (r0, r1):  # each rank's dropped step left its own (rank-local) parameters as they were
        params = r["local_sgd"]["params"]
        for k, v in params[5].items():
            assert torch.equal(v, params[4][k]), k
        params = r["diloco"]["params"]  # rolled back to its own snapshot of step 4 (after the outer step of 5)
        for k, v in params[6].items():
            assert torch.equal(v, params[4][k]), k
        assert (r["diloco"]["syncs"][4], r["diloco"]["syncs"][6]) == (1, 2)  # the sync made at step 6 stays counted
    # mid-period the ranks' parameters really differ (the checks above compare rank-local states)
    assert not torch.equal(r0["local_sgd"]["params"][4]["model.tok_embeddings.weight"],
                           r1["local_sgd"]["params"][4]["model.tok_embeddings.weight"])
