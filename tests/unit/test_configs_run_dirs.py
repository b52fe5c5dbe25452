"""Run and sweep dirs: the same second, empty output variables, launchers' default run names and sweep dirs,
`resume=auto` under them; the collective timeout."""

from datetime import datetime
from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException

from lit_dtrain.strategies.by_name import build_strategy
from lit_dtrain.train import ConfigError
from tests.conftest import CONF_DIR, compose_cfg


def test_sweeps_started_in_the_same_second_get_their_own_dirs(monkeypatch, tmp_path):
    """Two `python train.py -m ...` started in the same second (one per GPU from a script, a SLURM array) used to
    resolve the same outputs/multiruns/<time>, so their job 0, 1, ... wrote into each other's dirs. Hydra's `now`
    resolver reads a clock frozen at one second (two real composes a few ms apart crossed a second under load)."""
    import hydra.core.utils
    from hydra import compose, initialize_config_dir

    class OneSecond(datetime):
        ticks = 0

        @classmethod
        def now(cls, tz=None):
            cls.ticks += 1
            return datetime(2026, 12, 7, 12, 0, 0, 1000 * cls.ticks)  # a few ms apart, in the same second

    monkeypatch.setattr(hydra.core.utils, "datetime", OneSecond)
    monkeypatch.delenv("LIT_DTRAIN_SWEEP_DIR", raising=False)
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path))

    def sweep_dir() -> str:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return str(compose(config_name="train", return_hydra_config=True).hydra.sweep.dir)

    a, b = sweep_dir(), sweep_dir()
    assert a.startswith(str(tmp_path / "multiruns" / "2026-12-07_12-00-00.")) and a != b


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_output_or_cache_variable_means_the_default_dir(monkeypatch, empty):
    """LIT_DTRAIN_OUTPUT= (set, but empty) put the run dirs at the filesystem's root (/runs/<name>) and
    LIT_DTRAIN_CACHE= the token caches in the working dir; an empty one now reads as unset (as XDG_* are read)."""
    from hydra import compose, initialize_config_dir

    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", empty)
    monkeypatch.setenv("LIT_DTRAIN_CACHE", empty)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["run_name=r"], return_hydra_config=True)
        assert (cfg.paths.log_dir, cfg.paths.cache_dir, cfg.data.cache_dir) == ("outputs", "~/.cache/lit_dtrain",
                                                                                 "~/.cache/lit_dtrain")
        assert cfg.hydra.run.dir == "outputs/runs/r" and cfg.hydra.sweep.dir.startswith("outputs/multiruns/")
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", "/data/out")
    monkeypatch.setenv("LIT_DTRAIN_CACHE", "/data/cache")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["run_name=r"], return_hydra_config=True)
        assert (cfg.hydra.run.dir, cfg.data.cache_dir) == ("/data/out/runs/r", "/data/cache")


@pytest.mark.parametrize("strategy", ["ddp", "ddp_compressed/int8", "ddp_compressed/diloco"])
@pytest.mark.parametrize("value, shown", [("-1", "-1"), ("0", "0"), ("abc", "'abc'")])
def test_collective_timeout_must_be_a_positive_number(strategy, value, shown, tmp_path, corpus):
    """strategy.collective_timeout_s=-1 used to reach torch's TCPStore ('The client socket has timed out after
    -1000ms'), 0 made every collective time out at once, and 'abc' was 'could not convert string to float'."""
    cfg = compose_cfg([f"strategy={strategy}", f"strategy.collective_timeout_s={value}"], tmp_path / "t", corpus)
    message = rf"strategy.collective_timeout_s must be a number of seconds > 0, got {shown}"
    with pytest.raises((ValueError, InstantiationException), match=message):  # Hydra wraps it, keeping the text
        build_strategy(cfg)
    ok = compose_cfg([f"strategy={strategy}", "strategy.collective_timeout_s=8"], tmp_path / "t", corpus)
    assert build_strategy(ok)._timeout.total_seconds() == 8


@pytest.mark.parametrize(
    "env, name",
    [
        ({}, "stamp"),
        ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "8"}, "slurm-123.4"),
        ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "1"}, "stamp"),  # one task
        ({"SLURM_JOB_ID": "123", "SLURM_NTASKS": "8"}, "stamp"),  # the batch script itself, not an srun step
        ({"TORCHELASTIC_RUN_ID": "5b3c-9f", "WORLD_SIZE": "2"}, "torchrun-5b3c-9f"),
        ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "stamp"),  # several nodes
        ({"TORCHELASTIC_RUN_ID": "job/7", "WORLD_SIZE": "16"}, "torchrun-job_7"),
        ({"TORCHELASTIC_RUN_ID": "5b3c", "WORLD_SIZE": "1"}, "stamp"),
    ],
)
def test_the_default_run_name_is_the_launchs_id_under_srun_and_torchrun(env, name, monkeypatch):
    """Under a launcher every rank composes the config itself: the start-time default differed between ranks that
    started in different seconds, and rank 1 wrote a run dir of its own (tests/e2e/test_torchrun.py)."""
    from lit_dtrain.config_resolvers import launch_run_name

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_run_name("stamp") == name


def test_torchruns_id_none_on_one_node_names_the_launch_by_its_agent(monkeypatch):
    """`torchrun --nproc_per_node=2 --master-port=29500` (or `--rdzv-endpoint`) on one node draws no uuid: its run id
    is 'none', and each rank's start time named a run dir of its own (a rank 2 s late: rank 1's `.hydra/` and
    `train.log` in a second dir) and, to the microsecond, a sweep dir of its own on every `-m` launch. The workers
    share their parent, torchrun's agent."""
    import os
    import socket

    from lit_dtrain.config_resolvers import launch_run_name

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(os, "getsid", lambda pid: os.getpid())  # torchrun starts each worker in its own session
    assert launch_run_name("stamp") == f"torchrun-{socket.gethostname()}-{os.getppid()}"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert launch_run_name("stamp") == "stamp"  # one process: its own start time, as before


@pytest.mark.parametrize("rank", ["0", "1"])
def test_torchruns_id_none_is_the_agents_log_dir_not_each_workers_parent(monkeypatch, rank):
    """Under a wrapper (`torchrun --master-port=... --no-python ./run.sh`, whose shell runs `python train.py`) each
    worker's parent is its own shell: named by its parent's pid, every launch wrote a run dir per rank
    (torchrun-vm-15027 and torchrun-vm-15028). The agent's log dir, in every worker's TORCHELASTIC_ERROR_FILE
    (<log dir>/none_<random>/attempt_<n>/<local rank>/error.json), is one per launch, kept across restarts."""
    import socket

    from lit_dtrain.config_resolvers import launch_run_name

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", f"/tmp/torchelastic_x1/none_ab_9cd3e/attempt_1/{rank}/error.json")
    assert launch_run_name("stamp") == f"torchrun-{socket.gethostname()}-ab_9cd3e"


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the agent is read from /proc")
def test_torchruns_id_none_without_a_log_dir_is_its_agent_under_a_wrapper_too(monkeypatch):
    """`torchrun --master-port=... --log-dir /dev/null --no-python ./run.sh` sets an empty TORCHELASTIC_ERROR_FILE:
    the name fell back to each worker's parent, under a wrapper that does not exec its own shell (torchrun-vm-13514
    and torchrun-vm-13516, a run dir per rank). torchrun starts each worker in a session of its own; this test
    process plays the agent, and two workers, each run by a shell of its own, name it alike."""
    import os
    import socket
    import subprocess
    import sys

    torchrun_none_without_a_log_dir(monkeypatch)
    code = "from lit_dtrain.config_resolvers import launch_run_name; print(launch_run_name('stamp'))"
    names = []
    for shell_runs in (f"{sys.executable} -c \"{code}\"; true", f"exec {sys.executable} -c \"{code}\""):
        worker = subprocess.run(["bash", "-c", shell_runs], capture_output=True, text=True, start_new_session=True,
                                timeout=120, check=True)
        names.append(worker.stdout.strip())
    assert names == [f"torchrun-{socket.gethostname()}-{os.getpid()}"] * 2


def test_a_launchers_default_run_name_is_still_the_default(monkeypatch, tmp_path, corpus):
    """It names the launch, not a run to continue: resume=auto still needs run_name=..."""
    from omegaconf import open_dict

    from lit_dtrain.resume import _default_run_name
    from lit_dtrain.train import resolve_ckpt_path

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    assert cfg.run_name == "torchrun-abc" and _default_run_name(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "runs" / "torchrun-abc")
        cfg.paths.checkpoint_dir = str(tmp_path / "runs" / "torchrun-abc" / "checkpoints")
    with pytest.raises(ConfigError, match=r"resume=auto needs run_name=.*\(torchrun-abc: its start time, or its"):
        resolve_ckpt_path(cfg)
    assert not _default_run_name(compose_cfg(["run_name=torchrun-abc"], tmp_path / "x", corpus))


def test_resume_auto_under_srun_continues_the_requeued_job_in_its_default_run_dir(monkeypatch, tmp_path, corpus):
    """A requeue-ready batch script runs `srun python train.py resume=auto`: Slurm requeues a preempted job with its
    SLURM_JOB_ID and step, so the default run_name slurm-<job>.<step> names the same run dir again. It was refused
    like a new timestamp ('resume=auto needs run_name'), on the first start and after the requeue alike; now the
    first start trains fresh and the requeued one finds last.ckpt. torchrun (a new uuid per --standalone launch) is
    still refused (previous test)."""
    from omegaconf import open_dict

    from lit_dtrain.resume import _default_run_name
    from lit_dtrain.train import resolve_ckpt_path

    for key, value in {"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    assert cfg.run_name == "slurm-123.0" and _default_run_name(cfg)
    run = tmp_path / "runs" / "slurm-123.0"
    with open_dict(cfg):
        cfg.paths.output_dir, cfg.paths.checkpoint_dir = str(run), str(run / "checkpoints")
    assert resolve_ckpt_path(cfg) is None  # the first start: nothing to resume yet, a fresh run
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 4, "state_dict": {}}, run / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(run / "checkpoints" / "last.ckpt")  # the requeued start resumes


@pytest.mark.parametrize("run_id", ["none", "5b3c-9f"])
def test_resume_auto_under_torchrun_restarts_continues_in_the_launchs_default_run_dir(monkeypatch, tmp_path, corpus,
                                                                                       run_id):
    """`torchrun --max-restarts=1 train.py` warns that a restart continues the run only with resume=auto; with it,
    it was refused on every attempt ('resume=auto needs run_name ... a new run dir that holds no checkpoint', 4
    lines, exit 1), though a restart keeps the launch's id (the rdzv id; for 'none' the agent's log dir), so its
    default run_name names the same run dir: the first attempt now trains fresh and a restart finds last.ckpt.
    Without --max-restarts nothing starts that dir again: still refused."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"TORCHELASTIC_RUN_ID": run_id, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_q/none_k2x9/attempt_0/0/error.json",
                       "TORCHELASTIC_MAX_RESTARTS": "0"}.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    assert cfg.run_name.startswith("torchrun-")
    run = tmp_path / "runs" / str(cfg.run_name)
    with open_dict(cfg):
        cfg.paths.output_dir, cfg.paths.checkpoint_dir = str(run), str(run / "checkpoints")
    with pytest.raises(ConfigError, match=r"resume=auto needs run_name="):
        resolve_ckpt_path(cfg)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert resolve_ckpt_path(cfg) is None  # the first attempt: nothing to resume yet, a fresh run
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 4, "state_dict": {}}, run / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(run / "checkpoints" / "last.ckpt")  # the restart resumes


@pytest.mark.parametrize(
    "env, name",
    [
        ({"TORCHELASTIC_RUN_ID": "5b3c-9f", "WORLD_SIZE": "2"}, "torchrun-5b3c-9f"),
        ({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "8"}, "slurm-123.4"),
    ],
)
def test_a_multiruns_default_sweep_dir_is_the_launchs_id_under_srun_and_torchrun(env, name, monkeypatch, tmp_path):
    """Every rank composes hydra.sweep.dir itself, and its default was each process's start time (to the
    microsecond): `torchrun --nproc_per_node=2 train.py -m ...` wrote two sweep dirs on every launch, rank 1's
    holding only .hydra/ and train.log of each job (tests/e2e/test_torchrun.py). It is the launch's id now, as
    run_name's default; without a launcher it is still the start time."""
    from hydra import compose, initialize_config_dir

    launcher = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")
    for key in (*launcher, "LIT_DTRAIN_SWEEP_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path))

    def sweep_dir() -> str:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return str(compose(config_name="train", return_hydra_config=True).hydra.sweep.dir)

    assert Path(sweep_dir()).parent == tmp_path / "multiruns"
    assert datetime.strptime(Path(sweep_dir()).name, "%Y-%m-%d_%H-%M-%S.%f")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert sweep_dir() == str(tmp_path / "multiruns" / name)


def test_resume_auto_in_a_launchers_new_default_sweep_dir_is_refused(monkeypatch, tmp_path, corpus):
    """The launch's id names a new sweep dir on each torchrun --standalone launch, so a sweep re-run with resume=auto
    and no hydra.sweep.dir would start every job fresh: refused, as in a new timestamped sweep dir. A re-launch with
    the same id (a requeued SLURM job, a fixed --rdzv-id) finds its earlier jobs' checkpoints there: each job resumes
    its own, and one that never started starts fresh."""
    from omegaconf import open_dict

    from lit_dtrain.train import resolve_ckpt_path

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sweep = tmp_path / "multiruns" / "torchrun-abc"

    def job_cfg(num: int, sweep_dir: Path = sweep):
        cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
        with open_dict(cfg):  # as conf/hydra/default.yaml lays out a multirun job
            cfg.paths.output_dir = str(sweep_dir / str(num))
            cfg.paths.checkpoint_dir = str(sweep_dir / str(num) / "checkpoints")
        return cfg

    for num in (0, 1):
        with pytest.raises(ConfigError, match=rf"resume=auto in a multirun needs hydra\.sweep\.dir=.*'{sweep}'"):
            resolve_ckpt_path(job_cfg(num))
    (sweep / "0" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 2, "state_dict": {}}, sweep / "0" / "checkpoints" / "last.ckpt")  # a readable one
    assert resolve_ckpt_path(job_cfg(0)) == str(sweep / "0" / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(job_cfg(1)) is None  # not started before: a fresh start of it
    # given with hydra.sweep.dir, a dir of that name is the user's, checkpoints or not
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    other = tmp_path / "multiruns2" / "torchrun-abc"
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        HydraConfig.instance().set_config(
            compose(config_name="train", overrides=[f"hydra.sweep.dir={other}"], return_hydra_config=True)
        )
    try:
        assert resolve_ckpt_path(job_cfg(0, other)) is None
    finally:
        HydraConfig.instance().cfg = None


def test_resume_auto_in_a_sweep_under_torchrun_restarts_starts_its_default_sweep_dir_and_a_restart_resumes_it(
        monkeypatch, tmp_path, corpus):
    """`torchrun --max-restarts=1 train.py -m ... resume=auto` was refused at the first start, before any job ('resume=
    auto in a multirun needs hydra.sweep.dir=...', exit 1), though a restart keeps the launch's id and so its default
    sweep dir, as a single run's default run_name (accepted there). The first attempt now starts it, a restart resumes
    each job there (as a requeued srun step's); without --max-restarts a new id's sweep dir is still refused."""
    from omegaconf import open_dict

    from lit_dtrain.resume import _created_by_this_start
    from lit_dtrain.train import resolve_ckpt_path

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1"}.items():
        monkeypatch.setenv(key, value)
    sweep = tmp_path / "multiruns" / "torchrun-abc"
    cfg = compose_cfg(["resume=auto"], tmp_path / "x", corpus)
    with open_dict(cfg):  # as conf/hydra/default.yaml lays out a multirun job
        cfg.paths.output_dir, cfg.paths.checkpoint_dir = str(sweep / "0"), str(sweep / "0" / "checkpoints")
    assert not _created_by_this_start(sweep, [])  # the Hydra callback's check, before the sweep dir exists
    assert resolve_ckpt_path(cfg) is None  # the first attempt: a fresh job 0
    (sweep / "0" / "checkpoints").mkdir(parents=True)
    torch.save({"global_step": 4, "state_dict": {}}, sweep / "0" / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(sweep / "0" / "checkpoints" / "last.ckpt")  # the restart resumes job 0
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert _created_by_this_start(tmp_path / "multiruns2" / "torchrun-abc", [])  # no restart: nothing to resume
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(key)
    for key, value in {"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "4", "SLURM_STEP_NUM_TASKS": "2"}.items():
        monkeypatch.setenv(key, value)
    assert not _created_by_this_start(tmp_path / "multiruns3" / "slurm-123.4", [])  # a requeue starts it again


def torchrun_none_without_a_log_dir(monkeypatch) -> None:
    """A torchrun worker's variables with run id 'none' and no log dir (TORCHELASTIC_ERROR_FILE empty), off Slurm."""
    import os
    import sys

    for key in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "TORCHELASTIC_ERROR_FILE": "", "PYTHONPATH": os.pathsep.join(sys.path)}.items():
        monkeypatch.setenv(key, value)
