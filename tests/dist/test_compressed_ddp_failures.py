"""2-process gloo tests of CompressedDDPStrategy under Lightning that run their own fits: hook registration on CPU
and logged metrics, config errors, a NaN on one rank, a peer that dies, a failure caught in an earlier fit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.strategies import CompressedDDPStrategy
from tests.dist._compressed_ddp_helpers import WORLD, TinyModule, as_launched_rank, dumps, fit, run_rank_processes

pytestmark = pytest.mark.dist


def test_lightning_registers_hook_on_cpu_gloo_and_logs_comm_metrics(tmp_path):
    trainer = fit(tmp_path, "sign", max_steps=3, compressor="sign")
    for d in dumps(tmp_path, "sign", "end"):
        assert d["device"] == "cpu" and d["backend"] == "gloo"
        assert d["compressor"]["num_calls"] >= 3  # Lightning's own DDPStrategy would have skipped the hook on CPU
        assert d["compressor"]["residuals"]  # error feedback kept residuals
    m = trainer.callback_metrics
    assert m["comm/compression_ratio"] > 20  # ~32x minus per-parameter scales
    assert m["comm/bytes_per_step"] > 0 and m["comm/time_ms"] >= 0


def test_strategy_registry_and_config_errors():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "ddp_compressed" in StrategyRegistry
    strategy = StrategyRegistry.get("ddp_compressed")
    assert isinstance(strategy, CompressedDDPStrategy) and strategy.compressor.name == "powersgd"
    with pytest.raises(ValueError, match="local-update rule skips"):
        CompressedDDPStrategy(compressor="topk", local_update="local_sgd")
    with pytest.raises(ValueError, match="remove ddp_comm_hook"):
        CompressedDDPStrategy(ddp_comm_hook=lambda s, b: None)


def _nan_one_rank_worker(rank: int, port: int, root: str, local_update: dict, monitor: bool) -> None:
    """Rank 1's loss is NaN after 4 steps under a local-update rule (no per-step gradient all-reduce, so only rank 1's
    gradients are NaN and only rank 1's LitLLM raises NonFiniteError). Records what each rank raised, and when."""
    import os
    from functools import partial

    as_launched_rank(rank, port)
    from lit_dtrain.callbacks import LossSpikeMonitor
    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from tests.faults import PoisonLossAtStep

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 257, (64, 17), generator=g)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    torch.manual_seed(0)
    lit = LitLLM(Llama(LlamaConfig(block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)),
                 optimizer=partial(adamw, lr=1e-3))
    callbacks = [PoisonLossAtStep(4, rank=1)] + ([LossSpikeMonitor(actions=["log"], warmup_steps=2)] if monitor else [])
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=12, logger=False, enable_checkpointing=False,
                        strategy=CompressedDDPStrategy(local_update=local_update, collective_timeout_s=30,
                                                       log_comm_metrics=False),
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root)
    outcome = {"type": None, "message": None}
    try:
        trainer.fit(lit, train_dataloaders=DataLoader(data, batch_size=2))
    except BaseException as e:  # noqa: BLE001 - record what this rank raised
        outcome = {"type": type(e).__name__, "message": str(e)}
    outcome["time"] = time.time()
    torch.save(outcome, Path(root) / f"nan_one_rank{rank}.pt")
    os._exit(0)  # not mp.spawn's join: it would kill the surviving rank as soon as rank 1 failed


@pytest.mark.slow
@pytest.mark.parametrize(("name", "monitor"), [("local_sgd", False), ("diloco", True)])
def test_nan_on_one_rank_under_local_updates_names_the_cause_on_the_other(tmp_path, name, monitor):
    """Rank 1 stops with NonFiniteError at step 4; rank 0's next collective (the monitor's all-reduce, or the sync)
    then fails. Its error must say that rank 1 stopped and why, not only gloo's 'Connection closed by peer'."""
    spec = {"name": name, "sync_period": 3}
    run_rank_processes(_nan_one_rank_worker, str(tmp_path), spec, monitor)
    r0, r1 = (torch.load(tmp_path / f"nan_one_rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert r1["type"] == "NonFiniteError" and "step 4" in r1["message"], r1
    assert r0["type"] is not None, r0  # the survivor failed too ...
    assert r0["time"] - r1["time"] < 20, (r0, r1)  # ... at once, not after the 30 s collective timeout
    message = r0["message"]
    assert "rank 1 stopped" in message and "NonFiniteError" in message, message
    assert "non-finite gradients at step 4" in message, message


class _FailAt(TinyModule):
    """TinyModule that fails at ``step``: raises ``ValueError`` (``how="raise"``), or exits the process with no error
    recorded (``how="exit"``: as a rank killed by the OOM killer or a signal would)."""

    def __init__(self, dump_dir: str, tag: str, step: int, how: str) -> None:
        super().__init__(dump_dir, tag)
        self.fail_step, self.how = step, how

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_step and self.how == "raise":
            raise ValueError(f"planned failure of {self.tag}")
        if self.global_step == self.fail_step and self.how == "exit":
            os._exit(3)
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        pass

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass

    def on_train_end(self) -> None:
        pass


def _fits_worker(rank: int, port: int, root: str, plan: list[tuple[str, dict]], compressor: str) -> None:
    """Fits in sequence in one process group (the group outlives a fit); ``plan`` is ``[(tag, {rank: how})]`` with
    ``how`` as in :class:`_FailAt`, failing at step 2. Each outcome is caught (as a caller that goes on would) and
    recorded."""
    as_launched_rank(rank, port)
    outcomes = []
    for tag, how in plan:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=WORLD,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            strategy=CompressedDDPStrategy(compressor=compressor, collective_timeout_s=30, log_comm_metrics=False),
        )
        try:
            trainer.fit(_FailAt(root, tag, step=2, how=how.get(rank)))
            outcomes.append({"type": None, "message": None, "step": trainer.global_step})
        except Exception as e:  # noqa: BLE001 - the caller catches the failure and goes on
            outcomes.append({"type": type(e).__name__, "message": str(e), "step": trainer.global_step})
        torch.save(outcomes, Path(root) / f"fits_rank{rank}.pt")
    os._exit(0)


def run_fits(tmp_path: Path, plan: list[tuple[str, dict]], compressor: str = "sign") -> list[list[dict]]:
    """Each rank's outcomes of :func:`_fits_worker`."""
    run_rank_processes(_fits_worker, str(tmp_path), plan, compressor)
    paths = [tmp_path / f"fits_rank{r}.pt" for r in range(WORLD)]  # none: the rank exited in its first fit
    return [torch.load(path, weights_only=False) if path.exists() else [] for path in paths]


@pytest.mark.parametrize("compressor", ["sign", "int8", "int8_rs"])
def test_a_gather_codec_fails_when_a_peer_dies_instead_of_reading_garbage(tmp_path, compressor):
    """Rank 1 exits at step 2 with no error recorded (as a killed rank). Rank 0's next all_gather must fail and say
    that a peer stopped; before, the Communicator never read the all_gather's result, so its error was dropped and
    rank 0 decoded the uninitialized output buffer as rank 1's payload and finished all 6 steps. (``int8_rs``: its
    blocking all_to_all comes first and must fail the same way.)"""
    r0, r1 = run_fits(tmp_path, [("fit", {1: "exit"})], compressor)
    assert r1 == []  # rank 1 exited in the fit
    (outcome,) = r0
    assert outcome["type"] == "PeerRankFailedError" and outcome["step"] == 2, outcome
    assert "without a recorded error" in outcome["message"], outcome["message"]


@pytest.mark.parametrize("second", ["exit", "raise"])
def test_a_caught_failure_of_an_earlier_fit_is_not_blamed_for_a_later_one(tmp_path, second):
    """Two fits in one process group: in the first both ranks raise at step 2 and the caller catches it; in the
    second rank 1 exits at step 2 without a recorded error, or raises another error alone. Rank 0 must not name the
    first fit's ValueError (still in the store) as the cause of the second failure, and must name the second's."""
    r0, r1 = run_fits(tmp_path, [("fit1", {0: "raise", 1: "raise"}), ("fit2", {1: second})])
    assert [o["type"] for o in r1] == ["ValueError"] * (1 if second == "exit" else 2), r1
    assert r0[0]["type"] == "ValueError" and "planned failure of fit1" in r0[0]["message"], r0
    assert r0[1]["type"] == "PeerRankFailedError" and r0[1]["step"] == 2, r0
    message = r0[1]["message"]
    assert "fit1" not in message, message
    if second == "exit":
        assert "without a recorded error" in message, message
    else:
        assert "rank 1 stopped at step 2: ValueError: planned failure of fit2" in message, message
