"""``hydra.job.chdir=true``: Hydra runs the job inside its run dir, and relative paths given on the command line still
mean what they meant in the directory the command ran in (``lit_dtrain._chdir_paths``)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lit_dtrain._chdir_paths import absolute_paths_under_chdir
from lit_dtrain.sweeps import reports_user_errors
from lit_dtrain.train import ConfigError, train
from tests.conftest import CONF_DIR, TINY, in_hydra_job


@contextlib.contextmanager
def hydra_job(run_dir: Path, overrides: list[str], cwd: Path | None = None, config_name: str = "train"):
    """The config of ``python train.py *overrides`` inside the job as Hydra runs it: Hydra's runtime config set (the
    command ran in ``cwd``, where given), the run dir ``run_dir``; ``config_name``: ``--config-name``."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(full):
        full.hydra.runtime.output_dir = str(run_dir)
        if "paths" in full:
            full.paths.output_dir = str(run_dir)
        full.hydra.overrides.task = overrides
        if cwd is not None:
            full.hydra.runtime.cwd = str(cwd)
    with in_hydra_job(full) as cfg:
        yield cfg


@contextlib.contextmanager
def chdir_job(start: Path, overrides: list[str], monkeypatch):
    """``python train.py hydra.job.chdir=true *overrides`` typed in ``start``: the working dir is the run dir."""
    run_dir = start / "outputs" / "runs" / "r"
    run_dir.mkdir(parents=True)
    monkeypatch.chdir(run_dir)
    with hydra_job(run_dir, ["hydra.job.chdir=true", "run_name=r", *overrides], cwd=start) as cfg:
        yield cfg


def test_relative_paths_stay_the_commands_under_chdir(tmp_path, monkeypatch):
    """A relative LIT_DTRAIN_CACHE put a token cache into each run dir, and a corpus glob matched nothing there."""
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", "out")
    monkeypatch.setenv("LIT_DTRAIN_CACHE", "cache")
    overrides = ["data=textfiles", "data.sources.0.paths=[corpus/*.txt,/abs/x.txt]", "init_from=runs/a/last.ckpt",
                 "ckpt_path='~/b.ckpt'", "decay_branch.ckpt=../c.ckpt", "callbacks=[default,loss_spike]",
                 "callbacks.loss_spike.path=spikes.jsonl"]
    with chdir_job(tmp_path, overrides, monkeypatch) as cfg:
        absolute_paths_under_chdir(cfg)
    assert list(cfg.data.sources[0].paths) == [str(tmp_path / "corpus/*.txt"), "/abs/x.txt"]
    assert cfg.init_from == str(tmp_path / "runs/a/last.ckpt")
    assert cfg.decay_branch.ckpt == str(tmp_path.parent / "c.ckpt")
    assert cfg.ckpt_path == str(Path("~/b.ckpt").expanduser())
    assert (cfg.paths.log_dir, cfg.data.cache_dir) == (str(tmp_path / "out"), str(tmp_path / "cache"))
    assert list(cfg.data.exclude_dirs) == [str(tmp_path / "out")]
    assert cfg.callbacks.loss_spike.path == str(tmp_path / "spikes.jsonl")
    assert cfg.trainer.default_root_dir == str(tmp_path / "outputs/runs/r")  # absolute already: kept


def test_train_reads_a_relative_init_from_where_the_command_ran(tmp_path, monkeypatch):
    """``init_from=runs/base/checkpoints/last.ckpt hydra.job.chdir=True`` was refused: 'does not exist' (looked up in
    the new run dir); now the file beside the command is read (a damaged one here: refused, naming its full path)."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "last.ckpt").write_bytes(b"not a checkpoint")
    with chdir_job(tmp_path, [*TINY, "init_from=runs/last.ckpt"], monkeypatch) as cfg:
        with pytest.raises(ConfigError, match=r"init_from") as err:
            train(cfg)
    assert "does not exist" not in str(err.value)
    assert str(tmp_path / "runs" / "last.ckpt") in str(err.value)


def test_an_unset_environment_variable_is_one_line(tmp_path, capsys, monkeypatch):
    """``'init_from=${oc.env:NOPE_VAR}/x.ckpt'`` with NOPE_VAR unset ended in OmegaConf's traceback (raised where
    lit_dtrain read the overrides); now one line names the variable and the default syntax."""
    monkeypatch.delenv("LIT_DTRAIN_TEST_UNSET", raising=False)
    with hydra_job(tmp_path / "run", [*TINY, "init_from=${oc.env:LIT_DTRAIN_TEST_UNSET}/x.ckpt"]) as cfg:
        with pytest.raises(SystemExit):
            reports_user_errors(train)(cfg)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: environment variable LIT_DTRAIN_TEST_UNSET is not set (read by ${oc.env:LIT_DTRAIN_TEST_UNSET}): set "
        "it, or give a default, ${oc.env:LIT_DTRAIN_TEST_UNSET,<default>}")


def test_lightnings_ckpt_path_names_are_not_made_paths_under_chdir(tmp_path, monkeypatch):
    """``ckpt_path=last hydra.job.chdir=true`` was refused as ''<cwd>/last' does not exist', without the hint that
    Lightning's name is not read here (resume=auto is); a file of that name where the command ran is still a file."""
    with chdir_job(tmp_path, [*TINY, "ckpt_path=last"], monkeypatch) as cfg:
        with pytest.raises(ConfigError, match=r"^ckpt_path='last' does not exist \(Lightning's ckpt_path='last' is "
                                              r"not read here: resume=auto"):
            train(cfg)
    for start, file in ((tmp_path / "x", False), (tmp_path / "y", True)):
        start.mkdir()
        if file:
            (start / "best").write_bytes(b"")
        with chdir_job(start, ["ckpt_path=best"], monkeypatch) as cfg:
            absolute_paths_under_chdir(cfg)
        assert cfg.ckpt_path == (str(start / "best") if file else "best")


def test_a_relative_checkpoint_dir_is_the_commands_under_chdir(tmp_path, monkeypatch):
    """``paths.checkpoint_dir=ck_rel hydra.job.chdir=true`` put the checkpoints in ``<run dir>/ck_rel`` (summary:
    'ckpt=ck_rel/last.ckpt'), where the same command without chdir puts them in ``<cwd>/ck_rel``."""
    with chdir_job(tmp_path, ["paths.checkpoint_dir=ck_rel", "callbacks.preemption.dirpath=pre"], monkeypatch) as cfg:
        absolute_paths_under_chdir(cfg)
        assert cfg.paths.checkpoint_dir == cfg.callbacks.model_checkpoint.dirpath == str(tmp_path / "ck_rel")
        assert cfg.callbacks.preemption.dirpath == str(tmp_path / "pre")
