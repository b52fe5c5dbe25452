"""The sweep checks that ``train(cfg)`` runs under Hydra (``lit_dtrain.sweeps``): ``resume=auto`` in a multirun
resumes job N from ``<sweep dir>/N`` only if it was trained with the same swept values, and a config that sweeps
only with ``-m`` says so without it. The jobs run in-process under a Hydra runtime config set up the way Hydra sets
it (mode, job dir, this start's ``multirun.yaml``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from lit_dtrain.sweeps import check_resumed_job
from lit_dtrain.train import ConfigError, train
from tests.conftest import CONF_DIR, TINY


@contextlib.contextmanager
def multirun_job(job_dir: Path, sweep: list[str], job: list[str], corpus: Path, mode: RunMode = RunMode.MULTIRUN):
    """The config of one job of ``python <entry> -m *sweep``, which Hydra expanded to ``job``, with Hydra's runtime
    config set as in that job (``multirun.yaml`` of this start beside the job dir); ``mode=RunMode.RUN``: the one
    run of ``python <entry> *job``."""
    tiny = [o for o in TINY if not (o.startswith("scheduler.") and "~scheduler" in job)]
    base = [*tiny, "sample.max_new_tokens=0", "data=textfiles", f"data.sources.0.paths=[{corpus}]"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full = compose(config_name="train", overrides=base + job, return_hydra_config=True)
    with open_dict(full):
        full.hydra.mode = mode
        if mode == RunMode.MULTIRUN:
            full.hydra.job.num = int(job_dir.name)
        full.hydra.runtime.output_dir = str(job_dir)
        full.hydra.overrides.task = base + job
        full.paths.output_dir = str(job_dir)
        full.paths.cache_dir = str(job_dir.parent.parent / "token_cache")
    job_dir.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save({"hydra": {"overrides": {"task": base + sweep}}}, job_dir.parent / "multirun.yaml")
    HydraConfig.instance().set_config(full)
    pinned = os.environ.get("LIT_DTRAIN_SWEEP_DIR")  # train(cfg) exports the sweep dir: not for later tests
    try:
        cfg = full.copy()
        with open_dict(cfg):
            del cfg["hydra"]
        yield cfg
    finally:
        HydraConfig.instance().cfg = None
        if pinned is None:
            os.environ.pop("LIT_DTRAIN_SWEEP_DIR", None)
        else:
            os.environ["LIT_DTRAIN_SWEEP_DIR"] = pinned


def test_train_called_from_another_hydra_entry_refuses_a_job_dir_trained_with_other_swept_values(tmp_path, corpus):
    """A Hydra app of one's own that calls ``lit_dtrain.train.train(cfg)`` (train(cfg) is the library's entry point)
    got none of the sweep checks, which lived in the root train.py: re-running '-m optimizer.lr=3e-3,1e-3 resume=auto'
    into a sweep run as '1e-3,3e-3' made job 0 resume the lr=1e-3 run and train on with lr=3e-3. train(cfg) refuses
    it now, in any Hydra multirun, and the earlier run is untouched."""
    job0 = tmp_path / "sweep" / "0"
    with multirun_job(job0, ["optimizer.lr=1e-3,3e-3"], ["optimizer.lr=0.001"], corpus) as cfg:
        train(cfg)
    assert json.loads((job0 / "summary.json").read_text())["steps"] == 6
    resumed = ["resume=auto", "trainer.max_steps=9"]
    with multirun_job(job0, ["optimizer.lr=3e-3,1e-3", *resumed], ["optimizer.lr=0.003", *resumed], corpus) as cfg:
        with pytest.raises(
            ConfigError,
            match=rf"resume=auto: {job0} was trained with optimizer.lr=0.001, this job "
            "sets optimizer.lr=0.003",
        ):
            train(cfg)
    assert json.loads((job0 / "summary.json").read_text())["steps"] == 6
    assert OmegaConf.load(job0 / "config_resolved.yaml").optimizer.lr == 0.001


def test_a_callbacks_sweep_resumes_with_a_longer_max_steps_and_a_reordered_one_names_the_callback(tmp_path, corpus):
    """'-m ~scheduler callbacks=[default,wsd],[default,wsd,loss_spike]', resumed with resume=auto and a longer
    trainer.max_steps (the extension the check lets through for scheduler=wsd,cosine) was refused for every job:
    the callbacks group was compared without its own interpolated entries only, and callbacks.wsd.total_steps
    (${trainer.max_steps}) lies one level down. The refusal printed both whole callbacks dicts (over 1,500
    characters). Interpolated entries are skipped at any depth now, and a refusal names the entry that differs."""
    sweep = ["~scheduler", "callbacks=[default,wsd],[default,wsd,loss_spike]"]
    job1 = tmp_path / "sweep" / "1"
    with multirun_job(job1, sweep, ["~scheduler", "callbacks=[default,wsd,loss_spike]"], corpus) as cfg:
        job1.mkdir(parents=True)
        (job1 / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as train(cfg) writes it
    longer = ["resume=auto", "trainer.max_steps=9"]
    job = ["~scheduler", "callbacks=[default,wsd,loss_spike]", *longer]
    with multirun_job(job1, sweep + longer, job, corpus) as cfg:
        check_resumed_job(cfg)  # the same job, extended: resumed
    reordered = ["~scheduler", "callbacks=[default,wsd,loss_spike],[default,wsd]", *longer]
    with multirun_job(job1, reordered, ["~scheduler", "callbacks=[default,wsd]", *longer], corpus) as cfg:
        with pytest.raises(ConfigError) as refused:
            check_resumed_job(cfg)
    assert str(refused.value) == (
        f"resume=auto: {job1} was trained with callbacks.loss_spike=lit_dtrain.callbacks.LossSpikeMonitor, this job "
        "sets callbacks.loss_spike=(not set): job N resumes <sweep dir>/N, so re-run the sweep with the same -m "
        "arguments in the same order (or resume into another hydra.sweep.dir)"
    )


def test_train_called_from_another_hydra_entry_warns_that_an_experiment_grid_needs_dash_m(tmp_path, corpus, caplog):
    """`python my_train.py experiment=wsd_vs_cosine` (a Hydra app of one's own calling train(cfg), without -m)
    trained one run at the default LR for the budget of each of 6 jobs, silently: the warning that Hydra ignores
    hydra.sweeper.params outside a multirun was logged by the root train.py only. train(cfg) logs it now."""
    job = tmp_path / "runs" / "one"
    with multirun_job(job, [], ["experiment=wsd_vs_cosine", "optimizer.lr=-1"], corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):  # after the warning: nothing trained
            train(cfg)
    assert (
        "this config sweeps scheduler=wsd,cosine optimizer.lr=1e-3,3e-3,1e-2 (hydra.sweeper.params) only with -m; "
        "without it this is one run"
    ) in caplog.messages


def test_train_called_from_another_hydra_entry_pins_the_sweep_dir_for_rank_1(tmp_path, corpus, monkeypatch):
    """Multirun + DDP: Lightning re-launches rank 1 with the same -m arguments, and rank 1 joins rank 0's sweep dir
    only through LIT_DTRAIN_SWEEP_DIR (conf/hydra). The root train.py exported it before train(cfg); a Hydra app of
    one's own calling train(cfg) did not, so rank 1 wrote its jobs into a second, later-timestamped sweep dir (job
    dirs without metrics, which compare_runs lists as jobs that logged nothing). train(cfg) exports it now."""
    monkeypatch.delenv("LIT_DTRAIN_SWEEP_DIR", raising=False)
    job0 = tmp_path / "sweep" / "0"
    with multirun_job(job0, ["optimizer.lr=-1,1e-3"], ["optimizer.lr=-1"], corpus) as cfg:
        with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):  # before any training
            train(cfg)
        assert os.environ.get("LIT_DTRAIN_SWEEP_DIR") == str(job0.parent)
    assert "LIT_DTRAIN_SWEEP_DIR" not in os.environ


def test_train_called_from_another_hydra_entry_logs_a_failed_jobs_error(tmp_path, corpus, caplog):
    """A failed sweep job's 'job N failed: Type: message' line, which Hydra's job logging writes to the job's log
    file and scripts/compare_runs.py shows as the job's error, was logged by the root train.py's wrapper only: a
    job of a Hydra app of one's own calling train(cfg) that failed left nothing in its log, and compare_runs
    listed it as 'no metrics logged'. train(cfg) logs it now, with the traceback, once; outside a multirun
    nothing (the error ends the run)."""
    job1 = tmp_path / "sweep" / "1"
    with multirun_job(job1, ["optimizer.lr=1e-3,-1"], ["optimizer.lr=-1"], corpus) as cfg:
        with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):
            train(cfg)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert [(r.name, r.levelno, r.getMessage()) for r in failed] == [
        ("lit_dtrain.train", logging.ERROR, "job 1 failed: ConfigError: optimizer.lr must be > 0, got -1")
    ]
    assert failed[0].exc_info[0] is ConfigError  # the traceback, as the root train.py logged it
    caplog.clear()
    with multirun_job(tmp_path / "runs" / "one", [], ["optimizer.lr=-1"], corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):
            train(cfg)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
