"""``python train.py -m ... trainer=ddp_cpu``: a Hydra sweep whose jobs each run on 2 gloo processes."""

import json
import subprocess

import pytest

from tests.conftest import PYTHON, ROOT, TINY, make_corpus, subprocess_env
from tests.e2e._reliability_helpers import assert_refused_once


def ddp_sweep(tmp_path, corpus, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """``python train.py -m`` of the tiny model on 2 gloo ranks (``trainer=ddp_cpu strategy=ddp``) over ``corpus``."""
    trainer = [o for o in TINY if o.startswith("trainer.")]
    cmd = [PYTHON, str(ROOT / "train.py"), "-m", *TINY, "trainer=ddp_cpu", *trainer]
    cmd += ["strategy=ddp", "data=textfiles", f"data.sources.0.paths=[{corpus}]", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.dist
def test_multirun_with_ddp_writes_each_job_once_with_both_ranks(tmp_path, corpus):
    args = [
        "trainer.max_steps=6",
        "trainer.val_check_interval=3", "sample.max_new_tokens=0", "optimizer.lr=1e-3,1e-2",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = list((tmp_path / "outputs" / "multiruns").iterdir())
    # rank 1, re-launched by Lightning with the same -m, joins rank 0's sweep instead of starting its own
    assert len(sweeps) == 1, sweeps
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    losses = []
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["steps"] == 6
        losses.append(summary["val_loss"])
        assert (job / "train_ddp_process_1.log").is_file()  # rank 1 ran this job, and logged here
        assert "optimizer.lr=" in (job / ".hydra" / "overrides.yaml").read_text()
    assert losses[0] != losses[1]  # two configurations, not one run twice


@pytest.mark.slow
@pytest.mark.dist
def test_each_ddp_sweep_jobs_peak_rss_is_its_own_on_every_rank(tmp_path, corpus):
    """Job 0 holds 300 MiB on each rank for a step, job 1 does not: job 1's ``peak_rss_mib`` (the ranks' highest) is
    its own, so both ranks' processes, which run the jobs in turn, reset their peak at job 1's start. Run by hand
    (``model.n_layer=4``, ``model.d_model=512,32``): 648.9 and 389.3 MiB, against 653.6 and 380.5 for runs of their
    own; rank 1 that kept job 0's peak would read about 650 in job 1."""
    sweep = tmp_path / "sweep"
    args = [
        "trainer.max_steps=3", "trainer.val_check_interval=3",
        "sample.max_new_tokens=0", "+callbacks.hold._target_=tests.faults.HoldMemoryAtStep", "+callbacks.hold.step=1",
        "+callbacks.hold.mib=300,0", f"hydra.sweep.dir={sweep}",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    held, free = (json.loads((sweep / job / "summary.json").read_text())["peak_rss_mib"] for job in ("0", "1"))
    assert held - free > 250, (held, free)


@pytest.mark.slow
@pytest.mark.dist
def test_a_sweep_whose_job_failed_in_a_collective_stops_there_with_status_1(tmp_path, corpus):
    """Rank 1 hangs in job 0 of 3: rank 0's collective times out, and it killed its child rank with the launcher's
    kill, which left that rank on the list Lightning's child-process observer polls every 5 s: jobs 1 and 2 failed at
    step 0 in 1 s each (the group the jobs share is broken), then the observer SIGKILLed the sweep (status -9, no last
    line; the job's line advised a bare resume=auto, refused under -m). It stops at job 0 now, status 1, saying so."""
    sweep = tmp_path / "sweep"
    args = [
        "trainer.max_steps=6", "sample.max_new_tokens=0",
        "strategy.collective_timeout_s=3", "+callbacks.hang._target_=tests.faults.HangAtStep", "+callbacks.hang.step=2",
        "+callbacks.hang.seconds=60,0,0", f"hydra.sweep.dir={sweep}",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: rank 0: a collective failed at step 2 ("), last
    assert last.endswith(
        "the collective timeout is strategy.collective_timeout_s; the sweep stops at this job (its later jobs would "
        "fail in their first collective: the ranks' connections are gone): resume with the same -m arguments and "
        f"resume=auto hydra.sweep.dir={sweep}"), last
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]


@pytest.mark.slow
@pytest.mark.dist
def test_a_sigterm_in_a_ddp_jobs_end_of_run_sample_stops_both_ranks_before_the_next_job(tmp_path, corpus):
    """SIGTERM to rank 0 (the process a shell, Slurm or kill signals) while it drew job 0's end-of-run sample, which
    only it draws: it exited 143, but rank 1 had gone on to job 1, made its dir and failed in its first collective,
    the sweep's last line 'error: rank 1: a collective failed at step 0 (... Connection closed by peer ...). Another
    rank probably died or hung'. The ranks agree on the signal after the sample: both exit 143 before job 1."""
    sweep = tmp_path / "sweep"
    args = [
        "trainer.max_steps=6", "scheduler=wsd,cosine",
        "+callbacks.fault._target_=tests.faults.SignalInSample", f"hydra.sweep.dir={sweep}",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-3000:]
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]
    assert "collective failed" not in out, out[-3000:]
    assert json.loads((sweep / "0" / "summary.json").read_text())["steps"] == 6
    rank_1 = (sweep / "0" / "train_ddp_process_1.log").read_text()
    assert "[rank: 1] exiting with status 143 (stopped by SIGTERM, not finished)" in rank_1, rank_1[-2000:]
    assert "[rank: 0] exiting with status 143 (stopped by SIGTERM, not finished)" in out, out[-3000:]
    assert out.count("stopped by SIGTERM after this job finished") == 1, out[-3000:]  # rank 0's line alone


@pytest.mark.slow
@pytest.mark.dist
def test_a_ddp_sweep_whose_sample_outlasts_the_collective_timeout_runs_every_job(tmp_path, corpus):
    """Rank 1 waits for rank 0's end-of-run sample in a collective (the ranks' agreement on a late signal; before it,
    the next job's first one) bounded by strategy.collective_timeout_s: with 10 s and a 1200-token sample, a healthy
    2-job sweep failed there ('Timed out waiting 10000ms for send operation to complete') and was SIGKILLed (137).
    That wait is bounded by strategy.connect_timeout_s now, as the wait for a rank that starts slowly is."""
    sweep = tmp_path / "sweep"
    args = [
        "strategy.collective_timeout_s=8",
        "trainer.max_steps=4", "optimizer.lr=1e-3,2e-3", "+callbacks.fault._target_=tests.faults.SlowSample",
        "+callbacks.fault.seconds=16", f"hydra.sweep.dir={sweep}",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Timed out" not in out and "collective failed" not in out, out[-3000:]
    assert [json.loads((sweep / job / "summary.json").read_text())["steps"] for job in ("0", "1")] == [4, 4]


@pytest.mark.slow
@pytest.mark.dist
def test_a_ddp_sweep_job_whose_sample_failed_on_rank_0_lets_the_next_job_run(tmp_path, corpus):
    """Rank 0's end-of-run sample raised in job 0 (a GPU out of memory there; only rank 0 draws it): rank 0 left job 0
    without the ranks' agreement on a late signal, in which rank 1 waited, so rank 0's next collective, job 1's first,
    met rank 1's agreement: job 1 failed at step 0 after strategy.collective_timeout_s ('Timed out waiting 20000ms',
    30 min by default) and ended the sweep, its line blaming a collective, not the sample. Before the agreement, job
    1 trained and the sweep ended with job 0's error. Rank 0 agrees even when its sample or report raised."""
    sweep = tmp_path / "sweep"
    args = [
        "strategy.collective_timeout_s=20",
        "trainer.max_steps=4", "optimizer.lr=1e-3,2e-3", "+callbacks.fault._target_=tests.faults.RaiseInSample",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "collective failed" not in out, out[-3000:]
    assert "RuntimeError: out of memory in the sample" in out, out[-3000:]  # Hydra's report of job 0, at the end
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 4
    assert not (sweep / "0" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("values, refused, next_job", [("2,-5,2", 1, 2), ("-5,2", 0, 1)])
def test_a_ddp_sweep_job_refused_on_every_rank_is_reported_once(tmp_path, corpus, values, refused, next_job):
    """Each rank runs its own Hydra sweep (Lightning re-launches rank 1 with the same -m): a job refused alike on both
    ranks logged 'job 1 failed: ConfigError: ...' twice on the console and, after the sweep, Hydra's four lines of it
    twice on stderr. Rank 0 reports it alone now; the sweep's next job still runs on both ranks, and rank 1's job log
    keeps the line. Job 0, refused before its fit (Lightning starts rank 1 in a job's fit), was reported again by rank
    1, started by job 1's fit with the same -m (no process group existed to compare the ranks' lines): rank 1 now
    knows the job that started it and leaves the jobs before it to rank 0."""
    args = [
        "trainer.val_check_interval=2",
        "sample.max_new_tokens=0", f"trainer.max_steps={values}",
    ]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=600)
    refusal = "trainer.max_steps must be a positive step budget, got -5"
    assert_refused_once(proc, refused, refusal)
    job_dirs = next((tmp_path / "outputs" / "multiruns").iterdir())
    assert refusal in (job_dirs / str(refused) / "train_ddp_process_1.log").read_text()  # rank 1's job log keeps it
    assert json.loads((job_dirs / str(next_job) / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
@pytest.mark.dist
def test_a_ddp_sweep_job_whose_data_rank_0_alone_refused_is_refused_on_every_rank_and_the_next_job_runs(
        tmp_path, corpus):
    """Rank 0 alone builds the token cache (Lightning's prepare_data); it refused job 0's corpus, under the run outputs:
    rank 0 went on to job 1 while rank 1 waited in job 0's pre_setup barrier for strategy.collective_timeout_s (30 min
    by default; 22 s at 10 s), and the sweep ended there with rank 0's 'a collective failed before training (...
    Connection closed by peer ...)', job 1 not run. Every rank refuses job 0 with rank 0's error now, at once, and job
    1 trains (the default timeout: the old wait would outlast the test's 400 s)."""
    sweep, inside = tmp_path / "sweep", make_corpus(tmp_path / "outputs" / "corpus")
    args = [f"data.sources.0.paths=[{inside}],[{corpus}]", "trainer.max_steps=2", "trainer.val_check_interval=2",
            "sample.max_new_tokens=0", f"hydra.sweep.dir={sweep}"]
    proc = ddp_sweep(tmp_path, corpus, args, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]  # (Hydra's status for a sweep with a failed job)
    assert "collective failed" not in out and "Timed out" not in out, out[-3000:]
    refusal = f"data source 'text': its 12 file(s) are all under '{tmp_path / 'outputs'}'"
    assert out.count(f"job 0 failed: CorpusError: {refusal}") == 1, out[-3000:]  # rank 0's, once
    assert proc.stderr.count(f"error: {refusal}") == 1, proc.stderr[-3000:]
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 2
