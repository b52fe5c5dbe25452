"""The reliability matrix (docs/reliability.md): every fault is survived or reported clearly, nothing lost."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.module import NonFiniteError
from lit_dtrain.run_dirs import TRAINING_STARTS
from lit_dtrain.train import train
from tests.conftest import PYTHON, ROOT, TINY, compose_cfg, make_corpus, subprocess_env

MAX_STEPS = 12
RUN = [*TINY, f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
       "sample.max_new_tokens=0"]


def train_proc(tmp_path: Path, corpus: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [PYTHON, str(ROOT / "train.py"), *RUN, "data=textfiles", f"data.sources.0.paths=[{corpus}]", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """``straight_run(*args)`` -> ``(root, run_name)`` of an uninterrupted run of ``train_proc``'s config with ``args``
    (its ``outputs/runs/<run_name>`` under ``root``), trained once per set of ``args`` in this module: the reference run
    that the stopped-and-resumed runs of several tests must end at bitwise (the corpus is the same generated text).
    A single-process run is trained in this process (a ``train.py`` process cost ~5 s of imports for a run of about
    one; the stopped and resumed runs it is compared with are ``train.py`` processes, so the two ways agree); a DDP
    run needs its launcher, and is a ``train_proc``."""
    root = tmp_path_factory.mktemp("straight")
    corpus = make_corpus(root / "corpus")
    done: dict[frozenset, str] = {}

    def straight(*args: str) -> tuple[Path, str]:
        key = frozenset(args)
        if key not in done:
            run = f"straight{len(done)}"
            if any(a.startswith("trainer=ddp") for a in args):
                proc = train_proc(root, corpus, f"run_name={run}", *args)
                assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
            else:
                train(compose_cfg([*RUN, *args], root / "outputs" / "runs" / run, corpus, tiny=False))
            done[key] = run
        return root, done[key]

    return straight


def final_state(tmp_path: Path, run: str) -> dict:
    ckpt = torch.load(tmp_path / "outputs" / "runs" / run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == MAX_STEPS
    return ckpt


def tb_scalars(tmp_path: Path, run: str, tag: str = "train/loss") -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it: all event files of the run, orphans purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "outputs" / "runs" / run / "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_tags(tmp_path: Path, run: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run as TensorBoard shows it: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "outputs" / "runs" / run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    state_a, state_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert state_a.keys() == state_b.keys() and state_a  # every parameter's AdamW state: exp_avg, exp_avg_sq, step
    for i in state_a:
        assert state_a[i].keys() == state_b[i].keys(), i
        for k in state_a[i]:
            assert torch.equal(torch.as_tensor(state_a[i][k]), torch.as_tensor(state_b[i][k])), (i, k)


# Extra overrides that switch on every stateful callback and sampler (extended as techniques land).
STATEFUL: list[str] = [
    "callbacks=[default,loss_spike,adaptive_grad_clip,optimizer_diagnostics,fourier_sampler,selective_ckpt]",
    "data/sampler=fourier",
    "data.sampler.lag=1",
]


def csv_scalars(tmp_path: Path, run: str, tag: str = "train/loss") -> list[tuple[int, float]]:
    """(step, value) of ``tag`` in the run's CSV logger file."""
    with (tmp_path / "outputs" / "runs" / run / "csv" / "metrics.csv").open(newline="") as f:
        return [(int(r["step"]), float(r[tag])) for r in csv.DictReader(f) if r.get(tag)]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], STATEFUL, ["logger=csv"]], ids=["default", "all_stateful", "csv_logger"])
def test_sigkill_then_resume_auto_is_bitwise_exact(tmp_path, corpus, straight_run, extra):
    if extra is STATEFUL and not STATEFUL:
        pytest.skip("no stateful techniques registered")
    # A 'random' step, fixed for reproducibility, and odd: checkpoints come every 2 steps, so the killed run
    # has logged a step past its last checkpoint that the resumed run must replace, not duplicate.
    kill_step = random.Random(1234).randint(3, MAX_STEPS - 3) | 1
    straight_root, straight_name = straight_run(*extra)
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", f"+callbacks.fault.step={kill_step}"]
    killed = train_proc(tmp_path, corpus, "run_name=killed", *extra, *fault)
    assert killed.returncode == -signal.SIGKILL
    ckpt = torch.load(tmp_path / "outputs/runs/killed/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] < MAX_STEPS  # it really died mid-run
    resumed = train_proc(tmp_path, corpus, "run_name=killed", "resume=auto", *extra)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_weights(final_state(straight_root, straight_name), final_state(tmp_path, "killed"))
    # The logged curve: the resumed run drops what the killed run logged past its checkpoint (TensorBoard's
    # purge_step; rows of the CSV file), so it is the straight run's, one point per step, not two curves.
    scalars = csv_scalars if "logger=csv" in extra else tb_scalars
    straight, killed_log = scalars(straight_root, straight_name), scalars(tmp_path, "killed")
    assert [s for s, _ in straight] == list(range(MAX_STEPS)), straight
    assert killed_log == straight
    if extra is STATEFUL:  # every technique's curves, and the running totals (they fell back to 0 at the resume)
        straight_tags, killed_tags = tb_tags(straight_root, straight_name), tb_tags(tmp_path, "killed")
        assert straight_tags.keys() == killed_tags.keys()
        for tag, points in straight_tags.items():
            if tag.endswith("_per_sec") or tag.endswith("/time") or tag.endswith("/time_ms"):
                points, killed_points = [s for s, _ in points], [s for s, _ in killed_tags[tag]]
            else:
                killed_points = killed_tags[tag]
            assert killed_points == points, tag


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [1, 3])
def test_sigterm_saves_checkpoint_and_exits_cleanly(tmp_path, corpus, straight_run, accumulate):
    acc = [f"trainer.accumulate_grad_batches={accumulate}"] if accumulate > 1 else []  # 1: the default
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=5",
             "+callbacks.fault.signal=SIGTERM"]  # at the first micro-batch of step 5
    term = train_proc(tmp_path, corpus, "run_name=term", *acc, *fault)
    assert term.returncode == 143, term.stderr[-2000:]  # 128 + SIGTERM: stopped, not finished
    assert "SIGTERM received: saved" in term.stdout + term.stderr
    assert not (tmp_path / "outputs/runs/term/summary.json").exists()  # no result of an unfinished run
    ckpt = torch.load(tmp_path / "outputs/runs/term/checkpoints/last.ckpt", weights_only=True)
    # the optimizer step during which the signal came was finished (all its micro-batches) and saved
    assert ckpt["global_step"] == 6
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"] == 6 * accumulate
    resumed = train_proc(tmp_path, corpus, "run_name=term", "resume=auto", *acc)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_weights(final_state(*straight_run(*acc)), final_state(tmp_path, "term"))


def resume_ends_like_a_straight_run(tmp_path, corpus, straight_run, run_name: str, ddp: list[str]) -> None:
    """``resume=auto`` of the stopped run ``run_name`` exits 0 and ends with bitwise the weights of a straight run."""
    resumed = train_proc(tmp_path, corpus, f"run_name={run_name}", "resume=auto", *ddp, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(final_state(*straight_run(*ddp)), final_state(tmp_path, run_name))


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_sigterm_to_one_rank_saves_once_and_resumes_exactly(tmp_path, corpus, straight_run):
    """SIGTERM to rank 0 only (Lightning forwards it to rank 1 at its own moment): the ranks agree on the step,
    save together and exit with status 143. This used to hang in save_checkpoint's barrier in 3 of 5 runs."""
    ddp = ["trainer=ddp_cpu", *[o for o in RUN if o.startswith("trainer.")], "strategy=ddp"]
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=5", "+callbacks.fault.rank=0",
             "+callbacks.fault.signal=SIGTERM"]
    term = train_proc(tmp_path, corpus, "run_name=term", *ddp, *fault, timeout=240)
    assert term.returncode == 143, (term.stdout + term.stderr)[-3000:]
    ckpt = torch.load(tmp_path / "outputs/runs/term/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6
    resume_ends_like_a_straight_run(tmp_path, corpus, straight_run, "term", ddp)


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_ctrl_c_to_the_process_group_saves_the_step_and_resumes_exactly(tmp_path, corpus, straight_run):
    """Ctrl-C in a terminal: SIGINT to the whole process group (both ranks of Lightning's launcher), started here in a
    session of its own. It went to Lightning's KeyboardInterrupt path: a traceback, exit status 1, rank 1 killed,
    and last.ckpt left at the last validation (the steps since then lost without a word). Now both ranks save
    last.ckpt at the end of the step and exit with 130 (128 + SIGINT); resume=auto ends bitwise like a straight run."""
    ddp = ["trainer=ddp_cpu", *[o for o in RUN if o.startswith("trainer.")], "strategy=ddp"]
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=5", "+callbacks.fault.rank=0",
             "+callbacks.fault.signal=SIGINT", "+callbacks.fault.group=true"]
    cmd = [PYTHON, str(ROOT / "train.py"), *RUN, "data=textfiles", f"data.sources.0.paths=[{corpus}]",
           "run_name=int", *ddp, *fault]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # its own process group
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # no rank left behind, whatever happened
    assert proc.returncode == 130, out[-3000:]
    assert "SIGINT received: saved" in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "outputs/runs/int/summary.json").exists()
    assert torch.load(tmp_path / "outputs/runs/int/checkpoints/last.ckpt", weights_only=True)["global_step"] == 6
    resume_ends_like_a_straight_run(tmp_path, corpus, straight_run, "int", ddp)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("when", ["final_validation", "after_fit"])
def test_ddp_sigterm_to_one_rank_in_the_final_validation_stops_both_with_143(tmp_path, corpus, when):
    """SIGTERM to rank 1 only during train()'s final trainer.validate: Lightning's handler broadcast from inside the
    handler and its evaluation loop stopped rank 1 alone at its next batch (exit 143), while rank 0 waited for it in
    the epoch-end metric reduction until strategy.collective_timeout_s (30 min by default) and failed with a gloo
    timeout, exit status 1. The validation now finishes on both ranks, which then agree to exit with 143 together;
    resume=auto validates the saved last.ckpt and writes the summary. ``after_fit``: the SIGTERM comes between fit
    and that validation, where Lightning had put back the default handler: rank 1 died with -15 and rank 0 failed in
    its next collective (gloo's "Connection reset", exit status 1); now both exit with 143 as well."""
    ddp = [
        "trainer=ddp_cpu",
        *[o for o in RUN if o.startswith("trainer.")],
        "strategy=ddp",
        "strategy.collective_timeout_s=60",
        "data.val_batch_size=2",
    ]
    fault = [
        "+callbacks.fault._target_=tests.faults.SignalInValidation",
        f"+callbacks.fault.step={MAX_STEPS}",
        "+callbacks.fault.stage=validate",
        "+callbacks.fault.rank=1",
    ]
    if when == "after_fit":
        fault = ["+callbacks.fault._target_=tests.faults.SignalAfterFit", "+callbacks.fault.rank=1"]
    term = train_proc(tmp_path, corpus, "run_name=term", *ddp, *fault, timeout=240)
    out = term.stdout + term.stderr
    # 143 on both ranks: no rank waited for the collective timeout (that failed with a gloo timeout, exit status 1)
    assert term.returncode == 143, out[-3000:]
    assert "Timed out" not in out and "CollectiveError" not in out, out[-3000:]
    assert out.count("stopped by SIGTERM after the last step") == 1, out[-3000:]  # a fact of the run: rank 0 says it
    assert out.count("exiting with status 143 (stopped by SIGTERM, not finished)") == 2, out[-3000:]  # both ranks
    assert not (tmp_path / "outputs/runs/term/summary.json").exists()
    ckpt = torch.load(tmp_path / "outputs/runs/term/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == MAX_STEPS
    resumed = train_proc(tmp_path, corpus, "run_name=term", "resume=auto", *ddp, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "outputs/runs/term/summary.json").read_text())["steps"] == MAX_STEPS


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_reports_a_sigterm_stop_as_failed_and_a_restart_continues_with_resume_auto(tmp_path, corpus):
    """Under torchrun the workers that SIGTERM stopped exit with 143, so the agent reports a failed worker and exits
    with status 1 (Lightning's exit status 0 read as success). With --max-restarts the agent starts them again with
    the same arguments: with resume=auto they continue the run, and end where the stopped run resumed by hand does.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's shared store, a restarted gloo rank read a dead worker's
    address (pytorch#135712) and its start failed or hung."""
    launch = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [*RUN, "data=textfiles", f"data.sources.0.paths=[{corpus}]", "trainer=ddp_cpu",
            *[o for o in RUN if o.startswith("trainer.")], "trainer.enable_progress_bar=false"]
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=5", "+callbacks.fault.rank=0",
             "+callbacks.fault.signal=SIGTERM"]
    env = {**subprocess_env(tmp_path), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def torchrun(*extra, restarts=0):
        return subprocess.run([*launch, f"--max-restarts={restarts}", str(ROOT / "train.py"), *args, *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    stopped = torchrun("run_name=stopped", *fault)
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == 1, out[-3000:]
    assert "ChildFailedError" in out and "exitcode  : 143" in out, out[-3000:]
    assert out.count("exiting with status 143 (stopped by SIGTERM, not finished)") == 2, out[-3000:]  # both ranks
    runs = tmp_path / "outputs" / "runs"
    assert torch.load(runs / "stopped/checkpoints/last.ckpt", weights_only=True)["global_step"] == 6
    assert not (runs / "stopped/summary.json").exists()
    resumed = torchrun("run_name=stopped", "resume=auto")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]

    restarted = torchrun("run_name=restarted", "resume=auto", *fault, restarts=1)
    assert restarted.returncode == 0, (restarted.stdout + restarted.stderr)[-3000:]
    assert "exiting with status 143" in restarted.stdout + restarted.stderr  # the first attempt was stopped
    assert json.loads((runs / "restarted/summary.json").read_text())["steps"] == MAX_STEPS
    assert_same_weights(final_state(tmp_path, "stopped"), final_state(tmp_path, "restarted"))


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_rank_killed_survivor_fails_fast_and_resume_works(tmp_path, corpus):
    ddp = ["trainer=ddp_cpu", *[o for o in RUN if o.startswith("trainer.")], "strategy=ddp",
           "strategy.collective_timeout_s=20"]
    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=5", "+callbacks.fault.rank=1"]
    t0 = time.monotonic()
    dead = train_proc(tmp_path, corpus, "run_name=ddp", *ddp, *fault, timeout=240)
    elapsed = time.monotonic() - t0
    assert dead.returncode != 0
    assert elapsed < 120, elapsed  # well within timeout + start-up: it never hangs
    err = dead.stdout + dead.stderr
    assert "CollectiveError: rank 0: a collective failed at step 5" in err, err[-3000:]
    # the message says where the timeout is set and how to continue
    assert "the collective timeout is strategy.collective_timeout_s. Resume with resume=auto." in err, err[-3000:]
    resumed = train_proc(tmp_path, corpus, "run_name=ddp", "resume=auto", *ddp, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ckpt = torch.load(tmp_path / "outputs/runs/ddp/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == MAX_STEPS


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_hung_rank_hits_the_collective_timeout(tmp_path, corpus):
    timeout_s = 8
    ddp = ["trainer=ddp_cpu", *[o for o in RUN if o.startswith("trainer.")], "strategy=ddp",
           f"strategy.collective_timeout_s={timeout_s}"]
    fault = ["+callbacks.fault._target_=tests.faults.HangAtStep", "+callbacks.fault.step=4",
             "+callbacks.fault.seconds=300"]
    t0 = time.monotonic()
    hung = train_proc(tmp_path, corpus, "run_name=hung", *ddp, *fault, timeout=240)
    elapsed = time.monotonic() - t0
    assert hung.returncode != 0
    # start-up + 8 s (~40 s idle; up to ~100 s on a loaded 2-core machine): rank 0 gave up on its own and did
    # not wait out the peer's 300 s hang
    assert elapsed < 200, elapsed
    err = hung.stdout + hung.stderr
    assert "CollectiveError: rank 0: a collective failed at step 4" in err, err[-3000:]
    assert "the collective timeout is strategy.collective_timeout_s. Resume with resume=auto." in err, err[-3000:]


def test_corrupt_or_truncated_checkpoint_is_named(tiny_cfg, tmp_path):
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", run="good"))
    good = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    data = good.read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    for bad in (truncated, garbage):
        with pytest.raises(CheckpointError, match=str(bad.name)):
            train(tiny_cfg("sample.max_new_tokens=0", f"ckpt_path={bad}", run=f"resume_{bad.stem}"))


@pytest.mark.parametrize("kind", ["config", "corpus", "checkpoint"])
def test_a_bad_input_is_one_error_line_without_a_traceback(tmp_path, corpus, kind):
    """`python train.py data.seed=abc` printed Hydra's shortened traceback, about a dozen lines of lit_dtrain frames
    with the message last (a corpus error came inside 'Error in call to target ... full_key: data'). A bad config,
    corpus or checkpoint is now one line on stderr, 'error: <message>', with exit status 1 as before."""
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    args, message = {
        "config": (["data.seed=abc"], "error: data.seed must be an integer, got 'abc' (str)"),
        "corpus": (["data.sources.0.paths=[]"], "error: data.sources.0 (data source 'text'): kind='files' needs a "
                   "non-empty 'paths' list of files, directories or globs, e.g. 'data.sources.0.paths=[~/corpus]'"),
        "checkpoint": ([f"ckpt_path={garbage}"], f"error: checkpoint '{garbage}' is "),
    }[kind]
    proc = train_proc(tmp_path, corpus, *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(message), proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if "rror" in line] == [proc.stderr.splitlines()[-1]]


def test_a_non_finite_stop_is_one_line_and_its_traceback_is_in_the_runs_log(tmp_path, corpus):
    """A run that stops on a non-finite gradient (NonFiniteError, whose message names the step and the tensors)
    printed Hydra's traceback (some 78 lines, mostly Lightning's), and its train.log said nothing of it. It is one
    line now, exit status 1, and the run's train.log holds 'run failed: NonFiniteError: ...' with the traceback
    (which scripts/compare_runs.py shows as the run's error). Other errors keep their traceback on the console
    (tests/unit/test_sweep_checks.py::test_a_bad_input_is_reported_in_one_line_and_other_errors_keep_their_traceback)."""
    proc = train_proc(tmp_path, corpus, "optimizer.lr=1e30", "trainer.max_steps=3", "run_name=nf")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith("error: non-finite gradients at step 1 "), proc.stderr[-3000:]
    log = (tmp_path / "outputs" / "runs" / "nf" / "train.log").read_text()
    assert "[ERROR] - run failed: NonFiniteError: non-finite gradients at step 1 " in log
    assert log.index(f"[INFO] - {TRAINING_STARTS}\n") < log.index("run failed")  # only errors after it count
    assert "Traceback (most recent call last)" in log
    assert "lit_dtrain.module.NonFiniteError: non-finite gradients at step 1" in log


def test_nonfinite_loss_stops_at_that_step_with_finite_weights(tiny_cfg):
    for value in ("nan", "inf"):
        cfg = tiny_cfg("+callbacks.fault._target_=tests.faults.PoisonLossAtStep", "+callbacks.fault.step=3",
                       f"+callbacks.fault.value={value}", run=f"nan_{value}")
        with pytest.raises(NonFiniteError, match="step 3") as info:
            train(cfg)
        assert "weights are still finite" in str(info.value)


def test_nonfinite_guard_leaves_weights_finite(tiny_cfg):
    import lightning as L
    from hydra.utils import instantiate

    from lit_dtrain.module import LitLLM
    from tests.faults import PoisonLossAtStep

    cfg = tiny_cfg(run="nan_weights")
    dm = instantiate(cfg.data, _convert_="all")
    module = LitLLM(instantiate(cfg.model), instantiate(cfg.optimizer), None)
    trainer = L.Trainer(max_steps=6, callbacks=[PoisonLossAtStep(2)], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, accelerator="cpu")
    with pytest.raises(NonFiniteError):
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2
    assert all(bool(p.isfinite().all()) for p in module.parameters())


def test_disk_full_during_training_reports_and_keeps_last_checkpoint(tiny_cfg, tmp_path):
    mnt = tmp_path / "ckpt_tmpfs"
    mnt.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode == 0
    try:
        cfg = tiny_cfg(f"paths.checkpoint_dir={mnt}", "trainer.val_check_interval=2", "sample.max_new_tokens=0",
                       "+callbacks.fault._target_=tests.faults.FillDiskAtStep", "+callbacks.fault.step=3",
                       f"+callbacks.fault.path={mnt}", run="diskfull")
        with pytest.raises(CheckpointError, match="No space left on device"):
            train(cfg)
        ckpt = torch.load(mnt / "last.ckpt", weights_only=True)
        assert ckpt["global_step"] == 2  # the previous checkpoint is intact
        assert not list(mnt.glob(".*tmp*"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def _write_bad_corpus(root: Path, kind: str) -> Path:
    from tests.conftest import make_corpus

    root = make_corpus(root, n_files=8)
    if kind == "empty_files":
        for i in range(3):
            (root / f"empty_{i}.txt").write_bytes(b"")
    elif kind == "binary_junk":
        (root / "junk.bin").write_bytes(bytes(random.Random(0).randbytes(50_000)))
    return root


@pytest.mark.parametrize("kind", ["empty_files", "binary_junk"])
def test_bad_files_in_corpus_still_train(tmp_path, kind):
    from tests.conftest import compose_cfg

    corpus = _write_bad_corpus(tmp_path / kind, kind)
    metrics, objs = train(compose_cfg(["sample.max_new_tokens=0"], tmp_path / "run", corpus))
    assert metrics["steps"] == 6 and metrics["val_loss"] < 6.0
    assert objs["datamodule"].splits[0].meta["documents"] == 8 + (1 if kind == "binary_junk" else 0)


@pytest.mark.slow
def test_single_100mb_line(tmp_path):
    from lit_dtrain.data import CorpusSource, LMDataModule

    big = tmp_path / "one_line.txt"
    with open(big, "wb") as f:
        chunk = b"x = 1; " * 1024
        for _ in range(100 * 1024 * 1024 // len(chunk) + 1):
            f.write(chunk)
    dm = LMDataModule([CorpusSource(name="big", kind="files", paths=[str(big)])], block_size=64, batch_size=4,
                      cache_dir=str(tmp_path / "cache"), progress=False)
    dm.prepare_data()
    dm.setup()
    assert dm.num_train_samples > 1_000_000
    assert dm.batch_for_step(0)["input_ids"].shape == (4, 64)


def test_changed_corpus_rebuilds_cache_and_unreadable_is_named(tiny_cfg, corpus, tmp_path, monkeypatch):
    _, first = train(tiny_cfg("sample.max_new_tokens=0", run="c1"))
    (corpus / "doc_003.txt").write_text("brand new text " * 500)
    _, second = train(tiny_cfg("sample.max_new_tokens=0", run="c2"))
    assert first["datamodule"].splits[0].train.filename != second["datamodule"].splits[0].train.filename
    import builtins

    from lit_dtrain.data import CorpusError

    real_open = builtins.open
    bad = str(corpus / "doc_005.txt")

    def deny(path, *a, **k):  # root ignores file modes, so simulate EACCES
        if str(path) == bad:
            raise PermissionError(13, "Permission denied", bad)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(CorpusError, match="doc_005.txt.*Permission denied"):
        train(tiny_cfg("sample.max_new_tokens=0", run="c3"))


def test_checkpoint_that_is_not_a_training_checkpoint_is_named(tiny_cfg, tmp_path):
    """A readable torch file that is not a Lightning checkpoint, or one of another model shape: CheckpointError
    naming the file (it was a raw KeyError / TypeError / IndexError, or a state_dict RuntimeError)."""
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2",
                             "model.d_model=64", run="wide"))
    wide = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    state = torch.load(wide, weights_only=True)["state_dict"]
    bad = {"plain_state_dict": state, "a_tensor": torch.zeros(3), "a_list": [1, 2],
           "no_state_dict": {"global_step": 2}}
    for name, obj in bad.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save(obj, path)
        with pytest.raises(CheckpointError, match=f"{name}.ckpt' is not a Lightning training checkpoint"):
            train(tiny_cfg("sample.max_new_tokens=0", f"ckpt_path={path}", run=f"resume_{name}"))
    with pytest.raises(CheckpointError, match="last.ckpt' does not fit the configured model"):
        train(tiny_cfg("sample.max_new_tokens=0", f"ckpt_path={wide}", run="resume_wide"))


def test_resume_auto_without_last_ckpt_continues_from_the_newest_checkpoint(tiny_cfg):
    """Killed while writing the first last.ckpt (ModelCheckpoint writes the step file first): resume=auto used to
    refuse with 'continue it with resume=auto'; it now resumes from the step file and ends like a straight run."""
    straight, _ = train(tiny_cfg("sample.max_new_tokens=0", run="straight"))
    keep_all = "callbacks.model_checkpoint.save_top_k=-1"
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", keep_all, run="killed"))
    ckpt_dir = Path(objs["trainer"].default_root_dir) / "checkpoints"
    for p in ckpt_dir.glob("*.ckpt"):  # leave what a SIGKILL before the first last.ckpt's rename leaves
        if not p.name.startswith("step000003"):
            p.unlink()
    (ckpt_dir / "garbage.ckpt").write_bytes(b"junk")  # an unreadable file is skipped, not picked
    stale = ckpt_dir / ".last.ckpt.tmp-999999"  # the half-written file the kill left; as large as a checkpoint
    stale.write_bytes(b"x" * 1000)
    assert [p.name for p in ckpt_dir.glob("step*.ckpt")]
    resumed, _ = train(tiny_cfg("sample.max_new_tokens=0", keep_all, "resume=auto", run="killed"))
    assert resumed["steps"] == straight["steps"] == 6
    assert resumed["val_loss"] == straight["val_loss"]
    assert not stale.exists() and not list(ckpt_dir.glob(".*.tmp-*"))  # removed, not left to fill the disk


@pytest.mark.parametrize("content", ["empty", "truncated", "garbage", "tensor"])
def test_bad_decay_branch_checkpoint_is_named(tiny_cfg, tmp_path, content):
    """decay_branch.ckpt went through a bare torch.load: a damaged file was a raw torch RuntimeError."""
    from lit_dtrain.schedules.workflows import apply_decay_branch
    from lit_dtrain.train import ConfigError

    path = tmp_path / f"{content}.ckpt"
    if content == "tensor":
        torch.save(torch.zeros(3), path)
    elif content == "truncated":
        torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(1000)}}, path)
        path.write_bytes(path.read_bytes()[:2000])
    else:
        path.write_bytes(b"" if content == "empty" else b"not a checkpoint" * 10)
    cfg = tiny_cfg(f"decay_branch.ckpt={path}", "decay_branch.steps=2", "scheduler.warmup_steps=0", run="branch")
    with pytest.raises((CheckpointError, ConfigError), match=f"{content}.ckpt"):
        apply_decay_branch(cfg)


@pytest.mark.parametrize("script", ["generate", "spectrum"])
def test_scripts_refuse_checkpoints_without_their_weights(tiny_cfg, tmp_path, capsys, script):
    """scripts/generate.py loaded with strict=False: a checkpoint with an empty state_dict sampled from a random
    init without a word; a tensor or a dict without state_dict was a raw RuntimeError/KeyError."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_{script}", ROOT / "scripts" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2"))
    good = Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    mod.load_model(str(good))  # a real checkpoint loads strictly
    ckpt = torch.load(good, weights_only=True)
    bad = {"empty_state_dict": {**ckpt, "state_dict": {}}, "a_tensor": torch.zeros(3),
           "no_state_dict": {k: v for k, v in ckpt.items() if k != "state_dict"}}
    for name, obj in bad.items():
        path = tmp_path / f"{name}.ckpt"
        torch.save(obj, path)
        with pytest.raises(SystemExit):
            mod.load_model(str(path))
        assert f"{name}.ckpt" in capsys.readouterr().err  # and the last stdout line is the JSON error
