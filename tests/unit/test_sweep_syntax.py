"""A sweep Hydra's basic sweeper cannot run, interval(...), is refused in one line naming the key and what to write;
it was Hydra's 16-line traceback ending in 'BasicSweeper does not support sweep type : INTERVAL_SWEEP'."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lit_dtrain.sweeps import SweepSyntaxCheck
from tests.conftest import run_script

BASIC = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def multirun_config(task: list[str], params: dict | None = None, sweeper: str = BASIC):
    return OmegaConf.create({"hydra": {"sweeper": {"_target_": sweeper, "params": params},
                                       "overrides": {"task": task}}})


def test_an_interval_typed_or_in_an_experiment_grid_is_refused_and_listed_values_pass(capsys):
    for config, line in [
        (multirun_config(["model=nano", "optimizer.lr=interval(1e-4,1e-3)"]), "optimizer.lr=interval(1e-4,1e-3)"),
        (multirun_config([], {"scheduler": "wsd,cosine", "model.dropout": "interval(0,0.2)"}),
         "model.dropout=interval(0,0.2)"),
    ]:
        with pytest.raises(SystemExit) as stop:
            SweepSyntaxCheck().on_multirun_start(config=config)
        assert stop.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {line}: Hydra's basic sweeper runs listed values, not an interval")
        assert "range(start,stop,step) or choice(...)" in err and err.count("\n") == 1
    # what the basic sweeper runs, and interval() under a sampling sweeper, pass
    listed = ["optimizer.lr=1e-3,3e-3", "seed=range(1,4)", "data/sampler=choice(random,fourier)",
              "experiment=glob(*)"]
    SweepSyntaxCheck().on_multirun_start(config=multirun_config(listed, {"scheduler": "wsd,cosine"}))
    optuna = multirun_config(["optimizer.lr=interval(1e-4,1e-3)"], sweeper="hydra_plugins.x.OptunaSweeper")
    SweepSyntaxCheck().on_multirun_start(config=optuna)
    assert capsys.readouterr().err == ""


def test_train_py_refuses_an_interval_sweep_in_one_line_before_its_sweep_dir(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    proc = run_script("../train.py", ["-m", "optimizer.lr=interval(1e-4,1e-3)", "trainer.max_steps=1"], tmp_path,
                      capfd)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: optimizer.lr=interval(1e-4,1e-3): Hydra's basic sweeper runs listed values, not an interval (that "
        "needs a sampling sweeper plugin, e.g. Optuna's: hydra/sweeper=optuna); list them, "
        "optimizer.lr=1e-4,3e-4,1e-3, or use range(start,stop,step) or choice(...)"
    ]
    assert not (tmp_path / "out").exists()  # no sweep dir of nothing


def test_a_swept_group_option_that_does_not_exist_is_refused_naming_it(capsys):
    from hydra import initialize_config_dir

    from tests.conftest import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for task, params, line, group, option in [
            (["model=nano,doesnotexist"], None, "model=nano,doesnotexist", "model", "doesnotexist"),
            (["strategy=ddp_compressed/int8_rs,ddp_compressed/int9"], None,
             "strategy=ddp_compressed/int8_rs,ddp_compressed/int9", "strategy/ddp_compressed", "int9"),
            (["callbacks=[default,loss_spike],[default,los_spike]"], None,
             "callbacks=[default,loss_spike],[default,los_spike]", "callbacks", "los_spike"),
            ([], {"scheduler": "wsd,cosin"}, "scheduler=wsd,cosin", "scheduler", "cosin"),  # an experiment's grid
        ]:
            with pytest.raises(SystemExit) as stop:
                SweepSyntaxCheck().on_multirun_start(config=multirun_config(task, params), config_name="train")
            assert stop.value.code == 1
            err = capsys.readouterr().err
            assert err.startswith(f"error: {line}: config group '{group}' has no option '{option}' (options: ")
            assert err.endswith("); nothing was run\n") and err.count("\n") == 1
        # options that exist, keys that are no group, a glob and a deletion pass; so does a mapping given a group's
        # node, which Hydra merges into it (its keys, no option): it was refused as "no option '{'warmup_steps': 1}'"
        fine = ["model=nano,small", "strategy=ddp,ddp_compressed/int8_rs", "callbacks=[default,loss_spike],none",
                "optimizer.lr=1e-3,3e-3", "seed=range(1,3)", "experiment=glob(*)", "~sample",
                "++scheduler={warmup_steps:1},{warmup_steps:2}", "+data={batch_size:2}"]
        SweepSyntaxCheck().on_multirun_start(config=multirun_config(fine, {"scheduler": "wsd,cosine"}),
                                             config_name="train")
    assert capsys.readouterr().err == ""


def test_train_py_refuses_a_missing_group_option_before_its_sweep_dir(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    proc = run_script("../train.py", ["-m", "model=nano,doesnotexist", "trainer.max_steps=1"], tmp_path, capfd)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: model=nano,doesnotexist: config group 'model' has no option 'doesnotexist' (options: llama_125m, "
        "nano, small); nothing was run"
    ]
    assert not (tmp_path / "out").exists()  # it held multirun.yaml alone


def test_train_py_run_in_this_process_leaves_the_loggers_as_it_found_them(tmp_path, monkeypatch, capfd):
    """Hydra's logging set-up in ``train.py`` (run in this process by ``run_script``) replaced the root logger's
    handlers with one on the stream pytest had captured and then closed: a later test's first log line printed
    '--- Logging error ---' into its stderr (test_sweep_error_reports' one-line failure test, after this file's first
    ``train.py`` test, as pytest-xdist may order them)."""
    import logging

    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    run_script("../train.py", ["-m", "optimizer.lr=interval(1e-4,1e-3)"], tmp_path, capfd)
    assert (root.level, list(root.handlers)) == before
    logging.getLogger("lit_dtrain.test").warning("after train.py")
    assert "Logging error" not in capfd.readouterr().err


def test_a_sweep_whose_first_job_hydra_cannot_compose_leaves_no_sweep_dir(tmp_path, monkeypatch, capfd):
    """Hydra composes a job only after its sweeper made the sweep dir and wrote multirun.yaml: a key the config lacks
    (here cosine's, which takes no decay_fraction) left a dir holding that file alone, a sweep of nothing that
    compare_runs.py listed. A sweep dir that existed before the start is left as it is."""
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    args = ["-m", "scheduler=cosine", "scheduler.decay_fraction=0.1,0.2", "trainer.max_steps=1"]
    proc = run_script("../train.py", args, tmp_path, capfd)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: scheduler.decay_fraction is not a config key (scheduler holds _partial_, _target_, min_lr_factor, "
        "total_steps, warmup_steps)"
    ]
    assert not (tmp_path / "out").exists()  # the multiruns dir made for it too
    kept = tmp_path / "earlier_sweep"
    kept.mkdir()
    assert run_script("../train.py", [*args, f"hydra.sweep.dir={kept}"], tmp_path, capfd).returncode == 1
    assert [p.name for p in kept.iterdir()] == ["multirun.yaml"]  # Hydra's, written over: not this start's dir


def test_a_sweep_of_nothing_through_dotdot_removes_no_dir_that_existed_before(tmp_path, monkeypatch):
    """hydra.sweep.dir='new/../kept/sweep': 'new' did not exist, so every lexical parent up to it, kept among them,
    was taken for a dir made with the sweep dir, and kept (existing, empty) was removed with it."""
    from lit_dtrain._sweep_of_nothing import note_sweep_dir, remove_a_sweep_of_nothing

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    directory = "new/../kept/sweep"
    note_sweep_dir(directory)
    Path(directory).mkdir(parents=True)  # as Hydra's sweeper makes it (and 'new' with it)
    (Path(directory) / "multirun.yaml").write_text("{}\n")
    removed = remove_a_sweep_of_nothing()
    assert (tmp_path / "kept").is_dir()  # existed before the start: left as it is
    assert removed == tmp_path.resolve() / "kept" / "sweep" and not removed.exists()


def test_a_dir_on_the_way_that_existed_before_is_not_removed_though_a_missing_dir_precedes_it(tmp_path, monkeypatch):
    """hydra.sweep.dir='nope/../kept/../z': the OS finds 'nope/../kept' missing while nope is, so kept (existing,
    empty, made before the start) was noted as a dir Hydra's mkdir made on the way to z, and removed after the failed
    sweep. Each dir on the way is judged by its real path now: nope (made) and z go, kept stays."""
    from lit_dtrain._sweep_of_nothing import note_sweep_dir, remove_a_sweep_of_nothing

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kept").mkdir()
    directory = "nope/../kept/../z"
    note_sweep_dir(directory)
    Path(directory).mkdir(parents=True)  # as Hydra's sweeper makes it (nope with it)
    (Path(directory) / "multirun.yaml").write_text("{}\n")
    assert remove_a_sweep_of_nothing() == tmp_path.resolve() / "z"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_a_sweep_of_nothing_through_dotdot_removes_the_dirs_hydra_made_on_the_way(tmp_path, monkeypatch, capfd):
    """hydra.sweep.dir='a/nope/deeper/../../x' (nope did not exist): Hydra's mkdir(parents=True) makes a/nope and
    a/nope/deeper on its way to a/x, and after the failed sweep both were left, empty. They are removed too; a
    dir that existed before the start ('a', empty, and 'kept' on the second path) is left as it is."""
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "kept").mkdir()
    args = ["-m", "scheduler=cosine", "scheduler.decay_fraction=0.1,0.2", "trainer.max_steps=1"]
    for directory in ("a/nope/deeper/../../x", "a/kept/../../kept/y"):
        proc = run_script("../train.py", [*args, f"hydra.sweep.dir={tmp_path / directory}"], tmp_path, capfd)
        assert proc.returncode == 1
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_dir())
    assert left == ["a", "kept"], left


def test_the_sweep_checks_run_beside_a_hydra_override_that_names_the_job(tmp_path, monkeypatch, capfd):
    """'hydra.sweep.subdir=job_${hydra:job.num}' (or the default's own '${hydra:job.num}', typed): the Hydra
    callbacks read Hydra's overrides resolved before any job had a number, raised 'HydraConfig was not set', and Hydra
    only warned, skipping every check: an interval was Hydra's 18-line traceback, a swept option that does not exist
    its 14-line error, and '-m resume=auto' without hydra.sweep.dir left a new sweep dir. Each is its one line now."""
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    subdir = "hydra.sweep.subdir=job_${hydra:job.num}"
    for args, line in ((["optimizer.lr=interval(1e-4,1e-3)"], "error: optimizer.lr=interval(1e-4,1e-3): Hydra's "),
                       (["model=nano,nope"], "error: model=nano,nope: config group 'model' has no option 'nope'"),
                       (["resume=auto"], "error: resume=auto in a multirun needs hydra.sweep.dir=")):
        proc = run_script("../train.py", ["-m", *args, subdir, "trainer.max_steps=1"], tmp_path, capfd)
        assert proc.returncode == 1
        (error,) = proc.stderr.strip().splitlines()
        assert error.startswith(line), error
        assert not (tmp_path / "out").exists()  # refused before Hydra made a sweep dir
