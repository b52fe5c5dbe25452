"""A multirun's grid as Hydra's basic sweeper expanded it (this start's ``multirun.yaml``), checked in each job by
``lit_dtrain.sweeps.sweep_checks``: a value listed twice, an experiment's grid that was never swept, and one
``paths.checkpoint_dir`` for all jobs."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lit_dtrain.errors import ConfigError

log = logging.getLogger("lit_dtrain.sweeps")  # the sweep checks' logger, as before the split


def warn_if_the_grid_repeats_a_point(hc) -> None:
    """Warn when a swept key of this multirun (``-m`` or an experiment's ``hydra.sweeper.params``) lists a value
    twice: ``optimizer.lr=1e-3,1e-3`` (a typo for 3e-3) trained the same run twice without a word, and
    ``compare_runs.py`` labelled the rows by job number alone, since no value differs between them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    task = sweep_task(hc)
    params = [f"{key}={value}" for key, value in (hc.sweeper.get("params") or {}).items()]
    axes = {}  # the command line's value of a key replaces the experiment's
    for o in OverridesParser.create().parse_overrides(params + task):
        if o.value_type in (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP, ValueType.RANGE_SWEEP):
            axes[o.key_or_group] = [str(v) for v in o.sweep_iterator()]  # 1e-3 and 0.001 are one value
    for key, values in axes.items():
        repeated = sorted({v for i, v in enumerate(values) if v in values[:i]})
        if repeated:
            log.warning("%s lists %s more than once: this multirun trains the same configuration in several jobs "
                        "(%d values, %d distinct)", key, ", ".join(repeated), len(values), len(set(values)))


def sweep_task(hc) -> list[str]:
    """The command line's overrides of this start's multirun (``-m`` lists unexpanded), from its ``multirun.yaml``."""
    multirun = _multirun_file(hc)
    return list(OmegaConf.load(multirun).hydra.overrides.task) if multirun is not None else []


def _multirun_file(hc) -> Path | None:
    """This start's ``multirun.yaml`` (its sweep, as Hydra saved it, beside the job dirs); None where there is none."""
    multirun = Path(hc.runtime.output_dir).parent / "multirun.yaml"
    return multirun if multirun.is_file() else None


def warn_if_an_experiment_grid_was_not_swept(hc) -> None:
    """Warn when this job's config has a grid (``hydra.sweeper.params``, from its experiment) that the sweep did not
    expand: Hydra reads the grid of the config it composes before sweeping, which has no experiment where the
    experiment itself is swept (``-m experiment=wsd_vs_cosine,compression_sweep``, ``experiment=glob(*)``). Such a
    job trained one point of its experiment's comparison (its defaults: ``scheduler=wsd`` at the default LR for
    ``wsd_vs_cosine``'s six) without a word."""
    grid = hc.sweeper.get("params")
    multirun = _multirun_file(hc)
    if not grid or multirun is None:
        return
    sweeper = OmegaConf.select(OmegaConf.load(multirun), "hydra.sweeper")
    if sweeper is None:  # not Hydra's file: nothing tells what it swept
        return
    expanded = sweeper.get("params") or {}
    if not_swept := [f"{key}={value}" for key, value in grid.items() if key not in expanded]:
        experiment = hc.runtime.choices.get("experiment")
        log.warning(
            "experiment=%s sweeps %s (its hydra.sweeper.params), but this multirun did not expand that grid: Hydra "
            "sweeps an experiment's grid only where the experiment is not swept itself, so this job trains one "
            "point of it. Run each such experiment in a -m of its own: python train.py -m experiment=%s",
            experiment, " ".join(not_swept), experiment,
        )


def unknown_group_option(overrides, config_name: str | None, hydra_overrides: list[str]) -> str | None:
    """The message for the first value of a config group in ``overrides`` (parsed sweep overrides) that names no
    option of it (``-m model=nano,doesnotexist``), else None. Hydra finds out only when it composes that job, after
    it has made the sweep dir and its ``multirun.yaml``: a sweep that never ran left that dir behind, with a
    multi-line "In 'train': Could not find 'model/doesnotexist'" and the option list. Needs Hydra's global config
    loader (a ``train.py`` start); without one nothing is checked."""
    import functools

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.types import Glob

    if not GlobalHydra.instance().is_initialized():
        return None
    loader = GlobalHydra.instance().config_loader()

    @functools.cache
    def options(group: str) -> tuple[str, ...]:  # with the command line's hydra.searchpath, as Hydra composes
        return tuple(loader.get_group_options(group, config_name=config_name, overrides=hydra_overrides))

    for o in overrides:
        group = o.key_or_group
        if o.is_delete() or isinstance(o.value(), Glob) or not (options(group) or loader.list_groups(group)):
            continue  # a config key, not a group (a glob picks among the group's options)
        for value in (o.sweep_iterator() if o.is_sweep_override() else [o.value()]):
            for name in (value if isinstance(value, list) else [value]):  # callbacks=[default,loss_spike]
                if name is None:
                    continue
                parent, _, leaf = f"{group}/{name}".rpartition("/")  # strategy=ddp_compressed/int8_rs
                if leaf not in options(parent):
                    return (f"{o.input_line}: config group '{parent}' has no option '{leaf}' (options: "
                            f"{', '.join(options(parent)) or 'none'}); nothing was run")
    return None


def shared_checkpoint_dir_error(checkpoint_dir, overrides) -> str | None:
    """The message for a multirun of several jobs whose ``paths.checkpoint_dir`` is one literal dir for all of them
    (``-m optimizer.lr=1e-3,2e-3 paths.checkpoint_dir=/scratch/ckpt``), else None. ``checkpoint_dir`` is the key's
    unresolved value, ``overrides`` the sweep's parsed overrides (the command line's and an experiment's grid). Job 0
    trained into that dir and every later job was refused, since it then held job 0's checkpoints (a 2-job sweep
    spent its whole first job before the error). A value with an interpolation (the default
    ``${paths.output_dir}/checkpoints``, ``${hydra:job.num}``) or a swept one can differ per job: not judged."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    if not isinstance(checkpoint_dir, str) or "${" in checkpoint_dir:
        return None
    axes = {}  # key -> its number of values (the command line's value of a key replaces the experiment's)
    for o in overrides:
        sweep = o.is_sweep_override()
        listed = isinstance(o.value(), (ChoiceSweep, RangeSweep))  # glob(...), interval(...): not enumerable here
        axes[o.key_or_group] = (len(list(o.sweep_iterator())) if listed else 2) if sweep else 1
        if sweep and o.key_or_group in ("paths", "paths.checkpoint_dir"):
            return None  # a value per job
    if math.prod(axes.values()) < 2:  # (a glob or a sampling sweeper's interval counts as 2)
        return None
    return (f"paths.checkpoint_dir={checkpoint_dir!r} is one dir for every job of this multirun: job 0 would train "
            "into it and each later job be refused (the dir then holds job 0's checkpoints); leave it out (job N "
            "saves in <sweep dir>/N/checkpoints) or give each job its own, "
            f"'paths.checkpoint_dir={checkpoint_dir.rstrip('/')}/${{hydra:job.num}}'; nothing was run")


def raw_checkpoint_dir(cfg: DictConfig):
    """``paths.checkpoint_dir`` as given, its interpolations unresolved (None where there is none)."""
    paths = cfg.get("paths")
    node = paths._get_node("checkpoint_dir") if isinstance(paths, DictConfig) else None
    return None if node is None else node._value()


def check_shared_checkpoint_dir(cfg: DictConfig, hc) -> None:
    """Refuse every job of a multirun whose jobs share one literal ``paths.checkpoint_dir``
    (:func:`~lit_dtrain.sweep_grid.shared_checkpoint_dir_error`), also under a Hydra entry point of one's own: job 0
    trained and job 1 was refused; a job that fails here writes nothing there, so none may train."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{key}={value}" for key, value in (hc.sweeper.get("params") or {}).items()]
    try:
        overrides = OverridesParser.create().parse_overrides(params + sweep_task(hc))
    except Exception:  # noqa: BLE001 - Hydra parsed them already; nothing to judge here
        return
    if shared := shared_checkpoint_dir_error(raw_checkpoint_dir(cfg), overrides):
        raise ConfigError(shared)
