"""A resume that the fit refuses while it loads the checkpoint leaves the run's logs and record as they were
(``lit_dtrain.logs_kept``): the logger cut them at the checkpoint's step before the load, so ``resume=auto`` on a
finished 4-step run with the FourierSampler and another ``data.val_fraction`` (the sampler's table of other windows,
refused) dropped the 2 ``metrics.csv`` rows of step 4 (its final ``val/loss``), hid TensorBoard's step-4 points
behind a purge marker and rewrote ``config_resolved.yaml`` with the refused values, having trained nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lit_dtrain import logs_kept
from lit_dtrain.errors import ConfigError
from lit_dtrain.loggers import purge_csv_metrics, purge_other_loggers
from lit_dtrain.logs_kept import LogsKeptUntilTraining, put_back_a_killed_starts_logs
from lit_dtrain.train import train

FOURIER = ("sample.max_new_tokens=0", "data/sampler=fourier", "trainer.val_check_interval=2")


def _run_and_refused_resume(tiny_cfg, logger: str) -> Path:
    cfg = tiny_cfg("trainer.max_steps=4", f"logger={logger}", *FOURIER)
    train(cfg)
    return Path(cfg.paths.output_dir)


def _files(run: Path) -> dict[str, bytes]:
    names = [p for p in run.rglob("*") if p.is_file() and ".hydra" not in p.parts and p.name not in (
        "train.log", ".train.lock")]
    return {str(p.relative_to(run)): p.read_bytes() for p in names}


def _tree(run: Path) -> set[str]:
    """The files and dirs of ``run`` but Hydra's and the job log's."""
    return {str(p.relative_to(run)) for p in run.rglob("*") if ".hydra" not in p.parts} - {"train.log", ".train.lock"}


def _refuse(tiny_cfg, logger: str) -> None:
    resumed = tiny_cfg("trainer.max_steps=6", f"logger={logger}", "resume=auto", "data.val_fraction=0.3", *FOURIER)
    with pytest.raises(ConfigError, match="sampler table indexes the windows of dataset"):
        train(resumed)


def test_a_resume_refused_at_the_load_keeps_metrics_csv_and_the_record(tiny_cfg):
    run = _run_and_refused_resume(tiny_cfg, "csv")
    before = _files(run)
    rows = (run / "csv" / "metrics.csv").read_text().splitlines()
    assert sum(row.split(",")[1] == "4" for row in rows[1:]) == 2  # the rows a resume at step 4 cuts
    _refuse(tiny_cfg, "csv")
    assert _files(run) == before  # metrics.csv, hparams.yaml, config_resolved.yaml, overrides.yaml, checkpoints


def test_a_resume_refused_at_the_load_keeps_tensorboards_points(tiny_cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run_and_refused_resume(tiny_cfg, "tensorboard")
    before = _files(run)
    _refuse(tiny_cfg, "tensorboard")
    assert _files(run) == before  # no purge marker, no new writer's file
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [1, 3, 4]


def _logs(run: Path) -> Path:
    (run / "csv").mkdir(parents=True)
    metrics = run / "csv" / "metrics.csv"
    metrics.write_text("epoch,step,val/loss\n0,3,4.5\n0,4,4.2\n")
    (run / "tb").mkdir()
    (run / "tb" / "events.out.tfevents.1.host.1.0").write_bytes(b"old")
    (run / "config_resolved.yaml").write_text("seed: 1\n")
    return metrics


def test_a_fit_that_fails_before_training_gets_the_cut_files_back_and_loses_the_new_events(tmp_path):
    metrics = _logs(tmp_path)
    with pytest.raises(RuntimeError, match="refused"), LogsKeptUntilTraining(tmp_path):
        purge_csv_metrics(metrics, 4)
        purge_other_loggers(tmp_path, 4, None)  # tb/ gets a purge marker file
        (tmp_path / "config_resolved.yaml").write_text("seed: 2\n")
        assert len(list((tmp_path / "tb").iterdir())) == 2
        raise RuntimeError("refused")
    assert metrics.read_text() == "epoch,step,val/loss\n0,3,4.5\n0,4,4.2\n"
    assert (tmp_path / "config_resolved.yaml").read_text() == "seed: 1\n"
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["events.out.tfevents.1.host.1.0"]


def test_the_cut_stands_once_training_started_or_the_fit_ended(tmp_path):
    metrics = _logs(tmp_path)
    kept = LogsKeptUntilTraining(tmp_path)
    with pytest.raises(RuntimeError), kept:
        purge_csv_metrics(metrics, 4)
        kept.on_train_start(None, None)  # every restore is done: what fails later, fails in training
        raise RuntimeError("NaN at step 5")
    assert metrics.read_text() == "epoch,step,val/loss\n0,3,4.5\n"
    with LogsKeptUntilTraining(tmp_path):
        purge_csv_metrics(metrics, 3)
    assert metrics.read_text() == "epoch,step,val/loss\n"


def test_a_resume_refused_after_the_logger_is_built_keeps_the_other_loggers_rows(tiny_cfg):
    """A check between the logger's build and the fit (ddp_spawn's refusal, a multirun's world size): a csv run's
    resume=auto with logger=tensorboard and strategy.name=ddp_spawn (refused, trained nothing) cut the 2 rows of
    step 4 from csv/metrics.csv (purge_other_loggers, in build_logger), which nothing put back."""
    from lit_dtrain.errors import ConfigError

    run = _run_and_refused_resume(tiny_cfg, "csv")
    before = _files(run)
    resumed = tiny_cfg("trainer.max_steps=6", "logger=tensorboard", "resume=auto", "trainer=ddp_cpu",
                       "strategy.name=ddp_spawn", *FOURIER)
    with pytest.raises(ConfigError, match="start_method='spawn' runs fit in new processes"):
        train(resumed)
    assert _files(run) == before


def test_a_logger_writing_into_the_run_dir_itself_leaves_its_job_log_alone(tmp_path):
    """logger=csv logger.name='' writes metrics.csv into the run dir itself, which every file there then was kept
    and put back from: a refused resume's train.log was replaced by a copy taken before the refusal (a new file,
    the logging handler went on writing to the removed one), its last 4 lines, the error among them, lost."""
    (tmp_path / "metrics.csv").write_text("epoch,step,val/loss\n0,4,4.2\n")
    log = tmp_path / "train.log"
    log.write_text("first start\n")
    inode = log.stat().st_ino
    with pytest.raises(RuntimeError, match="refused"), LogsKeptUntilTraining(tmp_path):
        purge_csv_metrics(tmp_path / "metrics.csv", 4)
        with log.open("a") as handler:
            handler.write("error: refused\n")
        raise RuntimeError("refused")
    assert (tmp_path / "metrics.csv").read_text() == "epoch,step,val/loss\n0,4,4.2\n"
    assert log.read_text() == "first start\nerror: refused\n" and log.stat().st_ino == inode


@pytest.mark.parametrize(("logged", "resumed"), [("csv", "tensorboard"), ("tensorboard", "csv")])
def test_a_refused_logger_switch_leaves_no_dir_of_the_other_logger(tiny_cfg, logged, resumed):
    """A csv run's refused resume=auto with logger=tensorboard left an empty tb/ in the run dir (its writer's event
    file was removed, not its dir), a TensorBoard run's with logger=csv an empty csv/."""
    run = _run_and_refused_resume(tiny_cfg, logged)
    before, tree = _files(run), _tree(run)
    _refuse(tiny_cfg, resumed)
    assert _tree(run) == tree and _files(run) == before


@pytest.mark.parametrize("refused", [True, False])
def test_a_stop_signal_before_the_checkpoints_load_puts_the_logs_back(tiny_cfg, refused):
    """A SIGTERM in a resume's setup, after the logger cut the logs and before Lightning's handler (registered after
    the checkpoint's load), took the default action: the process ended with 143 and left csv/metrics.csv cut (step
    4's rows), config_resolved.yaml and overrides.yaml with that start's values. It ends with 143 now, the files as
    they were: the start trained nothing (refused or not)."""
    import multiprocessing

    run = _run_and_refused_resume(tiny_cfg, "csv")
    before = _files(run)
    resumed = tiny_cfg("trainer.max_steps=6", "logger=csv", "resume=auto", *FOURIER,
                       *(["data.val_fraction=0.3"] if refused else []),
                       "+callbacks.stop._target_=tests.faults.SignalInSetup")
    child = multiprocessing.get_context("fork").Process(target=train, args=(resumed,))
    child.start()
    child.join(120)
    assert child.exitcode == 143, child.exitcode  # -15 (killed by the signal) before
    assert _files(run) == before


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_before_training_says_what_happened_and_what_resumes(tmp_path, caplog, name):
    """A resume stopped by SIGTERM or SIGHUP before training (its checkpoint's load) put its logs back and exited with
    143 or 129 without a word (``train.py ... resume=auto`` of a step-4 run, the signal in the fit's setup)."""
    import logging

    caplog.set_level(logging.INFO, logger="lit_dtrain")
    metrics = _logs(tmp_path)
    signum = getattr(signal, name)
    assert signal.getsignal(signum) is signal.SIG_DFL
    with pytest.raises(SystemExit, match=str(128 + signum)), LogsKeptUntilTraining(tmp_path, resumed_step=4):
        purge_csv_metrics(metrics, 4)
        os.kill(os.getpid(), signum)
    assert metrics.read_text() == "epoch,step,val/loss\n0,3,4.5\n0,4,4.2\n"
    assert [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.logs_kept"] == [
        f"stopped by {name} before training, resuming from step 4: nothing trained, the logs are as they were; run "
        "the same command again to resume from step 4",
        f"exiting with status {128 + signum} (stopped by {name}, not finished)",
    ]


def test_a_stop_signal_in_the_put_back_waits_for_it_to_end(tmp_path, monkeypatch):
    """A SIGTERM while config_resolved.yaml was put back (the first file) ended the put-back there: metrics.csv stayed
    cut at step 4 (under train.py's default handler the process ended with 143). Now it is acted on after it."""
    metrics = _logs(tmp_path)
    write = logs_kept.write_atomically

    def signalled(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(path, *args, **kwargs)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit, match="143"), LogsKeptUntilTraining(tmp_path):
            purge_csv_metrics(metrics, 4)
            (tmp_path / "config_resolved.yaml").write_text("seed: 2\n")
            monkeypatch.setattr(logs_kept, "write_atomically", signalled)
            raise RuntimeError("refused")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert metrics.read_text() == "epoch,step,val/loss\n0,3,4.5\n0,4,4.2\n"
    assert (tmp_path / "config_resolved.yaml").read_text() == "seed: 1\n"


def test_the_logs_of_a_start_killed_before_training_are_put_back_at_the_next(tmp_path, caplog):
    """Under Lightning's DDP launcher a rank 1 that refused a resume alone exits first, and Lightning's observer of it
    SIGKILLs rank 0 within 5 s: a 2-rank resume=auto whose rank 0 took 8 s to load the checkpoint ended with status
    137, its metrics.csv cut from 7 lines to 5 and config_resolved.yaml rewritten. The copy kept on disk is put back
    at the next start."""
    metrics = _logs(tmp_path)
    LogsKeptUntilTraining(tmp_path)  # the killed start: it cut the logs, and never put them back
    purge_csv_metrics(metrics, 4)
    purge_other_loggers(tmp_path, 4, None)
    (tmp_path / "config_resolved.yaml").write_text("seed: 2\n")
    put_back_a_killed_starts_logs(tmp_path)
    assert metrics.read_text() == "epoch,step,val/loss\n0,3,4.5\n0,4,4.2\n"
    assert (tmp_path / "config_resolved.yaml").read_text() == "seed: 1\n"
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["events.out.tfevents.1.host.1.0"]
    assert not (tmp_path / logs_kept.KEPT_DIR).exists()
    assert "put back as they were: config_resolved.yaml, csv/metrics.csv, tb/events.out.tfevents." in caplog.text


def test_a_copy_whose_removal_at_training_start_was_cut_is_not_put_back(tmp_path, monkeypatch):
    """Killed while the copy was removed at on_train_start: the manifest goes first, so the next start finds no
    copy to put back over a run that trained (nor one missing its files)."""
    metrics = _logs(tmp_path)
    kept = LogsKeptUntilTraining(tmp_path)
    purge_csv_metrics(metrics, 4)
    monkeypatch.setattr(logs_kept.shutil, "rmtree", lambda *args, **kwargs: None)  # the kill, after the manifest
    kept.on_train_start(None, None)
    monkeypatch.undo()
    assert (tmp_path / logs_kept.KEPT_DIR / "0").is_file()
    put_back_a_killed_starts_logs(tmp_path)
    assert metrics.read_text() == "epoch,step,val/loss\n0,3,4.5\n"  # the cut stands: training started
    assert not (tmp_path / logs_kept.KEPT_DIR).exists()


def test_train_puts_back_the_logs_of_a_resume_killed_before_training(tiny_cfg):
    run = _run_and_refused_resume(tiny_cfg, "csv")
    before = _files(run)
    LogsKeptUntilTraining(run)  # a resume killed after the cut
    purge_csv_metrics(run / "csv" / "metrics.csv", 4)
    with pytest.raises(ConfigError, match="past trainer.max_steps=3"):  # refused before the logger cuts anything
        train(tiny_cfg("trainer.max_steps=3", "logger=csv", "resume=auto", *FOURIER))
    assert _files(run) == before


def test_a_refusal_after_the_loss_spike_monitors_train_start_puts_its_events_back(tmp_path):
    """LossSpikeMonitor's on_train_start moves the events of steps >= the resumed step to spikes.superseded.jsonl; a
    callback after it that refused in on_train_start (before this one's) put the logs back but not the events: a
    resume at step 4 of a run killed at step 7, whose step 6 was skipped, left spikes.jsonl empty and the skip in
    spikes.superseded.jsonl. Both files are as they were now."""
    from lit_dtrain.callbacks._spike_records import supersede_replayed

    _logs(tmp_path)
    spikes = tmp_path / "spikes.jsonl"
    spikes.write_text('{"step": 2, "actions": ["log"]}\n{"step": 6, "actions": ["log", "skip"]}\n')
    before = _files(tmp_path)
    with pytest.raises(RuntimeError, match="refused"), LogsKeptUntilTraining(tmp_path):
        assert supersede_replayed(str(spikes), 4)  # the monitor's on_train_start, at the resumed step 4
        raise RuntimeError("refused in on_train_start")
    assert _files(tmp_path) == before
    assert not (tmp_path / "spikes.superseded.jsonl").exists()
