"""lit_dtrain's callbacks in a user's own Lightning project under 2-process DDP (gloo, CPU, 127.0.0.1).

The user's project is not lit_dtrain's: its own GPT-like module whose blocks are ``transformer.h`` (not ``blocks``),
a ``training_step`` that returns a bare loss, its own AdamW, its own ``DataLoader`` of dict samples (Lightning adds
the DistributedSampler), Lightning's ``Trainer(strategy="ddp")`` and ``ckpt_path``; no ``train()``, no Hydra.
Checked: no rank hangs, both ranks hold the same weights after every step, a spike on one rank (and on both) gets the
same action on both, and a resume from the user's checkpoint continues every callback (and the weights) exactly."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.dist._foreign_project_jobs import Regression, _flat, _lm_data, _worker

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    from tests.conftest import make_corpus

    root = tmp_path_factory.mktemp("foreign")
    for name in ("user", "fourier", "uneven", "preempt", "agreement"):
        (root / name).mkdir()
    make_corpus(root / "fourier" / "corpus", n_files=4, size=2000)
    _lm_data(str(root / "fourier")).prepare_data()  # the token cache, built once before the ranks start
    mp.spawn(_worker, args=(free_port(), str(root)), nprocs=2, join=True)
    return root


@pytest.mark.slow
def test_user_project_callbacks_under_ddp(fitted: Path) -> None:
    root = fitted / "user"
    r0, r1 = (torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for name in ("straight", "both", "resumed"):
        a, b = r0[name], r1[name]
        assert a["global_step"] == b["global_step"]
        assert a["events"] == b["events"], name
        for step, params in a["params"].items():  # the ranks hold the same weights after every step
            for k, v in params.items():
                assert torch.equal(v, b["params"][step][k]), (name, step, k)
    straight, resumed = r0["straight"], r0["resumed"]
    print(straight["events"], r0["both"]["events"], resumed["events"], straight["states"])
    # the spike on one rank's batch was skipped on both, and its samples skipped again in the next epoch
    assert [(s, a) for s, a, _ in straight["events"]] == [(5, ["log", "skip", "lr_cooldown"]), (9, ["skip"]),
                                                          (10, ["log", "skip", "lr_cooldown"]), (12, ["skip"])]
    # the resume from the user's own ModelCheckpoint at step 8 continues every callback, and the weights, exactly
    assert resumed["events"] == straight["events"][1:]
    assert resumed["lr"] == straight["lr"]
    for step in range(9, 15):
        for k, v in resumed["params"][step].items():
            assert torch.equal(v, straight["params"][step][k]), (step, k)
    assert _flat(resumed["states"]) == _flat(straight["states"])
    # the loggers' rows, written by rank 0: one LR row per optimizer step, the spike and throughput metrics beside it
    rows = list(csv.DictReader((root / "straight" / "version_0" / "metrics.csv").open()))
    keys = ("lr-AdamW", "spike/count", "train/samples")
    steps_with = {k: sorted({int(r["step"]) for r in rows if r[k]}) for k in keys}
    assert steps_with == {k: list(range(14)) for k in steps_with}
    assert sum(1 for r in rows if r["lr-AdamW"]) == 14
    both = r0["both"]
    assert [(s, a) for s, a, _ in both["events"]] == [(5, ["log", "rollback"])]
    for k, v in both["params"][6].items():  # rolled back to the snapshot of step 4, on both ranks
        assert torch.equal(v, both["params"][4][k]), k


def test_user_lm_with_fourier_sampler_under_ddp(fitted: Path) -> None:
    root = fitted / "fourier"
    r0, r1 = (torch.load(root / f"fourier{r}.pt", weights_only=False) for r in (0, 1))
    for name in ("straight", "resumed"):
        a, b = r0[name], r1[name]
        assert a["sampler"] == b["sampler"], name  # the same tables on both ranks
        assert a["events"] == b["events"] and a["monitor"] == b["monitor"], name
        for step, indices in a["indices"].items():  # each rank its own share of the global batch
            assert not set(indices) & set(b["indices"][step]), (name, step)
        for step, params in a["params"].items():
            for k, v in params.items():
                assert torch.equal(v, b["params"][step][k]), (name, step, k)
    straight, resumed = r0["straight"], r0["resumed"]
    print(straight["events"], straight["sampler"].keys() if isinstance(straight["sampler"], dict) else None)
    assert [(s, a) for s, a, _ in straight["events"]] == [(5, ["log", "skip"])]
    assert resumed["events"] == straight["events"]
    for step in range(5, 9):  # the resumed run draws the same batches and trains to the same weights
        assert resumed["indices"][step - 1] == straight["indices"][step - 1], step
        for k, v in resumed["params"][step].items():
            assert torch.equal(v, straight["params"][step][k]), (step, k)
    assert resumed["sampler"] == straight["sampler"]
    assert resumed["monitor"] == straight["monitor"]


def test_spike_on_ranks_with_unequal_batches_excludes_exactly_their_samples(fitted: Path) -> None:
    """The spike's samples are gathered from ranks whose batches differ in size. Before, the all-gather of unequal
    tensors gave rank 0 an index that was not in the batch (0) and aborted rank 1 in gloo ("Received data size
    doesn't match expected size")."""
    root = fitted / "uneven"
    r0, r1 = (torch.load(root / f"uneven{r}.pt", weights_only=False) for r in (0, 1))
    assert r0 == r1
    assert r0["events"] == [(4, [16, 17, 116])]  # rank 0's last batch (2 samples), rank 1's (1 sample)
    assert r0["excluded"] == [12, 13, 14, 15, 16, 17, 112, 113, 114, 115, 116]  # and the previous step's


def test_sigterm_to_one_rank_of_a_users_project_saves_and_resumes_exactly(fitted: Path) -> None:
    root = fitted / "preempt"
    r0, r1 = (torch.load(root / f"preempt{r}.pt", weights_only=False) for r in (0, 1))
    for r in (r0, r1):  # both ranks stopped at the end of the signalled step, after the save
        assert (r["signalled"]["stopped"], r["signalled"]["step"]) == ("SIGTERMException", 4)
        assert r["resumed"]["stopped"] is None and r["resumed"]["step"] == 12
        assert r["resumed"]["params"] == r["straight"]["params"] == r0["straight"]["params"]
        assert r["resumed"]["states"] == r["straight"]["states"]
    assert (root / "preempt" / "last.ckpt").is_file()


def test_under_ddp_spawn_the_launching_process_keeps_the_callbacks_state_from_before_fit(tmp_path: Path) -> None:
    """What docs/callbacks_in_your_project.md says of ``ddp_spawn``: the ranks train in child processes and Lightning
    hands back only the weights, so the callback objects here keep their pre-fit state; the run's files hold it.

    A child that aborts at its exit after the fit (SIGABRT, "terminate called without an active exception" from
    torch's gloo teardown: 2 of 4 full CI runs, never alone or in its file here) is tried again, twice at most, with
    fresh objects; every assertion holds for the attempt that completes."""
    from torch.multiprocessing import ProcessExitedException
    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import LossSpikeMonitor, WSDScheduler

    for attempt in range(3):
        root = tmp_path / f"attempt{attempt}"
        g = torch.Generator().manual_seed(0)
        data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g), "index": i} for i in range(32)]
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=2)
        wsd = WSDScheduler(total_steps=6, decay_steps=2)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=6, callbacks=[monitor, wsd],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(root))
        try:
            trainer.fit(Regression(spike_at=(4, 1)), train_dataloaders=DataLoader(data, batch_size=4))
            break
        except ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
    assert (monitor.events, monitor.num_spikes, wsd.last_step, trainer.global_step) == ([], 0, -1, 0)
    records = (root / "spikes.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [4]  # written by rank 0's child


USER_SCRIPT = '''
import os, sys, time
import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader
from lit_dtrain.callbacks import PreemptionCheckpoint
from tests.dist._foreign_project_jobs import Regression

class Slow(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.1)
        if trainer.global_step == 3:
            print(f"READY {trainer.global_rank}", flush=True)

if __name__ == "__main__":
    root, catch = sys.argv[1], sys.argv[2] == "catch"
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)} for _ in range(64)]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=300, logger=False,
                        callbacks=[Slow(), PreemptionCheckpoint(dirpath=root)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    try:
        trainer.fit(Regression(), train_dataloaders=DataLoader(data, batch_size=4))
    except SIGTERMException:
        print(f"STOPPED {trainer.global_rank} {trainer.global_step}", flush=True)
        if catch:
            sys.exit(143)
        raise
'''


@pytest.mark.parametrize("catch", [False, True])
def test_sigterm_to_the_script_lightning_launched_from_stops_both_ranks(tmp_path: Path, catch: bool) -> None:
    """A user's ``python script.py`` with ``Trainer(strategy="ddp", devices=2)``: Lightning starts rank 1 from rank 0.
    SIGTERM to that process: both ranks save ``last.ckpt`` and stop; the script exits with 0 (Lightning's
    ``SIGTERMException`` has no code), or with 143 where it catches it, as docs/callbacks_in_your_project.md says."""
    import signal
    import subprocess
    import time

    from tests.conftest import PYTHON, subprocess_env

    script = tmp_path / "user_train.py"
    script.write_text(USER_SCRIPT)
    env = subprocess_env(tmp_path)
    env.update(MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([PYTHON, str(script), str(tmp_path), "catch" if catch else "raise"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "READY 0" in line:  # (rank 1's line may share it)
                proc.send_signal(signal.SIGTERM)
                break
        out, _ = proc.communicate(timeout=120)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines)
    stopped = sorted(re.findall(r"STOPPED (\d) (\d+)", text))  # (the ranks share stdout: lines may interleave)
    assert [rank for rank, _ in stopped] == ["0", "1"], text[-3000:]
    assert stopped[0][1] == stopped[1][1] and 3 <= int(stopped[0][1]) < 300  # the same step, long before the end
    assert proc.returncode == (143 if catch else 0), text[-3000:]
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == int(stopped[0][1])


def test_a_sigterm_during_the_ranks_agreement_is_kept_for_the_next_step(fitted: Path) -> None:
    """The handler of a SIGTERM that came while ``PreemptionCheckpoint`` waited in its all-reduce runs when that
    returns, after the rank had read its flag: the flag was then overwritten with the agreed "no", and the run trained
    on to ``max_steps`` without a checkpoint (2 of 3 runs of a user's script signalled at a step's end, by hand). Now
    the next step's agreement carries it: both ranks save at step 4 and stop."""
    root = fitted / "agreement"
    for rank in (0, 1):
        result = torch.load(root / f"agreement{rank}.pt", weights_only=False)
        assert result == {"stopped": "SIGTERMException", "step": 4}, rank
    assert torch.load(root / "last.ckpt", weights_only=False)["global_step"] == 4
