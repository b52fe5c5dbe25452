"""An output dir that cannot be written (LIT_DTRAIN_OUTPUT on a read-only file system, a file in the way) is refused
in one line before Hydra creates the run or sweep dir; it was Hydra's traceback ending in 'OSError: [Errno 30]
Read-only file system: .../runs'."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lit_dtrain.utils.atomic import unwritable_dir_reason
from tests.conftest import ROOT, subprocess_env
from tests.unit.test_checkpoint_io import mounted_tmpfs


@pytest.fixture
def read_only_dir(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        yield mnt


def test_unwritable_dir_reason_names_the_ancestor_and_the_cause(tmp_path, read_only_dir):
    assert unwritable_dir_reason(tmp_path) is None
    assert unwritable_dir_reason(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()  # nothing created
    assert unwritable_dir_reason(read_only_dir) == "cannot be written: it is on a read-only file system"
    assert unwritable_dir_reason(read_only_dir / "runs" / "x") == (
        f"cannot be written: its ancestor {str(read_only_dir)!r} is on a read-only file system"
    )
    (tmp_path / "file").write_text("x")
    assert unwritable_dir_reason(tmp_path / "file" / "runs") == (
        f"cannot be created: its ancestor {str(tmp_path / 'file')!r} is a file, not a directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"]  # the probe dirs are gone


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_dir_that_cannot_be_made_under_proc_is_refused_also_as_root():
    """As root, /proc passes the access checks and Hydra's mkdir of hydra.sweep.dir=/proc/nope/x failed in a
    traceback ('FileNotFoundError: ... /proc/nope'); as any user it is now a reason."""
    reason = unwritable_dir_reason("/proc/nope/x")
    if os.geteuid() == 0:
        assert reason == "cannot be created: its ancestor '/proc' refuses a new directory (No such file or directory)"
    else:
        assert reason == "cannot be written: its ancestor '/proc' is not writable by this user"


def test_a_dir_below_a_link_that_leads_nowhere_is_refused_naming_the_link(tmp_path):
    """LIT_DTRAIN_OUTPUT on an unmounted scratch (scratch -> a missing dir): the nearest existing dir, tmp_path,
    passed every check and Hydra's mkdir failed in a traceback, 'FileExistsError: [Errno 17] File exists: ...'."""
    (tmp_path / "scratch").symlink_to(tmp_path / "unmounted")
    assert unwritable_dir_reason(tmp_path / "scratch" / "outputs" / "runs") == (
        f"cannot be created: '{tmp_path}/scratch' is a broken symbolic link (to '{tmp_path}/unmounted', which does "
        "not exist)")
    (tmp_path / "unmounted").mkdir()  # mounted: made through the link
    assert unwritable_dir_reason(tmp_path / "scratch" / "outputs" / "runs") is None


@pytest.mark.parametrize("multirun", [False, True])
def test_train_py_refuses_a_read_only_output_dir_in_one_line(tmp_path, read_only_dir, multirun):
    env = {**subprocess_env(tmp_path), "LIT_DTRAIN_OUTPUT": str(read_only_dir)}
    args = ["-m", "optimizer.lr=1e-3,2e-3"] if multirun else ["run_name=ro"]
    proc = subprocess.run([sys.executable, "train.py", *args, "trainer.max_steps=1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    kind, where = ("sweep", "multiruns/") if multirun else ("run", "runs/ro")
    assert (f"error: the {kind} dir '{read_only_dir}/{where}" in proc.stderr
            and f"its ancestor '{read_only_dir}' is on a read-only file system; point LIT_DTRAIN_OUTPUT" in proc.stderr)


@pytest.mark.parametrize("run_name", ["''", "' '", "..", "a/../..", "/", "' / '"])
def test_a_run_name_that_names_no_run_dir_of_its_own_is_refused_before_hydra_creates_it(tmp_path, run_name, capsys):
    """run_name='' trained in outputs/runs itself (its checkpoints/, summary.json and train.log beside every run,
    exit 0); '..' in outputs; '/' in outputs/runs too (the run dir is <log dir>/runs/${run_name})."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    config = OmegaConf.create({"run_name": OmegaConf.create(f"x: {run_name}").x,
                               "hydra": {"run": {"dir": str(tmp_path / "runs" / "x")}}})
    with pytest.raises(SystemExit):
        OutputDirCheck().on_run_start(config)
    assert capsys.readouterr().err.startswith(f"error: run_name={config.run_name!r} names no run dir of its own")
    assert not (tmp_path / "runs").exists()
    OutputDirCheck().on_run_start(OmegaConf.merge(config, {"run_name": "a/b"}))  # a nested name is a run dir
    OutputDirCheck().on_run_start(OmegaConf.merge(config, {"run_name": "/a"}))  # <log dir>/runs//a: runs/a


def test_run_name_null_is_refused_not_taken_as_the_name_none(tmp_path, capsys):
    """run_name=null trained in outputs/runs/None (Hydra's dir reads null as 'None'), and the next such run was
    refused there for the first one's checkpoints: null is no way to ask for the default name."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    config = OmegaConf.create({"run_name": None, "hydra": {"run": {"dir": str(tmp_path / "runs" / "None")}}})
    with pytest.raises(SystemExit):
        OutputDirCheck().on_run_start(config)
    assert capsys.readouterr().err.startswith("error: run_name=null names the run dir 'None' (<log dir>/runs/None, "
                                              "shared by every such run), not the default: leave run_name out")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("removed, match", [
    ("~paths.log_dir", "~paths.log_dir removes a path lit_dtrain needs (the root of run dirs); set it instead "
                       "(paths.log_dir=<dir>)"),
    ("~paths", "~paths removes the 'paths' config, which lit_dtrain needs: leave it in and set its keys"),
])
@pytest.mark.parametrize("hook", ["on_run_start", "on_multirun_start"])
def test_a_removed_log_dir_is_refused_before_hydra_builds_the_run_dir(removed, match, hook, capsys):
    """Hydra's run and sweep dirs are interpolated from paths.log_dir: '~paths.log_dir' (or '~paths') failed in
    Hydra's traceback ('Interpolation key 'paths.log_dir' not found', then 'An error occurred during Hydra's exception
    formatting'), before lit_dtrain's check of removed keys ran."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    paths = {} if removed == "~paths" else {"paths": {"cache_dir": "/tmp/c"}}
    config = OmegaConf.create({**paths, "run_name": "x", "hydra": {
        "overrides": {"task": ["model=nano", removed]},
        "run": {"dir": "${paths.log_dir}/runs/x"}, "sweep": {"dir": "${paths.log_dir}/multiruns/x"}}})
    with pytest.raises(SystemExit):
        getattr(OutputDirCheck(), hook)(config)
    assert capsys.readouterr().err.startswith(f"error: {match}")


@pytest.mark.parametrize("hook", ["on_run_start", "on_multirun_start"])
def test_an_override_interpolating_hydra_keeps_the_output_dir_check(tmp_path, hook, capsys):
    """'-m seed=${hydra:job.num} ...' (Hydra sets its config per job, later): reading the overrides resolved each
    one, so the check raised 'HydraConfig was not set', Hydra warned and skipped it, and an unwritable sweep dir was
    'NotADirectoryError' in a traceback. The overrides are read as text: the dir's refusal in one line."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    (tmp_path / "file").write_text("x")
    config = OmegaConf.create({"run_name": "x", "hydra": {
        "overrides": {"task": ["seed=${hydra:job.num}", "optimizer.lr=1e-3,2e-3"]},
        "run": {"dir": str(tmp_path / "file" / "runs" / "x")}, "sweep": {"dir": str(tmp_path / "file" / "m")}}})
    with pytest.raises(SystemExit):
        getattr(OutputDirCheck(), hook)(config)
    kind = "run" if hook == "on_run_start" else "sweep"
    assert capsys.readouterr().err.startswith(f"error: the {kind} dir '{tmp_path}/file/")


def test_a_refusal_under_a_users_hydra_full_error_stops_the_start(monkeypatch, capsys):
    """Under one's own ``HYDRA_FULL_ERROR=1`` a Hydra callback's refusal was raised, which Hydra only warns about
    for a callback (``Callbacks._notify`` catches Exception): ``HYDRA_FULL_ERROR=1 python train.py run_name=''``
    trained its steps into the runs dir itself. It is now the error's traceback and exit status 1."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    config = OmegaConf.create({"run_name": "", "hydra": {"run": {"dir": "/tmp/unused"}}})
    with pytest.raises(SystemExit) as stop:  # (not an Exception, which Hydra would catch and warn about)
        OutputDirCheck().on_run_start(config)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.startswith("Traceback (most recent call last):")
    assert "ConfigError: run_name='' names no run dir of its own" in err


@pytest.mark.parametrize(("overrides", "error"), [
    (["run_name=${hydra:job.num}"], "error: run_name='${hydra:job.num}' resolves to None: run_name=null names the "
                                    "run dir 'None'"),
    (["run_name=${hydra:job.override_dirname}"], "error: hydra.run.dir='${paths.log_dir}/runs/${run_name}' refers "
     "to itself: ${hydra:job.override_dirname} lists every override, the run_name (or hydra.run.dir) that uses it "
     "too; leave that key out of it, 'hydra.job.config.override_dirname.exclude_keys=[run_name]'"),
    (["hydra.run.dir=RUNS/${hydra:job.override_dirname}", "seed=3"], None),
    (["run_name=a_${hydra:job.override_dirname}", "hydra.job.config.override_dirname.exclude_keys=[run_name]"], None),
])
def test_a_run_dir_interpolating_hydra_is_checked_as_hydra_resolves_it(tmp_path, overrides, error, capsys):
    """Hydra sets its config for a single run after the callbacks' on_run_start: the check raised 'HydraConfig was
    not set', which Hydra only warned about, so 'run_name=${hydra:job.num}' (null outside a multirun) trained into
    outputs/runs/None, and 'run_name=${hydra:job.override_dirname}' (which lists itself) ended in Hydra's
    RecursionError traceback. Each is one line now; a dir that resolves is checked without a warning."""
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from lit_dtrain.sweeps import OutputDirCheck
    from tests.conftest import CONF_DIR

    overrides = [o.replace("RUNS", str(tmp_path / "runs")) for o in overrides]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        config = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    with open_dict(config):
        config.hydra.overrides.task = [o for o in overrides if not o.startswith("hydra.")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if error is None:
            OutputDirCheck().on_run_start(config)
        else:
            with pytest.raises(SystemExit):
                OutputDirCheck().on_run_start(config)
    assert capsys.readouterr().err.startswith(error or "")
    assert not HydraConfig.initialized()  # put back: Hydra sets it itself as the job starts


def test_the_refusal_names_what_set_the_unwritable_dir(tmp_path, monkeypatch, capsys):
    """With LIT_DTRAIN_OUTPUT writable and paths.log_dir=<a dir below a file> on the command line, the refusal said
    'point LIT_DTRAIN_OUTPUT (paths.log_dir, now '<the variable>')', a dir that was fine and overridden; with
    hydra.run.dir=<such a dir>, neither key set it. Each names the key that set the dir, with its value."""
    from omegaconf import OmegaConf

    from lit_dtrain.sweeps import OutputDirCheck

    (tmp_path / "file").write_text("x")
    blocked = str(tmp_path / "file" / "out")
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "fine"))
    for log_dir, run_dir, advice in [
        (blocked, f"{blocked}/runs/a", f"point paths.log_dir (now '{blocked}'; it overrides LIT_DTRAIN_OUTPUT)"),
        (str(tmp_path / "fine"), f"{blocked}/a", f"point hydra.run.dir (now '{blocked}/a')"),
    ]:
        config = OmegaConf.create({"run_name": "a", "paths": {"log_dir": log_dir}, "hydra": {"run": {"dir": run_dir}}})
        with pytest.raises(SystemExit):
            OutputDirCheck().on_run_start(config)
        assert capsys.readouterr().err.strip().endswith(f"is a file, not a directory; {advice} at a writable directory")
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", blocked)  # the variable's dir: the variable is named, with its value
    config = OmegaConf.create({"run_name": "a", "paths": {"log_dir": blocked},
                               "hydra": {"run": {"dir": f"{blocked}/runs/a"}}})
    with pytest.raises(SystemExit):
        OutputDirCheck().on_run_start(config)
    assert f"point LIT_DTRAIN_OUTPUT (paths.log_dir, now '{blocked}') at a writable" in capsys.readouterr().err
