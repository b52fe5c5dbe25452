"""2-process gloo tests of resuming CompressedDDPStrategy runs: exact resume of the comm state, a plain-DDP resume
of a compressed checkpoint, a resume on another number of ranks. Their fits run in one pair of launched rank
processes (module fixture ``resume_fits``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy
from tests.dist._compressed_ddp_helpers import (
    WORLD,
    _one_group_worker,
    assert_same,
    dumps,
    fit,
    fit_in_one_group,
    fitted,
    run_rank_processes,
)

pytestmark = pytest.mark.dist


RESUME_RUNS = {
    "powersgd": {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2}},
    # on 3 ranks gloo's all-reduce sums in an order that depends on a value's place in the bucket; the first step
    # after a start runs on DDP's initial bucket, so it must be reduced as the saved buckets were (2 of 4 KB)
    "powersgd_3_ranks": {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2},
                         "bucket_cap_mb": 0.004},
    # several DDP buckets (4 KB: TinyModule's 10.6 KB of gradients make 2 after DDP's rebuild): the first step
    # after a start runs on DDP's initial single bucket, where top-k used to select across the bucket boundary
    "topk_buckets": {"compressor": {"name": "topk", "ratio": 0.05}, "bucket_cap_mb": 0.004},
    "int8": {"compressor": {"name": "int8", "error_feedback": True, "block_size": 64}},
    # reduce-scatter int8: each rank's share of the mean and its error ("server residual") must come back too;
    # stochastic rounding: the second rounding's noise too (drawn by the share's owner)
    "int8_rs": {"compressor": {"name": "int8_rs", "error_feedback": True, "block_size": 64,
                               "stochastic_rounding": True}},
    # stochastic rounding: its noise must not depend on the bucket layout, which differs after a start
    "int8_sr": {"compressor": {"name": "int8", "error_feedback": True, "block_size": 64,
                               "stochastic_rounding": True}},
    "diloco": {"local_update": {"name": "diloco", "sync_period": 2,
                                "compressor": {"name": "int4", "error_feedback": True}}},
    "local_sgd": {"local_update": {"name": "local_sgd", "sync_period": 3}},  # step 4: mid-period
}


def _fit_straight_and_resumed(tmp: Path, name: str, world: int = WORLD, spawn: bool = False) -> None:
    """8 steps straight, checkpointing every 4; then 8 steps resumed from the straight run's step-4 checkpoint (in
    launched ranks, or each fit through Lightning's spawn launcher)."""
    fit(tmp, "straight", max_steps=8, world=world, spawn=spawn, **RESUME_RUNS[name])
    fit(tmp, "resumed", max_steps=8, ckpt_path=str(tmp / "straight" / "step=4.ckpt"), world=world, spawn=spawn,
        **RESUME_RUNS[name])


def _fit_straight_and_resumed_3_ranks(tmp: Path, name: str) -> None:
    _fit_straight_and_resumed(tmp, name, world=3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["powersgd", "int8", "int8_sr", "int8_rs", "diloco", "local_sgd", "topk_buckets",
                                  "powersgd_3_ranks"])
def test_resume_restores_comm_state_exactly(request, tmp_path, name):
    world = 3 if name.endswith("_3_ranks") else WORLD
    if world == WORLD:  # the 2-rank runs are fitted together, in one process group
        tmp = fitted(request.getfixturevalue("resume_fits"), _fit_straight_and_resumed, name)
    else:  # 3 launched ranks, both fits in one group (Lightning's spawn launcher started 3 Pythons per fit)
        jobs = [(_fit_straight_and_resumed_3_ranks, name)]
        run_rank_processes(_one_group_worker, str(tmp_path), jobs, world, timeout=900, world=world)
        tmp = fitted(tmp_path, _fit_straight_and_resumed_3_ranks, name, world)
    saved = torch.load(tmp / "straight" / "step=4.ckpt", weights_only=True)[CHECKPOINT_KEY]
    at4 = dumps(tmp, "straight", "step4", world)
    start = dumps(tmp, "resumed", "start", world)
    for r in range(world):
        # the checkpoint holds every rank's state as it was at step 4, and each rank got its own back
        assert_same(saved["per_rank"][r]["compressor"], at4[r]["compressor"], f"rank{r} saved")
        assert_same(start[r]["compressor"], at4[r]["compressor"], f"rank{r} restored")
        assert_same(start[r]["counters"], at4[r]["counters"], f"rank{r} counters")
        assert_same(start[r]["local_update"], at4[r]["local_update"], f"rank{r} local update")
        assert_same(start[r]["local_update_rank"], at4[r]["local_update_rank"], f"rank{r} local residual")
    end_straight, end_resumed = dumps(tmp, "straight", "end", world), dumps(tmp, "resumed", "end", world)
    for r in range(world):
        # every rank resumes from its own parameters and optimizer state, not rank 0's: the resumed run
        # reproduces the straight one bit for bit (before, local updates restarted all ranks from rank 0's)
        assert_same(start[r]["params"], at4[r]["params"], f"rank{r} params at resume")
        assert_same(end_resumed[r]["params"], end_straight[r]["params"], f"rank{r} params after resume")
    if name == "local_sgd":  # the checkpoint fell between syncs, where the ranks' parameters differ
        assert not torch.equal(at4[0]["params"]["0.weight"], at4[1]["params"]["0.weight"])
    if name == "diloco":
        assert start[0]["local_update"]["num_syncs"] == 2 and start[0]["local_update"]["outer_params"]
        assert start[0]["local_update_rank"]["residuals"] != {}  # the int4 pseudo-gradient residual
        assert not torch.equal(start[0]["local_update_rank"]["residuals"]["net.0.weight"],
                               start[1]["local_update_rank"]["residuals"]["net.0.weight"])  # rank-local
    elif name in ("powersgd", "int8", "int8_sr", "int8_rs", "topk_buckets", "powersgd_3_ranks"):
        assert not torch.equal(start[0]["compressor"]["residuals"]["net.0.weight"],
                               start[1]["compressor"]["residuals"]["net.0.weight"])  # rank-local
        assert_same(end_resumed[1]["compressor"], end_straight[1]["compressor"], "compressor after resume")
        if name == "int8_rs":
            assert start[0]["compressor"]["server_residuals"] and start[1]["compressor"]["server_residuals"]
        if name == "powersgd_3_ranks":  # the resumed run's first bucket held the 2 saved ones
            assert len(saved["per_rank"][0]["counters"]["bucket_layout"]) == 2


def _fit_plain_resumes(root: Path, key: str) -> None:
    """Write a compressed checkpoint at step 4, resume it with plain DDP (``make_ddp``, as ``strategy=ddp`` does)
    and with the same compressed strategy; record every rank's warnings about the resume."""
    import warnings
    from functools import partial

    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.optim import adamw
    from lit_dtrain.strategies import make_ddp

    rank = int(os.environ["RANK"])  # as_launched_rank's
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 257, (64, 17), generator=g)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]

    def fit(strategy, max_steps: int, tag: str, ckpt_path: str | None = None) -> list[str]:
        torch.manual_seed(0)
        lit = LitLLM(Llama(LlamaConfig(block_size=16, n_layer=1, n_head=2, n_kv_head=1, d_model=16)),
                     optimizer=partial(adamw, lr=1e-3))
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, max_steps=max_steps, strategy=strategy, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=Path(root) / tag, filename="{step}",
                                                                           every_n_train_steps=4, save_top_k=-1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(lit, train_dataloaders=DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
        return [str(w.message) for w in caught if CHECKPOINT_KEY in str(w.message)]

    results = {}
    for name, kwargs in (("powersgd", {"compressor": {"name": "powersgd", "matrix_approximation_rank": 2}}),
                         ("local_sgd", {"local_update": {"name": "local_sgd", "sync_period": 3}})):  # 4: mid-period
        fit(CompressedDDPStrategy(log_comm_metrics=False, **kwargs), 5, name)  # not 4: the last step syncs
        ckpt = str(Path(root) / name / "step=4.ckpt")
        results[name] = {
            "plain": fit(make_ddp(collective_timeout_s=60), 6, f"{name}_plain", ckpt),
            "same": fit(CompressedDDPStrategy(log_comm_metrics=False, **kwargs), 6, f"{name}_same", ckpt),
        }
    torch.save(results, Path(root) / f"plain_resume_rank{rank}.pt")


@pytest.mark.slow
def test_plain_ddp_resume_of_a_compressed_checkpoint_warns_what_it_drops(resume_fits):
    """``strategy=ddp`` on a checkpoint of ``strategy=ddp_compressed/...`` is legitimate (a decay branch), but it
    drops the error-feedback residuals (PowerSGD) or every rank's own parameters and optimizer state (local SGD,
    here mid-period): rank 0 warns once, naming the preset and the state, and a same-preset resume does not."""
    tmp = fitted(resume_fits, _fit_plain_resumes, "powersgd_and_local_sgd")
    r0, r1 = (torch.load(tmp / f"plain_resume_rank{r}.pt", weights_only=False) for r in range(WORLD))
    for name in ("powersgd", "local_sgd"):
        assert r1[name]["plain"] == [], name  # rank-zero only
        assert r0[name]["same"] == r1[name]["same"] == [], name  # the compressed strategy restores it all
        (message,) = r0[name]["plain"]
        assert f"strategy=ddp_compressed/{name}" in message and "DDPStrategy" in message, message
        assert "2 ranks" in message, message
    powersgd = r0["powersgd"]["plain"][0]
    assert "error-feedback residuals" in powersgd and "PowerSGD Q matrices" in powersgd, powersgd
    local_sgd = r0["local_sgd"]["plain"][0]
    assert "1 step since the last sync" in local_sgd and "rank 0's parameters" in local_sgd, local_sgd


ELASTIC = ("int8", "powersgd", "local_sgd", "diloco")  # codecs of RESUME_RUNS resumed on another number of ranks


def _expected_elastic(saved: dict, name: str) -> dict:
    """What every rank of a resume on another world size takes of ``saved`` (the checkpoint's comm state): rank 0's
    codec state with the mean of the ranks' residuals; for local updates the mean of their parameters."""
    ranks = saved["per_rank"]

    def mean(get):
        held = [get(r) for r in ranks]
        return {n: sum((h[n] for h in held[1:]), held[0][n].clone()).div(len(held)) for n in held[0]}

    out = {"counters": ranks[0]["counters"]}
    for key in ("compressor", "local_update"):
        if ranks[0][key] is not None:
            out[key] = {**ranks[0][key], "residuals": mean(lambda r, key=key: r[key]["residuals"])}
    if name in ("local_sgd", "diloco"):
        out["params"] = mean(lambda r: r["params"])
    return out


def _fit_elastic_up(tmp: Path, name: str) -> None:
    """Resume on 2 ranks the straight fit's step-4 checkpoint cut to rank 0's entry, as one process writes it."""
    import warnings

    rank = int(os.environ["RANK"])
    ckpt = torch.load(tmp.parent / f"_fit_straight_and_resumed_{name}" / "straight" / "step=4.ckpt", weights_only=True)
    ckpt[CHECKPOINT_KEY] = {**ckpt[CHECKPOINT_KEY], "world_size": 1, "per_rank": ckpt[CHECKPOINT_KEY]["per_rank"][:1]}
    path = tmp / f"one_rank{rank}.ckpt"
    torch.save(ckpt, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp, "up", max_steps=6, ckpt_path=str(path), spawn=False, **RESUME_RUNS[name])
    said = [str(w.message) for w in caught if "written on" in str(w.message)]
    torch.save({"one_rank": ckpt[CHECKPOINT_KEY], "loss": float(trainer.callback_metrics["train/loss"]),
                "step": trainer.global_step, "warnings": said}, tmp / f"up_rank{rank}.pt")


def _assert_kept(start: dict, expected: dict, where: str) -> None:
    assert_same(start["counters"], expected["counters"], f"{where} counters")
    for key, dumped in (("compressor", "compressor"), ("local_update", "local_update_rank")):
        if key in expected:
            assert_same(start[dumped], expected[key], f"{where} {key}")
    if "params" in expected:
        assert_same({f"net.{k}": v for k, v in start["params"].items()}, expected["params"], f"{where} params")


@pytest.mark.slow
@pytest.mark.parametrize("name", ELASTIC)
@pytest.mark.usefixtures("no_group_left")
def test_a_resume_on_another_number_of_ranks_keeps_what_it_can_and_says_what_it_drops(resume_fits, tmp_path, name):
    """2 -> 1 (a 1-process fit here) and 1 -> 2 (the 2-rank group): before, 'the checkpoint holds compressor state
    of 2 ranks but this run has 1' refused both. The replicated state is kept exactly, every rank takes the mean of
    the saved residuals (and, under local updates, parameters), rank 0 warns once, and training goes on."""
    import warnings

    tmp = fitted(resume_fits, _fit_straight_and_resumed, name)
    saved = torch.load(tmp / "straight" / "step=4.ckpt", weights_only=True)[CHECKPOINT_KEY]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, "down", max_steps=6, ckpt_path=str(tmp / "straight" / "step=4.ckpt"), world=1,
                      spawn=False, **RESUME_RUNS[name])
    (message,) = [str(w.message) for w in caught if "written on" in str(w.message)]
    assert message.startswith("lit_dtrain_comm: the checkpoint was written on 2 ranks and this run has 1"), message
    (start,) = dumps(tmp_path, "down", "start", world=1)
    _assert_kept(start, _expected_elastic(saved, name), "2 -> 1")
    at4 = dumps(tmp, "straight", "step4")
    assert_same(start["local_update"], at4[0]["local_update"], "2 -> 1 local update")
    assert trainer.global_step == 6 and math.isfinite(trainer.callback_metrics["train/loss"])
    if name in ("int8", "powersgd"):
        assert "compressor error-feedback residuals of 2 ranks are replaced on every rank by their mean" in message
    if name == "local_sgd":  # mid-period: the ranks' parameters differ, each starts from their mean
        assert "mean of the 2 ranks' parameters, which differ 1 step after the last sync" in message, message
        assert "every rank takes rank 0's optimizer state (rank 1's is dropped)" in message, message
    if name == "diloco":  # step 4 is a sync (period 2): the parameters are equal and kept exactly
        assert "parameters" not in message.split("optimizer")[0] and "pseudo-gradient compressor" in message
        assert_same(start["params"], at4[0]["params"], "2 -> 1 synchronized params")

    up = fitted(resume_fits, _fit_elastic_up, name)
    records = [torch.load(up / f"up_rank{r}.pt", weights_only=False) for r in range(WORLD)]
    expected = _expected_elastic(records[0]["one_rank"], name)
    for r, (record, begin) in enumerate(zip(records, dumps(up, "up", "start"), strict=True)):
        _assert_kept(begin, expected, f"1 -> 2 rank{r}")
        assert_same(begin["local_update"], at4[0]["local_update"], f"1 -> 2 rank{r} local update")
        assert record["step"] == 6 and math.isfinite(record["loss"]), record
    assert len(records[0]["warnings"]) == 1 and records[1]["warnings"] == []  # rank 0, once
    assert "written on 1 rank and this run has 2" in records[0]["warnings"][0]
    if name in ("int8", "powersgd"):
        assert "compressor error-feedback residual of 1 rank goes to every rank" in records[0]["warnings"][0]


@pytest.fixture(scope="module")
def resume_fits(tmp_path_factory) -> Path:
    """The straight and resumed fits of every 2-rank variant of test_resume_restores_comm_state_exactly, and the
    plain-DDP resumes of test_plain_ddp_resume_of_a_compressed_checkpoint_warns_what_it_drops."""
    jobs = [(_fit_straight_and_resumed, name) for name in RESUME_RUNS if not name.endswith("_3_ranks")]
    jobs.append((_fit_plain_resumes, "powersgd_and_local_sgd"))  # test_plain_ddp_resume_of_a_compressed_checkpoint_...
    jobs += [(_fit_elastic_up, name) for name in ELASTIC]  # after the straight fits whose checkpoints they cut
    return fit_in_one_group(tmp_path_factory.mktemp("resume"), jobs)
