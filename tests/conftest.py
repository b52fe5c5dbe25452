"""Shared fixtures: a generated corpus, and Hydra configs composed for tiny, fast runs."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import signal
import socket
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
SESSION_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")  # as pytest was started
CONF_DIR = str(ROOT / "conf")

# A tiny model and run: a few seconds per run on one CPU core.
TINY = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.n_kv_head=1",
    "model.block_size=32",
    "data.batch_size=4",
    "data.max_val_windows=8",
    "data.val_batch_size=8",
    "data.progress=false",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.enable_model_summary=false",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
    "scheduler.warmup_steps=1",
    "sample.max_new_tokens=8",
    "callbacks.progress_bar=null",
]


def make_corpus(root: Path, n_files: int = 12, size: int = 3000, seed: int = 0) -> Path:
    """Write ``n_files`` pseudo-text files (a few KB each) under ``root`` and return it."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(200)]
    for i in range(n_files):
        text = []
        while sum(len(t) for t in text) < size:
            text.append(" ".join(rng.choices(words, k=12)) + ".\n")
        (root / f"doc_{i:03d}.txt").write_text("".join(text))
    return root


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread: on a 2-core CI box, oversubscribed threads slow small models many times over."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _interrupts_as_in_a_terminal():
    """Each test starts with SIGINT and SIGHUP as a Python started in a terminal has them, in this process and in
    the ``train.py`` processes it starts (a Python handler becomes the default at exec; an ignored signal stays
    ignored). Lightning sets SIGINT to ``SIG_IGN`` when a KeyboardInterrupt ends a fit and never puts it back
    (``lightning/pytorch/trainer/call.py``), a pytest started in the background by a non-interactive shell inherits
    SIGINT ignored, and under ``nohup`` SIGHUP; PreemptionCheckpoint now leaves an ignored signal ignored, as Ctrl-C
    does nothing there. Two Ctrl-C tests that pass alone failed in a full CI run (no interrupt seen, exit 0)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, previous[0])
    signal.signal(signal.SIGHUP, previous[1])


@pytest.fixture(autouse=True)
def _rank_zero_as_found():
    """Each test leaves Lightning's ``rank_zero_only.rank`` as it found it: a Trainer built with ``LOCAL_RANK=1``
    (test_rank_threads.py) set it to 1 for the rest of the session, and every later ``rank_zero_warn`` in this
    process was silent (a ``pytest.warns`` in test_selective_checkpointing_trainer.py failed after it)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank


@pytest.fixture(autouse=True)
def _event_file_numbers_from_zero(monkeypatch):
    """TensorBoard event files are named ``events.out.tfevents.<second>.<host>.<pid>.<writer number>``, the number
    counting every writer the process opened, and TensorBoard reads a directory's files in the names' string order.
    Tests train several tiny runs in one process within a second, so once that number passed 9 a run's ``.10``
    file was read before its ``.9``: the accumulator's purge and last-value logic then saw the run's files out of
    order (test_loggers' hparams test failed in 4 of 5 runs after test_resume_choice.py). A real run's files are
    seconds apart, and a resume is a new process; each test now counts its writers from 0."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))


# exported into the test process by L.seed_everything and by Lightning's DDP setup (a one-device DDP or FSDP run)
_LIGHTNING_ENV = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def _root_log_level_as_found():
    """Each test leaves the root logger's level as it found it. Hydra's logging set-up (a ``@hydra.main`` run in this
    process) sets it to INFO; every INFO record of any library then reached pytest's capture handler in each later
    test of that process: a ``caplog`` test counted a line twice (test_data_sources), and torch's ``LoggingTensor``
    record, whose arguments do not fit its message, failed to format (test_checkpoint_replay). One process runs the
    tests in file order, so only pytest-xdist's other orders met it."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


@pytest.fixture(autouse=True)
def _restore_lightning_env():
    """Each test starts with the variables Lightning exports as the session found them; processes a later test
    spawns would inherit them.

    - ``L.seed_everything`` (train() and some tests call it) exports ``PL_GLOBAL_SEED`` and ``PL_SEED_WORKERS``, and
      Lightning's DDP setup then reseeds with that seed, so a 2-rank test's data depended on which tests ran before
      it (test_grad_clip_local_updates_dist clipped nothing after tests/unit/test_loss_spike_*.py).
    - An in-process DDP run on one device exports ``LOCAL_RANK``, ``NODE_RANK`` and ``MASTER_ADDR/PORT``: a later
      test's ``train.py`` with 2 DDP ranks then took itself for an externally launched rank 0 and waited for a rank
      1 forever (tests/e2e/test_multirun_ddp.py after tests/unit/test_distributed_exit.py).
    - Its launcher, where ``OMP_NUM_THREADS`` is unset, gives torch ``cores // processes`` threads and exports that
      number (``_set_num_threads_if_needed``): after test_distributed_exit.py's one-device DDP run this process ran
      2 threads, not ``_one_torch_thread``'s 1, and every later ``train.py`` it started inherited
      ``OMP_NUM_THREADS=2``; a 2-rank ``trainer=ddp_cpu`` run then runs 2 threads a rank on 2 cores (68 tokens/s
      against ~1600-2150, docs/benchmarks.md "Torch threads per rank"). Both are put back too.
    """
    import torch

    saved = {k: os.environ.get(k) for k in _LIGHTNING_ENV}
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def no_group_left():
    """A test's 1-device fit under a DDP strategy (``CompressedDDPStrategy``) starts a one-process gloo group that
    Lightning leaves initialized; a later test's ``train()`` then found a group and kept it (test_distributed_exit
    failed after test_compressors_local_updates' fits, and after test_preemption_order's). Destroyed when the test
    ends."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def in_hydra_job(full: DictConfig):
    """Hydra's runtime config ``full`` (composed with ``return_hydra_config=True``) set as inside a job, as
    ``HydraConfig.get()`` reads it there; yields the job's config, ``full`` without its ``hydra`` node."""
    HydraConfig.instance().set_config(full)
    try:
        cfg = full.copy()
        with open_dict(cfg):
            del cfg["hydra"]
        yield cfg
    finally:
        HydraConfig.instance().cfg = None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a test's process group (the only address tests use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_rank() -> None:
    """End a spawned test rank whose results are saved: a barrier, then ``os._exit(0)``, which skips
    ``destroy_process_group`` and the interpreter's teardown. Either could hang a gloo rank after its work was done
    (a CI run hung 13 minutes in the first test of tests/dist/test_compressed_ddp.py, now _raw.py, with both ranks'
    results written and one rank left waiting on a futex), and ``mp.spawn``'s join then waits for it forever."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return make_corpus(tmp_path / "corpus")


def compose_cfg(
    overrides: list[str], output_dir: Path, corpus_dir: Path | None = None, tiny: bool = True
) -> DictConfig:
    """Compose ``conf/train.yaml`` like ``train.py`` does, with run paths under ``output_dir``."""
    extra = list(TINY) if tiny else []
    if corpus_dir is not None:
        extra += ["data=textfiles", f"data.sources.0.paths=[{corpus_dir}]"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=extra + list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.paths.cache_dir = str(output_dir.parent / "token_cache")
    return cfg


@pytest.fixture
def tiny_cfg(tmp_path: Path, corpus: Path):
    """``tiny_cfg(*overrides, run='run')`` -> a composed config for a tiny run on the generated corpus."""

    def make(*overrides: str, run: str = "run") -> DictConfig:
        return compose_cfg(list(overrides), tmp_path / run, corpus)

    return make


def subprocess_env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env["LIT_DTRAIN_OUTPUT"] = str(tmp_path / "outputs")
    env["LIT_DTRAIN_CACHE"] = str(tmp_path / "token_cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


PYTHON = sys.executable


def load_script(name: str, alias: str | None = None):
    """``scripts/<name>.py`` imported as a module (scripts are not a package), under ``alias`` if given."""
    spec = importlib.util.spec_from_file_location(alias or f"_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(script: str, args: list[str], cwd: Path, capfd) -> subprocess.CompletedProcess:
    """``python scripts/<script> <args>`` in ``cwd``, run in this process: ``runpy`` executes the file as ``__main__``
    with that ``sys.argv`` and ``sys.path[0]``, and its exit status, stdout and stderr (``capfd``: Python's and the
    file descriptors') come back as a subprocess's would: ``SystemExit``'s code, or 1 and the traceback on stderr for
    any other exception. A fresh Python per call cost 3-5 s of imports (torch, Lightning) for a flag check that
    takes milliseconds. What a script's module code or ``main`` may set for the process is put back: ``sys.argv``,
    ``sys.path``, the working directory, the environment, warning filters, the loggers (levels and handlers:
    Hydra's logging set-up left the root logger writing to a stream pytest had closed, and a later test's stderr
    began with '--- Logging error ---'), torch's thread count,
    matmul precision and global RNG, and the flag ``train.py`` sets before Hydra composes (``compose_for_a_run``:
    a later test's ``${lit.run_dir:}`` read '<run dir>' instead of refusing, when pytest-xdist ran the tests in
    another order)."""
    import runpy
    import traceback
    import warnings

    import torch

    from lit_dtrain import config_resolvers

    path = ROOT / "scripts" / script
    composing = config_resolvers._composing
    saved = (list(sys.argv), list(sys.path), os.getcwd(), dict(os.environ), torch.get_num_threads(),
             torch.get_float32_matmul_precision(), torch.random.get_rng_state())
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger))]
    logging_state = [(logger, logger.level, list(logger.handlers), logger.disabled, logger.propagate)
                     for logger in loggers]
    capfd.readouterr()
    code = 0
    try:
        sys.argv[:] = [str(path), *args]
        sys.path.insert(0, str(path.parent))  # as Python puts the script's dir first
        os.chdir(cwd)
        with warnings.catch_warnings():
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit_:
                if exit_.code is None or isinstance(exit_.code, int):
                    code = exit_.code or 0
                else:  # sys.exit("message"): printed on stderr, status 1
                    print(exit_.code, file=sys.stderr)
                    code = 1
            except Exception:  # noqa: BLE001 - what Python does with it at the top: a traceback, status 1
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        sys.argv[:], sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
        os.environ.clear()
        os.environ.update(saved[3])
        torch.set_num_threads(saved[4])
        torch.set_float32_matmul_precision(saved[5])
        torch.random.set_rng_state(saved[6])
        _restore_loggers(logging_state)
        config_resolvers._composing = composing
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([PYTHON, str(path), *args], code, out, err)


def _restore_loggers(state: list) -> None:
    """Put back each logger's level, handlers, ``disabled`` and ``propagate`` as :func:`run_script` found them, and
    close the handlers a script added (Hydra's ``train.log``; its console handler, on a stream pytest has closed)."""

    kept = {id(h) for _, _, handlers, _, _ in state for h in handlers}
    found = {id(logger) for logger, *_ in state}
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if id(handler) not in kept:
                handler.close()
        if isinstance(logger, logging.Logger) and id(logger) not in found:  # created by the script: as created
            state.append((logger, logging.NOTSET, [], False, True))
    for logger, level, handlers, disabled, propagate in state:
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.disabled, logger.propagate = disabled, propagate


def event_files(root: Path, pattern: str = "events.out.tfevents.*") -> list[Path]:
    """TensorBoard event files under ``root`` in the order they were written (a run writes two: Lightning closes
    the writer when fit ends and the final validation opens another). ``rglob`` gives the filesystem's order; the
    names are ``events.out.tfevents.<time>.<host>.<pid>.<writer number>``, compared here as numbers."""
    def key(path: Path) -> list:
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.name.split(".")]

    return sorted(root.rglob(pattern), key=key)
