"""OmegaConf resolvers used by conf/ (registered when lit_dtrain is imported).

``${lit.warmup:${trainer.max_steps}}`` is the default warmup: 100 steps, or a tenth of a shorter run,
so that ``python train.py trainer.max_steps=10`` works without also setting the warmup.

``${lit.launch_run_name:<timestamp>}`` is the default ``run_name``: the timestamp, or under a launcher that starts
every rank itself (``srun`` with several tasks, ``torchrun``) an id of the launch that every rank reads from its
environment, so that all ranks name the same run dir without communicating (each one composes the config on its
own, and ranks that start in different seconds wrote different run dirs).

``${lit.env_dir:VAR,default}`` is the directory that the environment variable ``VAR`` names, or ``default`` when
it is unset or empty, as the XDG base-directory variables are read (``${oc.env:...}`` gave ``''`` for an empty one:
the run dirs went to ``/runs`` at the filesystem's root, the token caches into the working dir).

``${lit.run_dir:}`` is ``paths.output_dir``, the run dir (``${hydra:runtime.output_dir}``), which Hydra sets only when
a run starts. While ``train.py`` composes its config (a ``~key`` override is applied then, and Hydra reads the value it
deletes) it is ``<run dir>``: ``~callbacks.model_checkpoint.dirpath`` failed there with "HydraConfig was not set"
instead of lit_dtrain's one-line refusal. A config composed outside ``train.py`` and Hydra's run has no run dir:
reading it says to set ``paths.output_dir``.

``${lit.required:"message"}`` marks a key that a config needs from the command line (an experiment cannot
mark it ``???``: a missing value does not override the root's default in a merge). Reading the key raises
:class:`RequiredValueError` with the message until an override replaces it.
"""

from __future__ import annotations

import os
import re
import socket

from omegaconf import OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError, UnsupportedInterpolationType


class RequiredValueError(InterpolationResolutionError, ValueError):
    """A key marked ``${lit.required:...}`` was read without a value given for it; the message says which."""


# a required key left out, ``${nope}`` naming no key, or ``${oc.evn:HOME}`` naming no resolver
UNRESOLVED = (RequiredValueError, InterpolationKeyError, UnsupportedInterpolationType)


def required(message: str) -> None:
    """``${lit.required:"message"}``: raise :class:`RequiredValueError` with ``message``."""
    raise RequiredValueError(message)


def env_dir(var: str, default: str) -> str:
    """``${lit.env_dir:VAR,default}``: ``$VAR``, or ``default`` when it is unset, empty or blank."""
    value = os.environ.get(var, "")
    return value if value.strip() else default


def default_cache_dir() -> str:
    """The token caches' directory of ``paths.cache_dir`` for code outside Hydra (the scripts): ``$LIT_DTRAIN_CACHE``,
    or ``~/.cache/lit_dtrain`` when it is unset, empty or blank."""
    return env_dir("LIT_DTRAIN_CACHE", "~/.cache/lit_dtrain")


RUN_DIR_WHILE_COMPOSING = "<run dir>"  # paths.output_dir while train.py composes (before Hydra sets the run dir)
_composing = False


def compose_for_a_run() -> None:
    """Called by ``train.py`` before Hydra composes: until Hydra sets the run dir, ``${lit.run_dir:}`` reads
    :data:`RUN_DIR_WHILE_COMPOSING` (a config composed elsewhere gets the error of :func:`run_dir`)."""
    global _composing
    _composing = True


def run_dir() -> str:
    """``${lit.run_dir:}``: Hydra's ``runtime.output_dir``; while ``train.py`` composes, ``<run dir>``; else
    :class:`RequiredValueError` naming ``paths.output_dir``."""
    from hydra.core.hydra_config import HydraConfig

    output_dir = None  # (a missing value under --cfg, None before a run's: Hydra's own resolver gave None there)
    if HydraConfig.initialized():
        output_dir = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", throw_on_missing=False)
    if output_dir is not None:
        return output_dir
    if _composing:
        return RUN_DIR_WHILE_COMPOSING
    raise RequiredValueError("paths.output_dir is the run dir, which Hydra sets when train.py starts a run; a config "
                             "composed outside it needs paths.output_dir=<dir>")


def default_warmup(max_steps: int, cap: int = 100, fraction: float = 0.1) -> int:
    """min(cap, max(1, int(fraction * max_steps)))."""
    return min(int(cap), max(1, int(float(fraction) * int(max_steps))))


def _torchrun_launch_id(env) -> str:
    """What the workers of one torchrun launch on one node share and a next launch does not: the name's random part
    of the agent's log dir (``TORCHELASTIC_ERROR_FILE`` is ``<log dir>/<run id>_<random>/attempt_<n>/<local
    rank>/error.json``, one dir per launch, kept across its ``--max-restarts``), else the pid of torchrun's agent.
    The workers' parent alone is not it under a wrapper (``torchrun --no-python ./run.sh``, whose shell runs ``python
    train.py``): each rank's parent is its own shell, and each rank wrote a run dir of its own."""
    error_file = env.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file:
        parts = os.path.normpath(error_file).split(os.sep)
        if len(parts) >= 4 and parts[-3].startswith("attempt_") and parts[-4].startswith("none_"):
            return parts[-4].removeprefix("none_")  # tempfile's random part (letters, digits and _)
    return str(_agent_pid())


def _agent_pid() -> int:
    """The pid of torchrun's agent, for a launch without a log dir (``--log-dir /dev/null`` sets an empty
    ``TORCHELASTIC_ERROR_FILE``): the agent starts each worker in a session of its own, so it is the parent of this
    process's session leader, the worker itself or the wrapper shell that runs it. The parent alone was each rank's
    own shell under a wrapper that does not exec (torchrun-vm-13514 and torchrun-vm-13516: a run dir per rank).
    Where /proc cannot say (not Linux), the parent."""
    leader = os.getsid(0)
    if leader == os.getpid():
        return os.getppid()
    try:
        with open(f"/proc/{leader}/stat") as f:  # 'pid (comm) state ppid ...'; comm may hold ') '
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return os.getppid()


def launch_survives_restart() -> bool:
    """Whether this launch's default ``run_name`` names the same run dir when the launcher starts it again: a Slurm
    job requeued keeps its id and step, and torchrun's restarts (``--max-restarts`` above 0) keep its launch id
    (the rdzv id, or for ``none`` the agent's log dir). ``resume=auto`` continues the run there."""
    name, restarts = launch_run_name(""), os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return name.startswith("slurm-") or (name.startswith("torchrun-") and restarts.isdigit() and int(restarts) > 0)


def launch_run_name(timestamp: str) -> str:
    """``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>`` in an ``srun`` step of several tasks, ``torchrun-<TORCHELASTIC_RUN_ID>``
    in a ``torchrun`` launch of several processes (its ``--rdzv-id``, a new uuid with ``--standalone``; torchrun's
    default ``none`` is ``<host>-<the agent's launch>`` on one node and names nothing on several), else ``timestamp``.
    Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``: the name is a directory."""
    env = os.environ

    def count(key: str) -> int:
        value = env.get(key, "")
        return int(value) if value.isdigit() else 1

    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none" and "TORCHELASTIC_RUN_ID" in env and count("LOCAL_WORLD_SIZE") == count("WORLD_SIZE"):
        # torchrun draws a uuid on one node only without --master-port and --rdzv-endpoint; with either the id is
        # 'none', and each rank's start time named a run dir (and a sweep dir, to the microsecond) of its own.
        run_id = f"{socket.gethostname()}-{_torchrun_launch_id(env)}"
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") and count("SLURM_STEP_NUM_TASKS") > 1:
        name = f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    elif run_id != "none" and count("WORLD_SIZE") > 1:
        name = f"torchrun-{run_id}"
    else:
        return timestamp
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def register() -> None:
    """Register the ``lit.*`` resolvers with OmegaConf (once; importing lit_dtrain does it)."""
    if not OmegaConf.has_resolver("lit.warmup"):
        OmegaConf.register_new_resolver("lit.warmup", default_warmup)
    if not OmegaConf.has_resolver("lit.launch_run_name"):
        OmegaConf.register_new_resolver("lit.launch_run_name", launch_run_name)
    if not OmegaConf.has_resolver("lit.env_dir"):
        OmegaConf.register_new_resolver("lit.env_dir", env_dir)
    if not OmegaConf.has_resolver("lit.run_dir"):
        OmegaConf.register_new_resolver("lit.run_dir", run_dir)
    if not OmegaConf.has_resolver("lit.required"):
        OmegaConf.register_new_resolver("lit.required", required)


register()
