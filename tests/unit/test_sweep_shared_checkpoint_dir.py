"""A multirun whose jobs share one ``paths.checkpoint_dir`` is refused before any job trains: job 0 trained into
the dir and job 1 was then refused because it held job 0's checkpoints (a 2-job ``nano`` sweep spent 88 s before
the error)."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lit_dtrain.sweeps import SweepSyntaxCheck, sweep_checks
from lit_dtrain.train import ConfigError, train
from tests.conftest import CONF_DIR
from tests.unit._sweep_helpers import multirun_job

SHARED = "is one dir for every job of this multirun: job 0 would train into it"


def test_every_job_of_a_sweep_with_one_checkpoint_dir_is_refused_before_it_trains(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    sweep = ["optimizer.lr=1e-3,3e-3", f"paths.checkpoint_dir={ckpt}"]
    for num, lr in (("0", "0.001"), ("1", "0.003")):
        with multirun_job(tmp_path / "sweep" / num, sweep, [f"optimizer.lr={lr}", f"paths.checkpoint_dir={ckpt}"],
                          corpus) as cfg:
            with pytest.raises(ConfigError, match=rf"paths.checkpoint_dir='{ckpt}' {SHARED}.*"
                               rf"'paths.checkpoint_dir={ckpt}/\$\{{hydra:job.num\}}'"):
                train(cfg)
    assert not ckpt.exists()  # job 0 trained nothing there


@pytest.mark.parametrize("sweep", [
    ["optimizer.lr=1e-3,3e-3", "paths.checkpoint_dir=CKPT/${hydra:job.num}"],  # a dir per job
    ["optimizer.lr=1e-3,3e-3", "paths.checkpoint_dir=CKPT/a,CKPT/b"],  # swept itself
    ["optimizer.lr=1e-3", "paths.checkpoint_dir=CKPT"],  # one job
    ["optimizer.lr=1e-3,3e-3"],  # the default, in each job's dir
])
def test_a_checkpoint_dir_that_can_differ_per_job_or_a_one_job_sweep_passes(tmp_path, corpus, sweep):
    sweep = [o.replace("CKPT", str(tmp_path / "ckpt")) for o in sweep]
    job = [o.split(",")[0] for o in sweep]
    with multirun_job(tmp_path / "sweep" / "0", sweep, job, corpus) as cfg:
        sweep_checks(cfg)


def refuse_at_multirun_start(sweep: list[str]) -> None:
    """Run the Hydra callback on ``-m <sweep>`` (its last override the checkpoint dir) and expect it to exit."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        config = compose(config_name="train", overrides=sweep[1:], return_hydra_config=True)
        with open_dict(config):
            config.hydra.overrides.task = sweep
        with pytest.raises(SystemExit):
            SweepSyntaxCheck().on_multirun_start(config, config_name="train")


def test_the_hydra_callback_refuses_it_before_the_sweep_dir_is_made(tmp_path, capsys):
    sweep = ["optimizer.lr=1e-3,3e-3", f"paths.checkpoint_dir={tmp_path}"]
    refuse_at_multirun_start(sweep)
    assert capsys.readouterr().err.startswith(f"error: paths.checkpoint_dir='{tmp_path}' {SHARED}")


def test_an_interval_beside_one_checkpoint_dir_is_judged_not_a_crash(tmp_path, capsys):
    """``interval(...)`` cannot be enumerated: it raised inside the check (Hydra's 'Can only enumerate CHOICE and RANGE
    sweeps'), so the basic sweeper's 16-line traceback came instead of a one-line error (and a sampling sweeper's
    jobs would each have crashed); a sampling sweeper runs several jobs, so it counts as several."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lit_dtrain.sweep_grid import shared_checkpoint_dir_error

    overrides = OverridesParser.create().parse_overrides(["optimizer.lr=interval(1e-4,1e-3)"])
    assert SHARED in shared_checkpoint_dir_error(str(tmp_path), overrides)
    sweep = ["optimizer.lr=interval(1e-4,1e-3)", f"paths.checkpoint_dir={tmp_path}"]
    refuse_at_multirun_start(sweep)
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize(("sweep", "refused"), [
    (["optimizer=glob(*)"], True),  # a glob's options are not listed: two or more jobs
    (["paths=default,other"], False),  # the paths group swept: a checkpoint_dir per job may come with it
    (["optimizer.lr=1e-3,3e-3", "optimizer.lr=2e-3"], False),  # the later value of a key replaces the sweep
])
def test_how_many_jobs_a_sweep_makes_is_read_from_its_overrides(sweep, refused):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lit_dtrain.sweep_grid import shared_checkpoint_dir_error

    overrides = OverridesParser.create().parse_overrides(sweep)
    assert (shared_checkpoint_dir_error("/scratch/ckpt", overrides) is not None) is refused


def at_multirun_start(fixed: list[str], swept: list[str]) -> str | None:
    """Run the Hydra callback on ``-m *fixed *swept`` as Hydra runs it (the master config composed without the swept
    overrides); its ``error:`` line, or None where it let the sweep start."""
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        config = compose(config_name="train", overrides=fixed, return_hydra_config=True)
        with open_dict(config):
            config.hydra.overrides.task = fixed + swept
        try:
            with redirect_stderr(err):
                SweepSyntaxCheck().on_multirun_start(config, config_name="train")
        except SystemExit:
            return err.getvalue().strip()
    return None


def test_an_interpolated_dir_is_judged_by_what_each_job_resolves_to(tmp_path):
    """'paths.checkpoint_dir=/x/${run_name}' with '-m optimizer.lr=1e-3,2e-3' was not judged (an interpolation): job 0
    trained into /x/<time>, and job 1 was refused there, since every job of a multirun has one run_name."""
    error = at_multirun_start([f"paths.checkpoint_dir={tmp_path}/${{run_name}}"], ["optimizer.lr=1e-3,3e-3"])
    assert error is not None
    assert re.match(rf"error: paths.checkpoint_dir='{tmp_path}/\$\{{run_name\}}' is one dir \({tmp_path}/20\d\d-"
                    r"[^)/]+\) for every job of this multirun: job 0 would train into it", error)


def test_a_dir_that_follows_one_swept_key_of_two_names_two_jobs_that_share_it(tmp_path):
    error = at_multirun_start([f"paths.checkpoint_dir={tmp_path}/${{seed}}"], ["optimizer.lr=1e-3,3e-3", "seed=1,2"])
    assert error is not None
    assert error.startswith(f"error: paths.checkpoint_dir='{tmp_path}/${{seed}}' is one dir ({tmp_path}/1) for jobs 0 "
                            "and 2 of this multirun: job 0 would train into it and job 2 be refused")


@pytest.mark.parametrize(("fixed", "swept"), [
    (["paths.checkpoint_dir=CKPT/${run_name}"], ["run_name=a,b"]),  # run_name swept: a dir per job
    (["paths.checkpoint_dir=CKPT/${run_name}/${hydra:job.num}"], ["optimizer.lr=1e-3,3e-3"]),
    (["paths.checkpoint_dir=CKPT/${seed}_${optimizer.lr}"], ["optimizer.lr=1e-3,3e-3", "seed=1,2"]),  # swept keys
    (["paths.checkpoint_dir=CKPT"], ["optimizer=glob(adamw)"]),  # a glob of one option: one job
    (["paths.checkpoint_dir=CKPT/${hydra:job.override_dirname}"], ["optimizer.lr=1e-3,3e-3"]),
])
def test_dirs_that_resolve_apart_and_a_one_option_glob_pass(tmp_path, fixed, swept):
    """Each of these gives every job its own dir (or runs one job); ``optimizer=glob(adamw)`` was counted as two
    jobs and refused."""
    assert at_multirun_start([o.replace("CKPT", str(tmp_path)) for o in fixed], swept) is None


def test_an_override_dirname_without_the_swept_key_is_one_dir(tmp_path):
    """``${hydra:job.override_dirname}`` was taken for a dir per job unjudged; with the swept key in
    ``hydra.job.config.override_dirname.exclude_keys`` it is one dir: a real 2-job sweep trained job 0 there and job 1
    was refused ('already holds checkpoints of an earlier run')."""
    error = at_multirun_start([f"paths.checkpoint_dir={tmp_path}/${{hydra:job.override_dirname}}",
                               "hydra.job.config.override_dirname.exclude_keys=[optimizer.lr]"],
                              ["optimizer.lr=1e-3,3e-3"])
    assert error is not None and "for every job of this multirun: job 0 would train into it" in error


def test_a_job_of_an_entry_point_without_the_callback_judges_the_resolved_dirs_too(tmp_path):
    """``train(cfg)``'s own check (any Hydra app, no ``SweepSyntaxCheck``) read the sweep's overrides resolved in the
    job: '${hydra:job.num}' of multirun.yaml read this job's number for every job. Each job composes the others."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from lit_dtrain.sweep_grid import check_shared_checkpoint_dir
    from tests.conftest import in_hydra_job

    def judge(num: int, fixed: list[str], swept: str) -> None:
        job = [*fixed, swept.replace("1e-3,3e-3", ("0.001", "0.003")[num])]
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            full = compose(config_name="train", overrides=job, return_hydra_config=True)
            with open_dict(full):
                full.hydra.mode, full.hydra.job.num = "MULTIRUN", num
                full.hydra.runtime.output_dir = str(tmp_path / "sweep" / str(num))
                full.hydra.overrides.task = job
            assert full.run_name  # resolved once: every job of a real multirun had the time it started
            (tmp_path / "sweep").mkdir(exist_ok=True)
            OmegaConf.save({"hydra": {"overrides": {"task": [*fixed, swept]}}}, tmp_path / "sweep" / "multirun.yaml")
            with in_hydra_job(full) as cfg:
                check_shared_checkpoint_dir(cfg, HydraConfig.get())

    for num in (0, 1):
        judge(num, [f"paths.checkpoint_dir={tmp_path}/j${{hydra:job.num}}"], "optimizer.lr=1e-3,3e-3")
    with pytest.raises(ConfigError, match=rf"is one dir \({tmp_path}/20\d\d-[^)]+\) for every job"):
        judge(0, [f"paths.checkpoint_dir={tmp_path}/${{run_name}}"], "optimizer.lr=1e-3,3e-3")
