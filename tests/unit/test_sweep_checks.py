"""The sweep checks that ``train(cfg)`` runs under Hydra (``lit_dtrain.sweeps``): ``resume=auto`` in a multirun
resumes job N from ``<sweep dir>/N`` only if it was trained with the same swept values, and a config that sweeps
only with ``-m`` says so without it. The jobs run in-process under a Hydra runtime config set up the way Hydra sets
it (mode, job dir, this start's ``multirun.yaml``: _sweep_helpers.py). (How a failed job is reported is in
test_sweep_error_reports.py.)"""

from __future__ import annotations

import json
import logging
import os

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from lit_dtrain.sweeps import check_resumed_job, sweep_checks
from lit_dtrain.train import ConfigError, train
from tests.unit._sweep_helpers import multirun_job


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


def test_a_sweep_rerun_into_its_dir_without_resume_names_the_sweep_dir_not_run_name(tmp_path, corpus):
    """'-m optimizer.lr=1e-3,3e-3 hydra.sweep.dir=<a finished sweep>' without resume=auto is refused in each job, and
    the refusal advised 'or choose another run_name': a multirun's job N trains in <sweep dir>/N whatever run_name
    says, so the re-run with another run_name was refused the same. It names hydra.sweep.dir in a multirun now; a
    single run's refusal still names run_name."""
    from lit_dtrain.resume import resolve_ckpt_path

    job0 = tmp_path / "sweep" / "0"
    (job0 / "checkpoints").mkdir(parents=True)
    (job0 / "checkpoints" / "last.ckpt").write_bytes(b"x")  # a finished job's checkpoint (not read here)
    sweep, job = ["optimizer.lr=1e-3,3e-3", "run_name=other"], ["optimizer.lr=0.001", "run_name=other"]
    with multirun_job(job0, sweep, job, corpus) as cfg:
        with pytest.raises(ConfigError) as refused:
            resolve_ckpt_path(cfg)
    assert str(refused.value).endswith(
        "continue it with resume=auto or ckpt_path=PATH, or choose another hydra.sweep.dir (job N of a multirun "
        "trains in <sweep dir>/N; run_name is not used)"), str(refused.value)
    with multirun_job(job0, [], job, corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(ConfigError, match=r"ckpt_path=PATH, or choose another run_name$"):
            resolve_ckpt_path(cfg)


def test_a_multirun_given_a_run_name_says_where_its_jobs_train(tmp_path, corpus, caplog):
    """`python train.py -m run_name=lr_sweep optimizer.lr=1e-3,3e-3` trained its jobs in multiruns/<time>/N without
    a word, and outputs/runs/lr_sweep, where the user looked for them, did not exist. Job 0 warns now."""
    from lit_dtrain.sweeps import sweep_checks

    sweep, job = ["run_name=lr_sweep", "optimizer.lr=1e-3,3e-3"], ["run_name=lr_sweep", "optimizer.lr=0.001"]
    with multirun_job(tmp_path / "sweep" / "0", sweep, job, corpus) as cfg:
        sweep_checks(cfg)
    assert caplog.messages == [
        f"run_name=lr_sweep does not name a multirun's dirs: job N trains in {tmp_path / 'sweep'}/N; name a sweep "
        "with 'hydra.sweep.dir=${paths.log_dir}/multiruns/<name>'"]
    caplog.clear()
    with multirun_job(tmp_path / "sweep" / "1", sweep, ["run_name=lr_sweep", "optimizer.lr=0.003"], corpus) as cfg:
        sweep_checks(cfg)  # once a sweep
    with multirun_job(tmp_path / "runs" / "lr_sweep", [], job, corpus, mode=RunMode.RUN) as cfg:
        sweep_checks(cfg)  # a single run: run_name names its dir
    assert caplog.messages == []


def test_a_multirun_whose_grid_repeats_a_point_says_so(tmp_path, corpus, caplog):
    """`-m optimizer.lr=1e-3,1e-3` (a typo for 3e-3) trained the same run twice without a word, and compare_runs
    labelled the two rows '0' and '1' (no value differs). Job 0 warns now; 1e-3 and 0.001 are one value."""
    from lit_dtrain.sweeps import sweep_checks

    sweep = ["seed=range(1,3)", "optimizer.lr=1e-3,0.001,3e-3"]
    with multirun_job(tmp_path / "sweep" / "0", sweep, ["seed=1", "optimizer.lr=0.001"], corpus) as cfg:
        sweep_checks(cfg)
    assert caplog.messages == ["job 1 of this multirun trains the same configuration as job 0 (seed=1 "
                               "optimizer.lr=0.001): a swept value is listed twice; its 6 jobs train 4 distinct "
                               "configurations"]
    caplog.clear()
    with multirun_job(tmp_path / "sweep" / "1", sweep, ["seed=1", "optimizer.lr=0.001"], corpus) as cfg:
        sweep_checks(cfg)  # once a sweep
    sweep = ["seed=range(1,3)", "optimizer.lr=1e-3,3e-3", "data/sampler=random,fourier"]
    with multirun_job(tmp_path / "other" / "0", sweep, ["seed=1", "optimizer.lr=0.001"], corpus) as cfg:
        sweep_checks(cfg)
    assert caplog.messages == []


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


def test_an_experiment_grid_over_a_nested_group_is_checked_on_resume(tmp_path, corpus):
    """An experiment file whose hydra.sweeper.params sweeps a nested config group (`data/sampler: random,fourier`),
    re-run with resume=auto and the values in another order: the key was looked up as 'data/sampler', which no
    config has, so job 0 resumed the random-sampler run with the FourierSampler, silently. It is the node
    data.sampler, as for the same sweep on the command line."""
    job0 = tmp_path / "sweep" / "0"
    with multirun_job(job0, [], ["data/sampler=random"], corpus) as cfg:
        job0.mkdir(parents=True)
        (job0 / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as train(cfg) writes it
    with multirun_job(job0, ["resume=auto"], ["data/sampler=fourier", "resume=auto"], corpus) as cfg:
        hydra = HydraConfig.get()
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):
            hydra.sweeper.params = {"data/sampler": "fourier,random"}  # the experiment's grid, reordered
        with pytest.raises(ConfigError, match=rf"resume=auto: {job0} was trained with data.sampler="
                                              r"lit_dtrain.data.samplers.RandomSampler, this job sets "
                                              r"data.sampler=lit_dtrain.data.samplers.FourierSampler: "):
            check_resumed_job(cfg)


def test_a_multirun_whose_jobs_run_on_different_numbers_of_processes_is_refused_before_fit(tmp_path, corpus,
                                                                                            monkeypatch):
    """'-m trainer=ddp_cpu trainer.devices=2,1': Lightning starts rank 1 once, in job 0, re-running the whole -m
    sweep; in job 1 rank 1 failed with 'IndexError: list index out of range' and rank 0 with a closed gloo
    connection. ('devices=1,2' trained only because rank 1's run of job 0 was refused: its dir held checkpoints.) A
    job on another number of processes than an earlier job of its sweep is refused now, before fit starts a rank."""
    import lit_dtrain.train as train_module

    class Fit(Exception):
        pass

    def fit(*args):
        raise Fit  # no training here: which job reaches fit is what is tested

    monkeypatch.setattr(train_module, "_fit", fit)
    ddp = ["trainer=ddp_cpu", "trainer.accelerator=cpu", "strategy=ddp"]
    sweep = ["trainer.devices=1,2", *ddp]
    with multirun_job(tmp_path / "sweep" / "0", sweep, ["trainer.devices=1", *ddp], corpus) as cfg:
        with pytest.raises(Fit):
            train(cfg)
    with multirun_job(tmp_path / "sweep" / "1", sweep, ["trainer.devices=2", *ddp], corpus) as cfg:
        with pytest.raises(ConfigError) as refused:
            train(cfg)
    assert str(refused.value).startswith(
        "job 1 runs on 2 process(es) (trainer.devices=2, trainer.num_nodes=1) and job 0 of this multirun on 1: "
        "Lightning starts a sweep's other ranks once, each re-running the whole -m sweep"), str(refused.value)
    with multirun_job(tmp_path / "other" / "0", ["trainer.devices=2", *ddp], ["trainer.devices=2", *ddp],
                      corpus) as cfg:
        with pytest.raises(Fit):  # another sweep: its own first job
            train(cfg)


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


def test_a_swept_experiment_whose_grid_was_not_expanded_says_so(tmp_path, corpus, caplog):
    """'-m experiment=wsd_vs_cosine,cpt_replay' ran wsd_vs_cosine as one job (the default schedule and LR), not its
    6-job grid, without a word: Hydra takes hydra.sweeper.params from the config it composes before the sweep,
    which has no experiment when the experiment is swept. The job now warns, naming the grid and the -m to run."""
    job_dir = tmp_path / "sweep" / "0"
    with multirun_job(job_dir, ["experiment=wsd_vs_cosine,cpt_replay"], ["experiment=wsd_vs_cosine"], corpus) as cfg:
        OmegaConf.save({"hydra": {"sweeper": {"params": None}, "overrides": {"task": ["experiment=wsd_vs_cosine,"
                                                                                     "cpt_replay"]}}},
                       job_dir.parent / "multirun.yaml")  # as Hydra writes it: the sweep's grid, empty
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.sweeps"):
            sweep_checks(cfg)
    assert ("experiment=wsd_vs_cosine sweeps scheduler=wsd,cosine optimizer.lr=1e-3,3e-3,1e-2 (its "
            "hydra.sweeper.params), but this multirun did not expand that grid") in caplog.text
    assert "Run each such experiment in a -m of its own: python train.py -m experiment=wsd_vs_cosine" in caplog.text
    caplog.clear()
    with multirun_job(job_dir, ["experiment=wsd_vs_cosine"], ["experiment=wsd_vs_cosine", "scheduler=wsd",
                                                              "optimizer.lr=0.001"], corpus) as cfg:
        OmegaConf.save({"hydra": {"sweeper": {"params": {"scheduler": "wsd,cosine", "optimizer.lr": "1e-3,3e-3,1e-2"}},
                                  "overrides": {"task": ["experiment=wsd_vs_cosine"]}}},
                       job_dir.parent / "multirun.yaml")  # the experiment alone: its grid was the sweep's
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.sweeps"):
            sweep_checks(cfg)
    assert "did not expand" not in caplog.text


def test_a_reordered_resume_refuses_the_jobs_the_killed_sweep_never_started_too(tmp_path, corpus):
    """A sweep '-m optimizer.lr=1e-3,3e-3' killed in job 0, re-run as '3e-3,1e-3 resume=auto hydra.sweep.dir=...':
    job 0 was refused, but Hydra ran job 1, which had no run dir yet, and it trained <sweep>/1 with lr=1e-3 (job 0's
    value); the re-run in the right order then refused job 1 (trained with 0.001, sets 0.003). A later job of a
    re-run that refused a job for its order is refused too; the right order still starts it."""
    job0, job1 = tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"
    with multirun_job(job0, ["optimizer.lr=1e-3,3e-3"], ["optimizer.lr=0.001"], corpus) as cfg:
        job0.mkdir(parents=True)
        (job0 / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as train(cfg) writes it
    reordered = ["optimizer.lr=3e-3,1e-3", "resume=auto"]
    with multirun_job(job0, reordered, ["optimizer.lr=0.003", "resume=auto"], corpus) as cfg:
        with pytest.raises(ConfigError, match="was trained with optimizer.lr=0.001"):
            check_resumed_job(cfg)
    with multirun_job(job1, reordered, ["optimizer.lr=0.001", "resume=auto"], corpus) as cfg:
        with pytest.raises(ConfigError) as refused:
            check_resumed_job(cfg)
    assert str(refused.value) == (
        f"resume=auto: {job1} holds no run yet, and an earlier job of this re-run was refused ({job0} was trained "
        "with optimizer.lr=0.001): these -m values are in another order than that sweep's, so this job would train "
        "its dir with another job's values; re-run the sweep with the same -m arguments in the same order (or resume "
        "into another hydra.sweep.dir)"
    )
    in_order = ["optimizer.lr=1e-3,3e-3", "resume=auto"]
    with multirun_job(job1, in_order, ["optimizer.lr=0.003", "resume=auto"], corpus) as cfg:
        check_resumed_job(cfg)  # job 1 of the sweep's own order: started
