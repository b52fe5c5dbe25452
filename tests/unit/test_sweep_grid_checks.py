"""The sweep checks' reading of a multirun's grid: a nested group swept on the command line is the config node
``data.sampler`` for ``resume=auto``'s check, and the command line's values of a key replace an experiment's in the
check for a repeated point (Hydra sweeps those)."""

from __future__ import annotations

import logging

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from lit_dtrain.sigterm_exit import _the_sweeps_last_job, train_resume_hint
from lit_dtrain.sweep_grid import sweep_dir_of, sweep_job_count, warn_if_the_grid_repeats_a_point
from lit_dtrain.sweeps import check_resumed_job
from lit_dtrain.train import ConfigError
from tests.unit._sweep_helpers import multirun_job


def test_a_nested_group_swept_on_the_command_line_is_checked_on_resume(tmp_path, corpus):
    """``-m data/sampler=random,fourier`` re-run with ``resume=auto`` and the values in another order: job 0 would
    resume the random-sampler run with the FourierSampler."""
    job0 = tmp_path / "sweep" / "0"
    with multirun_job(job0, ["data/sampler=random,fourier"], ["data/sampler=random"], corpus) as cfg:
        job0.mkdir(parents=True)
        (job0 / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as train(cfg) writes it
    with multirun_job(job0, ["data/sampler=fourier,random", "resume=auto"], ["data/sampler=fourier", "resume=auto"],
                      corpus) as cfg:
        with pytest.raises(ConfigError, match=r"was trained with data.sampler=lit_dtrain.data.samplers.RandomSampler"):
            check_resumed_job(cfg)


def test_the_command_lines_values_replace_an_experiments_in_the_repeat_check(tmp_path, corpus, caplog):
    """An experiment's grid that lists a value twice, replaced on the command line by distinct values: Hydra sweeps
    the command line's, so nothing repeats (the experiment's were read and warned about)."""
    with multirun_job(tmp_path / "sweep" / "0", ["optimizer.lr=1e-3,3e-3"], ["optimizer.lr=0.001"], corpus):
        hydra = HydraConfig.get()
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):
            hydra.sweeper.params = {"optimizer.lr": "1e-3,1e-3"}
        with caplog.at_level(logging.WARNING):
            warn_if_the_grid_repeats_a_point(hydra)
            assert caplog.messages == []
            hydra.sweeper.params = {"optimizer.lr": "1e-3,3e-3"}  # and the command line's repeated one is warned of
            OmegaConf.save({"hydra": {"overrides": {"task": ["optimizer.lr=1e-3,1e-3"]}}},
                           tmp_path / "sweep" / "multirun.yaml")
            warn_if_the_grid_repeats_a_point(hydra)
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("job 1 of this multirun trains the same "
                                                                        "configuration as job 0 (optimizer.lr=0.001)")


@pytest.mark.parametrize("mode", ["run", "multirun"])
def test_an_override_with_a_relative_interpolation_passes_the_sweep_checks(tmp_path, corpus, mode):
    """``python train.py 'data.val_batch_size=${.batch_size}'`` (valid: relative to ``data``): the checks read the
    overrides resolved, each line inside Hydra's list, where ``.batch_size`` indexes the list; the run failed with
    'Index 'batch_size' (str) is not an int' in a traceback. They read them as typed now."""
    from hydra.types import RunMode

    from lit_dtrain.sweeps import sweep_checks

    job = ["data.val_batch_size=${.batch_size}", "run_name=x"]
    run_mode = RunMode.RUN if mode == "run" else RunMode.MULTIRUN
    with multirun_job(tmp_path / "sweep" / "0", job, job, corpus, mode=run_mode) as cfg:
        sweep_checks(cfg)
        assert cfg.data.val_batch_size == cfg.data.batch_size


def test_the_sweeps_job_count_is_the_product_of_its_swept_values(tmp_path, corpus):
    """The job count that tells a sweep's last job (a SIGTERM in its end-of-run sample said 'the sweep's later jobs do
    not start', with none left): the basic sweeper's grid, the command line's value of a key replacing an
    experiment's; unknown (None) under a launcher that runs jobs side by side."""
    sweep = ["optimizer.lr=1e-3,3e-3", "scheduler=wsd,cosine", "data.batch_size=range(2,8,2)", "seed=3"]
    job = ["optimizer.lr=3e-3", "scheduler=cosine", "data.batch_size=6", "seed=3"]
    with multirun_job(tmp_path / "sweep" / "11", sweep, job, corpus):
        hydra = HydraConfig.get()
        assert sweep_job_count(hydra) == 12
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):
            hydra.sweeper.params = {"data.batch_size": "4,8", "data.seed": "1,2,3"}
            assert sweep_job_count(hydra) == 36  # batch_size: the command line's 3 values; data.seed: 3 more
            hydra.launcher._target_ = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
            assert sweep_job_count(hydra) is None


def test_the_sweeps_job_count_is_the_basic_sweepers_own(tmp_path, corpus):
    """The last job was told by swept keys counted by hand: '++optimizer.lr=3e-3,4e-3' replaced
    'optimizer.lr=1e-3,2e-3' (Hydra runs 4 jobs, counted 2: job 1 took a SIGTERM in its sample for one after the last
    job, exit 0, and jobs 2 and 3 ran on), and a single value on the command line did not replace an experiment's
    swept key ('-m experiment=wsd_vs_cosine scheduler=wsd optimizer.lr=1e-3': 1 job, counted 6, so its SIGTERM said
    'the sweep's later jobs do not start', exit 143). The grid is the one the sweeper expanded (multirun.yaml's)."""
    sweep = ["optimizer.lr=1e-3,2e-3", "++optimizer.lr=3e-3,4e-3"]
    with multirun_job(tmp_path / "sweep" / "1", sweep, ["optimizer.lr=1e-3", "++optimizer.lr=4e-3"], corpus):
        hydra = HydraConfig.get()
        assert sweep_job_count(hydra) == 4
        multirun = tmp_path / "sweep" / "multirun.yaml"
        grid = {"scheduler": "wsd,cosine", "optimizer.lr": "1e-3,3e-3,1e-2"}  # experiment=wsd_vs_cosine's
        task = ["experiment=wsd_vs_cosine", "scheduler=wsd", "optimizer.lr=1e-3"]
        OmegaConf.save({"hydra": {"overrides": {"task": task}, "sweeper": {"params": grid}}}, multirun)
        assert sweep_job_count(hydra) == 1
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):  # a swept experiment: the job's config has its grid, which the sweeper never saw
            hydra.sweeper.params = grid
        task = ["experiment=cpt_replay,wsd_vs_cosine"]
        OmegaConf.save({"hydra": {"overrides": {"task": task}, "sweeper": {"params": None}}}, multirun)
        assert sweep_job_count(hydra) == 2


def test_the_sweeps_job_count_reads_its_multirun_file_once(tmp_path, corpus, monkeypatch):
    """Each job's end asks whether it is the sweep's last (the late-signal agreement of a DDP sweep): multirun.yaml was
    loaded and its overrides parsed at every job, 0.6-0.9 s a job on each rank of a 2-rank gloo sweep on a loaded
    2-core machine, against 27-69 ms for the agreement's gather itself. The same file is read once; a sweep started
    again in that dir (another multirun.yaml) is read anew."""
    with multirun_job(tmp_path / "sweep" / "1", ["optimizer.lr=1e-3,2e-3"], ["optimizer.lr=2e-3"], corpus):
        hydra = HydraConfig.get()
        assert sweep_job_count(hydra) == 2
        with monkeypatch.context() as patched:
            patched.setattr(OmegaConf, "load", lambda *a, **k: pytest.fail("multirun.yaml read again"))
            assert sweep_job_count(hydra) == 2 and _the_sweeps_last_job()
        OmegaConf.save({"hydra": {"overrides": {"task": ["optimizer.lr=1e-3,2e-3,3e-3"]}}},
                       tmp_path / "sweep" / "multirun.yaml")
        assert sweep_job_count(hydra) == 3 and not _the_sweeps_last_job()


@pytest.mark.parametrize(
    "grid, task, message",
    [  # counted by hand (each swept key's values alone): 4 jobs of 2 points passed, 1 job was warned of
        (None, ["optimizer.lr=1e-3,2e-3", "++optimizer.lr=3e-3,4e-3"],
         "job 2 of this multirun trains the same configuration as job 0 (++optimizer.lr=0.003): "
         "'++optimizer.lr=0.003' replaces job 0's 'optimizer.lr=0.001' and job 2's 'optimizer.lr=0.002'; its 4 jobs "
         "train 2 distinct configurations"),
        (None, ["optimizer.lr=1e-3,1e-3", "optimizer.lr=3e-3"], None),
        ({"optimizer.lr": "1e-3,1e-3", "scheduler": "wsd,cosine"}, ["experiment=x", "optimizer.lr=3e-3"], None),
        (None, ["seed=range(1,3)", "optimizer.lr=1e-3,0.001"],
         "job 1 of this multirun trains the same configuration as job 0 (seed=1 optimizer.lr=0.001): a swept value is "
         "listed twice; its 4 jobs train 2 distinct configurations"),
        (None, ["seed=range(1,3)", "optimizer.lr=3e-3"], None),
        # another package of one group is another node: 'job 1 ... trains the same configuration as job 0
        # (+model@teacher=nano): '+model@teacher=nano' replaces job 0's 'model=nano' and job 1's 'model=small''
        (None, ["model=nano,small", "+model@teacher=nano"], None),
        (None, ["model=nano,nano", "+model@teacher=nano"],
         "job 1 of this multirun trains the same configuration as job 0 (model=nano): a swept value is listed twice; "
         "its 2 jobs train 1 distinct configurations"),
    ],
)
def test_a_repeated_point_is_judged_on_the_basic_sweepers_jobs(tmp_path, corpus, caplog, grid, task, message):
    """The repeat check reads the jobs the basic sweeper runs (as the job count does): each job's final value of a
    key, after a later override of it."""
    with multirun_job(tmp_path / "sweep" / "0", ["seed=1"], ["seed=1"], corpus):
        hydra = HydraConfig.get()
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):  # the job's config has its experiment's grid
            hydra.sweeper.params = grid
        OmegaConf.save({"hydra": {"overrides": {"task": task}, "sweeper": {"params": grid}}},
                       tmp_path / "sweep" / "multirun.yaml")
        with caplog.at_level(logging.WARNING):
            warn_if_the_grid_repeats_a_point(hydra)
    assert caplog.messages == ([message] if message else [])


@pytest.mark.parametrize("subdir", ["lr/${hydra:job.num}", "${hydra:job.num}", "./${hydra:job.num}"])
def test_a_sweep_subdir_of_several_parts_is_read_up_to_the_sweep_dir(tmp_path, corpus, subdir):
    """The sweep dir was taken for the run dir's parent: with 'hydra.sweep.subdir=lr/${optimizer.lr}' a 1-job sweep
    signalled in its sample found no multirun.yaml there (sweep/lr), so the count was unknown and it exited 143 'the
    sweep's later jobs do not start; resume with the same -m arguments and resume=auto hydra.sweep.dir=<sweep>/lr'."""
    sweep = tmp_path / "sweep"
    job_dir = sweep / "lr" / "0" if subdir.startswith("lr/") else sweep / "0"
    with multirun_job(job_dir, ["optimizer.lr=1e-3"], ["optimizer.lr=1e-3"], corpus):
        hydra = HydraConfig.get()
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):
            hydra.sweep.subdir = subdir
        (job_dir.parent / "multirun.yaml").rename(sweep / "multirun.yaml.moved")
        (sweep / "multirun.yaml.moved").rename(sweep / "multirun.yaml")
        assert sweep_job_count(hydra) == 1 and _the_sweeps_last_job()
        assert train_resume_hint(None) == f"the same -m arguments and resume=auto hydra.sweep.dir={sweep}"


@pytest.mark.parametrize("subdir", [".", "absolute"])
def test_a_sweep_subdir_of_the_sweep_dir_itself_or_an_absolute_one_reads_the_sweep_dir(tmp_path, corpus, subdir):
    """'hydra.sweep.subdir=.' runs each job in the sweep dir itself, and an absolute subdir in that path alone: the
    sweep dir was taken for the run dir's parent, outside the sweep (no multirun.yaml there: a 1-job sweep signalled
    in its sample exited 143 'the sweep's later jobs do not start', naming the parent to resume; DDP's rank 1 was
    pinned to that parent and ran its job in it)."""
    sweep = tmp_path / "sweep"
    run_dir = sweep if subdir == "." else tmp_path / "elsewhere" / "0"
    with multirun_job(sweep / "0", ["optimizer.lr=1e-3"], ["optimizer.lr=1e-3"], corpus):
        hydra = HydraConfig.get()
        OmegaConf.set_readonly(hydra, False)
        with open_dict(hydra):
            hydra.sweep.dir = str(sweep)
            hydra.sweep.subdir = "." if subdir == "." else str(run_dir)
            hydra.runtime.output_dir = str(run_dir)  # Hydra's os.path.join(sweep.dir, subdir)
        assert sweep_dir_of(hydra) == sweep
        assert sweep_job_count(hydra) == 1 and _the_sweeps_last_job()
        assert train_resume_hint(None) == f"the same -m arguments and resume=auto hydra.sweep.dir={sweep}"


def test_the_repeated_point_warning_is_rank_0s(tmp_path, corpus, caplog, monkeypatch):
    """Lightning's launcher starts rank 1 with the same -m arguments, whose job 0 ran the checks again: a DDP sweep
    printed 'job 1 of this multirun trains the same configuration as job 0 ...' once per rank."""
    from lightning.pytorch.utilities import rank_zero_only

    with multirun_job(tmp_path / "sweep" / "0", ["seed=1,1"], ["seed=1"], corpus):
        for rank in (1, 0):
            monkeypatch.setattr(rank_zero_only, "rank", rank)
            with caplog.at_level(logging.WARNING):
                warn_if_the_grid_repeats_a_point(HydraConfig.get())
    assert caplog.messages == ["job 1 of this multirun trains the same configuration as job 0 (seed=1): a swept "
                               "value is listed twice; its 2 jobs train 1 distinct configurations"]
