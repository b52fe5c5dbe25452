"""Which checkpoint a start of ``train(cfg)`` continues from, and the checks of it before any compute.

- :func:`resolve_ckpt_path`: with ``resume=auto`` the newest intact checkpoint of the run dir with finite weights
  (``last.ckpt`` among equals) once it holds one, else ``ckpt_path`` (so one command starts a run from another run's
  checkpoint and continues it when requeued); a fresh start in a run dir that holds checkpoints is refused, and so is
  ``resume=auto`` where nothing can be resumed (a default ``run_name``, a multirun's new sweep dir:
  :func:`new_sweep_dir_error`, which ``lit_dtrain.sweeps.ResumeSweepCheck`` raises too);
- :func:`newest_step_checkpoint`: that newest readable checkpoint (``lit_dtrain.sigterm_exit`` names it when
  Ctrl-C stops a run where nothing saves);
- :func:`check_start_step` and :func:`check_optimizer_state`: a checkpoint past ``trainer.max_steps``, or one whose
  optimizer state the configured optimizer cannot read.

``lit_dtrain.train`` runs them; they are importable from there too.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_dtrain._chdir_paths import LIGHTNING_CKPT_NAMES
from lit_dtrain.checkpoint import (
    CheckpointError,
    checkpoint_files,
    checkpoint_global_step,
    first_nonfinite_weight,
    not_a_file_reason,
    safe_torch_load,
)
from lit_dtrain.config_resolvers import launch_run_name, launch_survives_restart
from lit_dtrain.errors import ConfigError
from lit_dtrain.sweeps import another_run_dir
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.train")  # train(cfg)'s logger: its lines in train.log read as before the split

_DEFAULT_RUN_NAME = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}"  # conf/train.yaml: ${now:%Y-%m-%d}_${now:%H-%M-%S}


def _default_run_name(cfg: DictConfig) -> bool:
    """Whether ``run_name`` is still conf/train.yaml's default (the ``${now:...}`` timestamp, or a launcher's id), i.e.
    nobody gave one (a name given on the command line replaces the interpolation, even one that looks like it)."""
    raw = OmegaConf.to_container(cfg, resolve=False).get("run_name")
    return isinstance(raw, str) and "${now:" in raw


_IMPORTED_AT = time.time()  # before Hydra resolves ${now:...} for this start's sweep dir


def _created_by_this_start(sweep_dir: Path, hydra_overrides: list[str] | None = None) -> bool:
    """Whether ``sweep_dir`` is the default sweep dir (conf/hydra: ``<time>.%f``) of this very start (not one given
    with ``hydra.sweep.dir``): its timestamp is not older than this process's import of lit_dtrain.resume (which
    lit_dtrain.train imports). Under srun/torchrun the default is the launch's id (as ``run_name``'s), the same on
    every rank and again on a re-launch with that id (a requeued SLURM job, a fixed ``--rdzv-id``): such a dir is
    this start's while no job of it holds a checkpoint (the same on all ranks), unless a requeue or torchrun restart
    starts it again (as ``run_name``'s: ``torchrun --max-restarts=1 train.py -m ... resume=auto`` was refused on every
    attempt). ``hydra_overrides``: Hydra's own overrides of this start, where its runtime config is not set yet."""
    launch = launch_run_name("")
    if launch:
        kept = _sweep_dir_given(hydra_overrides) or launch_survives_restart()
        return sweep_dir.name == launch and not kept and not any(sweep_dir.glob("*/checkpoints/*.ckpt"))
    if not re.fullmatch(rf"{_DEFAULT_RUN_NAME}\.\d{{6}}", sweep_dir.name):
        return False
    started = datetime.strptime(sweep_dir.name, "%Y-%m-%d_%H-%M-%S.%f").timestamp()
    return started >= _IMPORTED_AT - 1.0


def _sweep_dir_given(hydra_overrides: list[str] | None = None) -> bool:
    """Whether ``hydra.sweep.dir`` was set on the command line: among ``hydra_overrides`` (Hydra's own overrides),
    by default among those of Hydra's runtime config (False outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if hydra_overrides is None:
        if not HydraConfig.initialized():
            return False
        hydra_overrides = list(HydraConfig.get().overrides.hydra)
    return any(str(o).lstrip("+~").split("=")[0] == "hydra.sweep.dir" for o in hydra_overrides)


def new_sweep_dir_error(sweep_dir: Path) -> ConfigError:
    """The refusal of ``resume=auto`` in a multirun whose sweep dir is this start's new one (nothing to resume)."""
    return ConfigError(
        f"resume=auto in a multirun needs hydra.sweep.dir=<the sweep to continue>: without it this start "
        f"writes a new sweep dir {str(sweep_dir)!r} that holds no checkpoint. Re-run the same -m arguments "
        "with hydra.sweep.dir=<outputs/multiruns/<time or launch id> of that sweep>: job N resumes "
        "<sweep dir>/N"
    )


def _checkpoint_steps(ckpt_dir: Path) -> tuple[dict[Path, int], dict[Path, CheckpointError]]:
    """The ``global_step`` of each readable ``*.ckpt`` of ``ckpt_dir``, and why each other one cannot be read. Reads
    each file's ``global_step`` only (mmap: milliseconds for any size; not the CRC check, which reads a file whole:
    :func:`_newest_finite` checks the one chosen)."""
    steps, unreadable = {}, {}
    for p in sorted(ckpt_dir.glob("*.ckpt")):
        try:
            steps[p] = checkpoint_global_step(p, verify=False)
        except CheckpointError as e:
            unreadable[p] = e
    return steps, unreadable


def _without_advice(error: CheckpointError) -> str:
    """A load error's reason without its closing advice ("It is left as it is; use a complete copy ...")."""
    return str(error).split(". It is left as it is")[0]


def _newest(steps: dict[Path, int]) -> Path:
    return max(steps, key=lambda p: (steps[p], p.name == "last.ckpt"))


def _newest_finite(
    steps: dict[Path, int], unreadable: dict[Path, CheckpointError], verify: bool = True
) -> tuple[Path | None, dict[Path, str]]:
    """The newest of ``steps`` (:func:`_newest`) whose weights are finite, and the newer ones passed over, each with
    the first non-finite tensor (written before ``AtomicCheckpointIO`` refused such saves, or by another tool). Reads
    the weights of the newest file only, and of each one passed over (mmap; stops at the first bad tensor); with
    ``verify``, each of them whole first (:func:`~lit_dtrain.checkpoint.verify_checkpoint`): a damaged one is passed
    over too, into ``unreadable`` (a resume of it failed, or went on with the changed bytes)."""
    remaining, bad = dict(steps), {}
    while remaining:
        newest = _newest(remaining)
        try:
            key = first_nonfinite_weight(newest, verify=verify)
        except CheckpointError as e:  # a member fails its CRC-32 check
            unreadable[newest] = e
            remaining.pop(newest)
            continue
        if key is None:
            return newest, bad
        bad[newest] = key
        step = remaining.pop(newest)
        log_once(
            log, logging.WARNING,
            "resume=auto: skipped %s (step %d): its weights are not finite (NaN/inf in %r), and "
            "a resume would stop again at its first step", newest, step, key)
    return None, bad


def newest_step_checkpoint(ckpt_dir: Path) -> Path | None:
    """The readable ``*.ckpt`` of ``ckpt_dir`` with finite weights and the highest ``global_step`` (``last.ckpt``
    among equals), or None; logs why each unreadable or non-finite one is skipped. For the messages at a run's end:
    it does not read the files whole for their CRC-32s (a resume does, :func:`_resume_auto_choice`)."""
    steps, unreadable = _checkpoint_steps(ckpt_dir)
    for e in unreadable.values():
        log_once(log, logging.WARNING, "resume=auto: skipped as unreadable: %s", e)
    return _newest_finite(steps, unreadable, verify=False)[0]


def _resume_auto_choice(ckpt_dir: Path) -> str:
    """The checkpoint ``resume=auto`` continues from in ``ckpt_dir``, which holds ``*.ckpt`` files: the newest
    readable one with finite weights (``last.ckpt`` among equals), with a warning naming each file passed over and
    why. (A checkpoint of NaN weights, written before ``AtomicCheckpointIO`` refused those or by another tool, was
    resumed, and the run stopped again at its first step.)

    ModelCheckpoint writes a new best step file before last.ckpt: a kill in between leaves last.ckpt a validation
    behind (or no last.ckpt at all, killed while writing the first). Resuming from it redid those steps and saved
    the step file again as '<name>-v1.ckpt', leaving the first one behind for good (the resumed ModelCheckpoint
    state did not know it)."""
    steps, unreadable = _checkpoint_steps(ckpt_dir)
    last = ckpt_dir / "last.ckpt"
    newest, nonfinite = _newest_finite(steps, unreadable)
    for p, e in unreadable.items():
        if p != last:
            log_once(log, logging.WARNING, "resume=auto: skipped as unreadable: %s", e)
    if newest is None:
        reasons = "; ".join([_without_advice(e) for e in unreadable.values()] + [
            f"checkpoint {str(p)!r} has non-finite weights (NaN/inf in {k!r})" for p, k in nonfinite.items()])
        raise ConfigError(
            f"resume=auto: no checkpoint in {str(ckpt_dir)!r} can be resumed ({reasons}); replace or remove "
            f"{'it' if len(unreadable) + len(nonfinite) == 1 else 'them'}, give ckpt_path=PATH, or "
            f"{another_run_dir()}"
        )
    if newest == last:
        return str(newest)
    if last in unreadable:
        why = f"{last.name} is unreadable, skipped: {_without_advice(unreadable[last])}"
    elif last in nonfinite:
        why = f"{last.name} (step {steps[last]}) has non-finite weights (NaN/inf in {nonfinite[last]!r}), skipped"
    elif last in steps:
        why = f"it is newer than {last.name} (step {steps[last]})"
    else:
        why = f"there is no {last.name}"
    log_once(
        log, logging.WARNING,
        "resume=auto: resuming from %s (step %d), the newest readable checkpoint: %s", newest,
        steps[newest], why)
    return str(newest)


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """The checkpoint to resume from: with ``resume=auto`` the newest of this run dir once it holds checkpoints,
    else ``ckpt_path`` (with ``resume=auto`` too: where a requeued job's first start begins), else none (a fresh
    start, refused in a run dir that holds checkpoints)."""
    ckpt_dir = Path(cfg.paths.checkpoint_dir)
    if (ckpt_dir / "last.ckpt").is_dir() and not (ckpt_dir / "last.ckpt").is_symlink():  # no rename replaces it
        raise ConfigError(f"{str(ckpt_dir / 'last.ckpt')!r} is a directory: every run saves its last checkpoint at "
                          "that path, so this one would train and fail at its first save; remove or rename it")
    earlier = checkpoint_files(ckpt_dir)
    given = cfg.get("ckpt_path")
    if earlier and cfg.get("resume") == "auto":
        chosen = _resume_auto_choice(ckpt_dir)
        if given:
            _check_roll_back(Path(str(given)).expanduser(), ckpt_dir)
            log_once(
                log, logging.INFO,
                "ckpt_path=%s: not read, resume=auto continues this run's own checkpoint %s", given,
                chosen)
        return chosen
    if earlier and not given:  # a fresh run here would write last-v1.ckpt beside them, and a later resume=auto pick
        # the old one
        own = ckpt_dir.resolve() == (Path(str(cfg.paths.output_dir)) / "checkpoints").resolve()
        raise ConfigError(  # a paths.checkpoint_dir of its own: another run_name would meet the same files
            (f"run dir {str(ckpt_dir.parent)!r}" if own else f"paths.checkpoint_dir {str(ckpt_dir)!r}")
            + f" already holds checkpoints of an earlier run ({', '.join(earlier[:3])}"
            f"{', ...' if len(earlier) > 3 else ''}); continue it with resume=auto or ckpt_path=PATH, or "
            + (another_run_dir() if own else "give this run another paths.checkpoint_dir")
        )
    if cfg.get("resume") == "auto":
        _check_resume_auto_can_resume(cfg)
    if given:
        path = Path(str(given)).expanduser()
        if not path.is_file():
            keyword = str(given) in LIGHTNING_CKPT_NAMES and not path.exists()
            raise ConfigError(f"ckpt_path={str(given)!r} {not_a_file_reason(path)}" + (
                f" (Lightning's ckpt_path={str(given)!r} is not read here: resume=auto continues the newest checkpoint "
                "of run_name's run dir; or give the file)" if keyword else ""))
        check_foreign_ckpt_path(path, ckpt_dir)
        _check_roll_back(path, ckpt_dir)
        if (key := first_nonfinite_weight(path)) is not None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has non-finite weights (NaN/inf in {key!r}, the first such tensor): a "
                "diverged run saved it, and resuming it would stop at its first step; give an earlier checkpoint")
        return str(path)
    if cfg.get("resume") == "auto":
        log_once(log, logging.INFO, "resume=auto: no %s yet, starting fresh", ckpt_dir / "last.ckpt")
    return None


def _check_resume_auto_can_resume(cfg: DictConfig) -> None:
    """Refuse ``resume=auto`` where a later start could never find this start's checkpoints: a single run under the
    default ``run_name`` (a new one each start), or a multirun job in the sweep dir this start just created."""
    run_name = str(cfg.get("run_name"))
    requeued = launch_survives_restart()  # a requeued Slurm job, a torchrun restart: the same default run_name
    if Path(str(cfg.paths.output_dir)).name == run_name and _default_run_name(cfg) and not requeued:
        # a single run under the default run_name (a new one each start or torchrun launch): nothing to resume
        raise ConfigError(
            f"resume=auto needs run_name=<the run to continue>: without it run_name is this start's default "
            f"({run_name}: its start time, or its torchrun launch), a new run dir that holds no checkpoint; or "
            "give ckpt_path=PATH (the default survives a requeue under srun, slurm-<job>.<step>, and a restart under "
            "torchrun --max-restarts above 0: there it resumes)"
        )
    sweep_dir = Path(str(cfg.paths.output_dir)).parent
    if _created_by_this_start(sweep_dir):
        # a multirun job in the sweep dir this start just created (conf/hydra: ${now:...%S.%f} or the launch's
        # id): nothing to resume. (conf/hydra's ResumeSweepCheck refuses it before Hydra creates that dir.)
        raise new_sweep_dir_error(sweep_dir)


def _check_roll_back(path: Path, ckpt_dir: Path) -> None:
    """Refuse rolling a run back to one of its own checkpoints while its run dir holds newer ones: the rolled-back run
    overwrites ``last.ckpt`` only at its first validation, and its step files get other names, so after an interruption
    ``resume=auto`` (the newest step) continued the abandoned steps, without a word (a roll-back from step 12 to 4
    killed at step 6 resumed, and ended with, the abandoned step 12). With ``resume=auto`` given too, the roll-back
    would not happen at all. Another run's checkpoint (a requeue-ready command's starting point), or a file that is
    gone (not read by ``resume=auto``), is not one."""
    if not path.is_file() or path.resolve().parent != ckpt_dir.resolve():
        return
    try:
        step = checkpoint_global_step(path)
    except CheckpointError:
        return  # the load names it
    steps, _ = _checkpoint_steps(ckpt_dir)
    newer = sorted((p for p in steps if steps[p] > step), key=lambda p: -steps[p])
    if newer:
        shown = ", ".join(f"{p.name} at step {steps[p]}" for p in newer[:3])
        raise ConfigError(
            f"ckpt_path={str(path)!r} rolls run dir {str(ckpt_dir.parent)!r} back to step {step}, but it holds newer "
            f"checkpoints ({shown}{', ...' if len(newer) > 3 else ''}), which resume=auto would continue (after an "
            f"interruption too) instead of the roll-back; move them into a subdirectory of {str(ckpt_dir)!r} "
            f"(resume=auto reads its top level only), or branch a new run off it in one command, which leaves this "
            f"one as it is: run_name=<new name> ckpt_path={path} (add resume=auto to continue it when requeued)"
        )


def check_foreign_ckpt_path(path: Path, ckpt_dir: Path) -> None:
    """Refuse a ``ckpt_path`` from outside a run dir that already holds checkpoints: the resumed run would overwrite
    that run's ``last.ckpt`` with another lineage's steps (and version its own as ``last-v1.ckpt``). One of the run's
    own checkpoints (a roll-back) is fine."""
    earlier = checkpoint_files(ckpt_dir)
    if earlier and path.resolve().parent != ckpt_dir.resolve():
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a checkpoint of run dir {str(ckpt_dir.parent)!r}, which already holds "
            f"checkpoints of its own ({', '.join(earlier[:3])}{', ...' if len(earlier) > 3 else ''}): resuming it "
            f"there would overwrite that run's last.ckpt; {another_run_dir()}, continue that run with "
            "resume=auto, or give one of its own checkpoints"
        )


def check_start_step(cfg: DictConfig, start_step: int, ckpt_path: str | None) -> None:
    """A checkpoint past ``trainer.max_steps`` leaves nothing to train: refuse it instead of validating it and
    reporting its step as if this run had been asked for it (at ``max_steps`` it is a finished run: validated)."""
    max_steps = cfg.trainer.get("max_steps")
    branch_steps = (cfg.get("decay_branch") or {}).get("steps")
    if ckpt_path and isinstance(max_steps, int) and start_step > max_steps and isinstance(branch_steps, int):
        # a decay branch's restart: it sets trainer.max_steps (given, it is refused), so the fix is its length
        raise ConfigError(
            f"checkpoint {ckpt_path!r} is at step {start_step}, past this decay branch's end, step "
            f"{max_steps - branch_steps} + decay_branch.steps={branch_steps} = {max_steps}; restart it with "
            f"decay_branch.steps >= {start_step - max_steps + branch_steps} (= its steps trained only validates it), "
            "or branch into a new run_name"
        )
    if ckpt_path and isinstance(max_steps, int) and start_step > max_steps:
        raise ConfigError(
            f"checkpoint {ckpt_path!r} is at step {start_step}, past trainer.max_steps={max_steps}; set "
            f"trainer.max_steps >= {start_step} to continue it (= {start_step} only validates it)"
        )


_OPTIMIZER_KINDS = {  # configured target -> the per-parameter state it reads on resume
    "lit_dtrain.optim.adamw": ("torch", "torch AdamW"),
    "lit_dtrain.optim.adamw8bit": ("bnb", "bitsandbytes 8-bit AdamW"),
}


def check_optimizer_state(cfg: DictConfig, ckpt_path: str) -> None:
    """Refuse resuming a checkpoint without optimizer state (weights only), or one whose optimizer state was written by
    the other AdamW (torch <-> bitsandbytes):
    Lightning restores it without complaint and the first step fails inside the optimizer (``KeyError: 'state1'``
    in bitsandbytes, ``KeyError: 'exp_avg'`` in torch)."""
    ckpt = safe_torch_load(ckpt_path, mmap=True)
    if "optimizer_states" not in ckpt:  # Lightning's KeyError 'Trying to restore optimizer state ...', a traceback
        raise ConfigError(
            f"checkpoint {ckpt_path!r} holds no optimizer state (a weights-only save: ModelCheckpoint's "
            f"save_weights_only), so it cannot be resumed; start a new run_name from its weights with "
            f"init_from={ckpt_path}"
        )
    configured = _OPTIMIZER_KINDS.get(str(cfg.optimizer.get("_target_")))
    if configured is None:
        return
    saved = None
    for opt_state in ckpt.get("optimizer_states") or []:
        for param_state in (opt_state.get("state") or {}).values() if isinstance(opt_state, dict) else []:
            keys = set(param_state) if isinstance(param_state, dict) else set()
            if "exp_avg" in keys:
                saved = ("torch", "torch AdamW")
            elif "state1" in keys or any(str(k).startswith("__bnb") for k in keys):
                saved = ("bnb", "bitsandbytes 8-bit AdamW")
            if saved:
                break
        if saved:
            break
    if saved is not None and saved[0] != configured[0]:
        name = cfg.optimizer._target_.rsplit(".", 1)[-1]
        raise ConfigError(
            f"checkpoint {ckpt_path!r} holds {saved[1]} optimizer state, but optimizer={name} is configured; resume "
            f"with the optimizer it was trained with, or switch with init_from={ckpt_path} (weights only)"
        )


def warn_if_accumulation_splits(cfg: DictConfig, ckpt_path: str) -> None:
    """Warn when the checkpoint's micro-batch count in its epoch is no multiple of
    ``trainer.accumulate_grad_batches``: Lightning steps when its count reaches one, so the first optimizer step of
    the resumed run accumulates fewer micro-batches, its loss still divided by the full count (7 steps with 1,
    resumed with 2: the next step was one micro-batch at half the gradient), without a word. The warning says why,
    from the epoch's optimizer steps in the file: the setting changed since the write, or the file was saved
    mid-step (an earlier lit_dtrain's ``train_time_interval`` save or ``trainer.max_time`` stop; it said 'changed'
    for those too, and a max_time one's 'train_time_interval save' only), or either.
    A file saved at an epoch's last batch, where Lightning steps whatever the count, is not warned about: the next
    epoch counts from 0 (it was, e.g. micro-batch 16 of a 16-batch epoch with 3)."""
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    ckpt = safe_torch_load(ckpt_path, mmap=True)
    try:
        loop = ckpt["loops"]["fit_loop"]
        progress = loop["epoch_loop.batch_progress"]
        done = int(progress["current"]["ready"])
        steps = int(loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["current"]
                    ["completed"])  # this epoch's optimizer steps
    except (KeyError, TypeError, ValueError):
        return
    if accumulate <= 1 or not done % accumulate or progress.get("is_last_batch"):
        return
    short = accumulate - done % accumulate
    reasons = []
    if done // accumulate == steps:  # this setting's steps, then part of the next
        reasons.append(f"saved mid-step, after {done % accumulate} of a step's {accumulate} micro-batches, as an "
                       "earlier lit_dtrain's train_time_interval save or trainer.max_time stop did")
    if steps and done % steps == 0:  # whole steps of another setting
        reasons.append(f"written with accumulate_grad_batches={done // steps}")
    reason = ", or ".join(reasons) or "changed since it was written, or saved mid-step"
    log_once(
        log, logging.WARNING,
        "checkpoint %s is at micro-batch %d of its epoch, no multiple of trainer.accumulate_grad_batches=%d (%s): the "
        "first optimizer step after the resume accumulates %d micro-batch(es), not %d, and its gradient is %d/%d of "
        "a full step's", ckpt_path, done, accumulate, reason, short, accumulate, short, accumulate)
