"""FourierSampler across 2 gloo processes: identical tables, same global batch, disjoint shards."""

from __future__ import annotations

import json
import os
import subprocess
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_dtrain.data.samplers import FourierSampler
from tests.conftest import PYTHON, ROOT, TINY, free_port, leave_rank, make_corpus, subprocess_env

pytestmark = pytest.mark.dist

WORLD, PER_RANK, STEPS, N, T = 2, 4, 6, 40, 64
NAN_STEP = 3  # rank 1's first row of this step has a NaN token loss



def _run(rank: int, async_op: bool, lag: int = 0) -> dict:
    sampler = FourierSampler(async_op=async_op, step_unit=1, lag=lag)  # stages switch bands 4 -> 6 at step 5
    sampler.setup(N, seed=11)
    batches, shards = [], []
    for step in range(STEPS):
        global_batch = sampler.global_batch(step, WORLD * PER_RANK)
        shard = global_batch[rank * PER_RANK : (rank + 1) * PER_RANK]
        g = torch.Generator().manual_seed(1000 * rank + step)  # each rank sees different losses
        loss = torch.rand(PER_RANK, T, generator=g) * (1 + shard[:, None].float() % 5)
        if step == NAN_STEP and rank == 1:
            loss[0, 5] = float("nan")  # one rank's non-finite row: every rank must drop it alike
        stats = sampler.observe(loss, shard, step + 1)
        batches.append(global_batch)
        shards.append(shard)
    return {"state": sampler.state_dict(), "batches": torch.stack(batches), "shards": torch.stack(shards),
            "comm_bytes": stats["comm_bytes"], "probs": sampler.probabilities(STEPS)}


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        runs = {"async": _run(rank, True), "sync": _run(rank, False), "lag": _run(rank, True, lag=1)}
        torch.save(runs, Path(out) / f"rank{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_rank()


@pytest.mark.slow
def test_two_ranks_hold_identical_tables_and_draw_disjoint_shards(tmp_path):
    mp.spawn(partial(_worker), args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for mode in ("async", "sync"):
        check_identical_tables(ranks[0][mode], ranks[1][mode])
    for key in ("m1", "visits", "profile"):  # waiting on the async gather at the next draw changes nothing
        assert torch.equal(ranks[0]["async"]["state"][key], ranks[0]["sync"]["state"][key]), key
    # lag=1: the last step's gathered update is saved unapplied, the same on both ranks; applied (a lag=0 sampler
    # loading the state applies it), the tables hold every step's update, as above
    lagged = [ranks[r]["lag"] for r in range(WORLD)]
    assert lagged[0]["state"]["updates"] == STEPS - 1 and lagged[0]["state"]["pending_steps"] == [STEPS]
    assert torch.equal(lagged[0]["state"]["pending_records"][0], lagged[1]["state"]["pending_records"][0])
    applied = []
    for r in lagged:
        sampler = FourierSampler(step_unit=1)
        sampler.setup(N, seed=11)
        sampler.load_state_dict(r["state"])
        applied.append({**r, "state": sampler.state_dict(), "probs": sampler.probabilities(STEPS)})
    check_identical_tables(*applied)


def check_identical_tables(r0: dict, r1: dict) -> None:
    for key in ("m1", "m2", "visits", "profile", "excluded"):
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    assert r0["state"]["updates"] == r1["state"]["updates"] == STEPS
    assert torch.equal(r0["probs"], r1["probs"])
    assert torch.equal(r0["batches"], r1["batches"])  # the same global batch on both ranks, every step
    for step in range(STEPS):
        gb = r0["batches"][step]
        assert torch.equal(r0["shards"][step], gb[:PER_RANK]) and torch.equal(r1["shards"][step], gb[PER_RANK:])
    # the table holds both ranks' updates: one visit per distinct sample per step
    expected = torch.zeros(N, dtype=torch.int32)
    for step in range(STEPS):
        slots = torch.ones(WORLD * PER_RANK, dtype=torch.bool)
        slots[PER_RANK] = step != NAN_STEP  # the NaN row is not learned from
        expected[torch.unique(r0["batches"][step][slots])] += 1
    assert r0["state"]["nonfinite_skipped"] == r1["state"]["nonfinite_skipped"] == 1
    assert torch.equal(r0["state"]["visits"], expected)
    assert bool((r0["state"]["m1"][expected > 0] > 0).all())
    assert r0["state"]["profile"].dtype == torch.float16
    # bytes handed to the collectives by one rank in one step: fp32 energy + (8 + 4 + 2 * 8) B per sample
    assert r0["comm_bytes"] == 4 + PER_RANK * (8 + 4 + 2 * 8)


class DumpSamplerTables(L.Callback):
    """Test helper: records each rank's shards and global batches, and dumps its sampler state at the end."""

    def __init__(self, out: str) -> None:
        self.out, self.shards, self.batches = Path(out), [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        dm = trainer.datamodule  # the batch was drawn for micro-step dm.micro_step - 1 (pure: redraw it)
        self.batches.append(dm.sampler.global_batch(dm.micro_step - 1, dm.batch_size * trainer.world_size))
        self.shards.append(batch["index"].cpu())

    def on_train_end(self, trainer, pl_module):
        state = trainer.datamodule.sampler.state_dict()
        torch.save({"state": state, "batches": torch.stack(self.batches), "shards": torch.stack(self.shards)},
                   self.out / f"rank{trainer.global_rank}.pt")


# the two callback lists, as configs a sweep can choose between (`+fourier_case=plain,spike`)
CASES = {
    "plain": "# @package _global_\ndefaults:\n  - override /callbacks: [default, fourier_sampler]\n",
    "spike": "# @package _global_\ndefaults:\n  - override /callbacks: [default, loss_spike, fourier_sampler]\n"
             "callbacks:\n  loss_spike:\n    warmup_steps: 3\n"
             "  spike:\n    _target_: tests.unit.test_fourier_sampler_spikes._ScaleLogitsAt\n    step: 4\n",
}


@pytest.fixture(scope="module")
def ddp_jobs(tmp_path_factory) -> dict[tuple[bool, int], Path]:
    """The job dirs, by (spike, lag), of one ``train.py -m ... +fourier_case=plain,spike data.sampler.lag=0,1``
    launch under Lightning DDP (2 gloo ranks; Lightning starts rank 1 once and it runs every job): one launch of two
    processes for the four cases, each job a run of its own (tests only read what the jobs left)."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    corpus = make_corpus(tmp_path / "corpus")
    for name, text in CASES.items():
        (tmp_path / "conf" / "fourier_case").mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / "fourier_case" / f"{name}.yaml").write_text(text)
    env = subprocess_env(tmp_path)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env["PYTHONPATH"]  # the dump callback lives in tests/
    args = ["-m", *TINY, "trainer=ddp_cpu", *[o for o in TINY if o.startswith("trainer.")], "data=textfiles",
            f"data.sources.0.paths=[{corpus}]", "run_name=ddp", "data/sampler=fourier",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+fourier_case=plain,spike", "data.sampler.step_unit=1",
            "data.sampler.lag=0,1", "sample.max_new_tokens=0", f"+callbacks.dump._target_={__name__}.DumpSamplerTables",
            "+callbacks.dump.out=${hydra:runtime.output_dir}"]
    proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "outputs" / "multiruns").iterdir()
    jobs = {}
    for job in (p for p in sweep_dir.iterdir() if p.is_dir()):
        overrides = dict(line.lstrip("- ").split("=", 1)
                         for line in (job / ".hydra" / "overrides.yaml").read_text().splitlines() if "=" in line)
        jobs[overrides["+fourier_case"] == "spike", int(overrides["data.sampler.lag"])] = job
    assert sorted(jobs) == [(False, 0), (False, 1), (True, 0), (True, 1)], jobs
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize(("spike", "lag"), [(False, 0), (True, 0), (False, 1), (True, 1)])
def test_callback_under_lightning_ddp_keeps_tables_identical(ddp_jobs, spike, lag):
    """With ``spike``, a LossSpikeMonitor listed before the callback skips step 4 (logits x50 on both ranks): no rank
    learns from it (the table took 6 updates, the dropped step's included, before the sampler was told by the grads
    the optimizer step saw), and the tables stay identical. With ``lag`` 1 the last step's update is saved unapplied,
the same on both ranks."""
    dump = ddp_jobs[spike, lag]
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["steps"] == 6
    r0, r1 = (torch.load(dump / f"rank{r}.pt", weights_only=True) for r in range(2))
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    assert r0["state"]["updates"] == (5 if spike else 6) - lag and int((r0["state"]["visits"] > 0).sum()) > 4
    assert r0["state"]["pending_steps"] == r1["state"]["pending_steps"] == ([5] if lag else [])
    for a, b in zip(r0["state"]["pending_records"], r1["state"]["pending_records"]):
        assert torch.equal(a, b)
    assert torch.equal(r0["state"]["excluded"], r1["state"]["excluded"])
    assert r0["state"]["excluded"].tolist() == (sorted(set(r0["batches"][4].tolist())) if spike else [])
    assert torch.equal(r0["batches"], r1["batches"])
    per_rank = r0["shards"].shape[1]
    assert torch.equal(r0["shards"], r0["batches"][:, :per_rank])
    assert torch.equal(r1["shards"], r1["batches"][:, per_rank:])
