"""A strategy given by name (``strategy=auto``, or ``strategy.name=ddp``) built as lit_dtrain's class.

``strategy=auto`` (the default) hands Lightning the name ``auto``. On several processes (``trainer=ddp_cpu``, several
GPUs, ``trainer.num_nodes`` > 1, torchrun) Lightning chooses ``ddp`` (``ddp_fork`` in an interactive session) and
builds it from its strategy registry: its plain ``DDPStrategy``, without the epoch-length check of ``strategy=ddp``
(:class:`~lit_dtrain.strategies.fit_end.EpochLengthCheck`). While :func:`even_epochs_by_name` is active, every
registry name of Lightning's plain ``DDPStrategy`` or ``FSDPStrategy`` builds
:class:`~lit_dtrain.strategies.EvenEpochsDDPStrategy` or :class:`~lit_dtrain.strategies.EvenEpochsFSDPStrategy`
with that name's arguments (start method, ``find_unused_parameters``, CPU offload); Lightning's choice itself (which
name, its fallbacks) and every other name are unchanged, and so is the registry once it ends.

Such a strategy's collective timeout is ``strategy.collective_timeout_s`` as under ``strategy=ddp`` (in
``conf/strategy/auto.yaml``; 1800 s, Lightning's default too): the key was not in ``strategy=auto``, so
``strategy.collective_timeout_s=60``, which a ``CollectiveError`` names, was Hydra's 'Could not override'. Its
first connection waits ``strategy.connect_timeout_s`` (:mod:`._connect`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, Strategy, StrategyRegistry
from omegaconf import DictConfig


def build_strategy(cfg: DictConfig) -> Strategy | str:
    """The Trainer's ``strategy`` argument for ``cfg.strategy``: a ``_target_`` node's instance, or a Lightning name
    (``strategy=auto``'s ``name``), which Lightning builds: inside :func:`trainer_strategy` as lit_dtrain's class."""
    node = cfg.get("strategy")
    if node is None:
        return "auto"
    if "_target_" in node:
        for key in ("collective_timeout_s", "connect_timeout_s"):  # named as the config key here (the target names
            if key in node:  # its Python argument)
                _config_timeout(node[key], key)
        return instantiate(node)
    return node.get("name", "auto")


def _config_timeout(seconds: Any, key: str = "collective_timeout_s") -> timedelta:
    """``strategy.<key>`` as a ``timedelta``; a ConfigError naming that key unless it is a number > 0."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import collective_timeout

    try:
        return collective_timeout(seconds, key=key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@contextlib.contextmanager
def trainer_strategy(cfg: DictConfig) -> Iterator[Strategy | str]:
    """Yields :func:`build_strategy`'s value; build the Trainer within: the DDP / FSDP Lightning builds for a name is
    lit_dtrain's class with ``strategy.collective_timeout_s`` (:func:`even_epochs_by_name`)."""
    node = cfg.get("strategy")
    named = node if node is not None and "_target_" not in node else {}
    with even_epochs_by_name(named.get("collective_timeout_s", 1800), named.get("connect_timeout_s", 1800)):
        yield build_strategy(cfg)


def refuse_spawned_ranks(trainer: Any) -> None:
    """A ConfigError for a Trainer whose strategy runs ``fit`` in new processes that return to this one (Lightning's
    ``_MultiProcessingLauncher``: ``strategy.name=ddp_spawn``, ``ddp_fork``, ``ddp_notebook``, ``start_method=spawn``,
    and ``strategy=auto`` on several devices in a notebook). This process then holds the trained weights but not the
    fit's step count, optimizer state nor data state: a 2-rank ``strategy.name=ddp_spawn`` run of 4 steps exited 0
    with ``summary.json`` saying ``steps: 0``, ``tokens_per_sec: null``, and a ``last.ckpt`` at step 0 without
    optimizer state, from which ``resume=auto`` would train every step again."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _MultiProcessingLauncher):
        return
    from lit_dtrain.errors import ConfigError

    raise ConfigError(
        f"{type(trainer.strategy).__name__} with start_method={getattr(launcher, '_start_method', '?')!r} runs fit in "
        "new processes that return to this one without the step count, optimizer state and training figures "
        "(summary.json and last.ckpt would say step 0): use strategy=auto or strategy=ddp, whose ranks re-run the "
        "script (start_method='popen'); from a notebook, run train.py as a script")


@contextlib.contextmanager
def even_epochs_by_name(collective_timeout_s: Any = 1800, connect_timeout_s: Any = 1800) -> Iterator[None]:
    """Within: Lightning builds lit_dtrain's DDP / FSDP classes, with this collective timeout and first-connection
    timeout (seconds), for the names of its plain ones (around a Trainer's construction, where Lightning resolves a
    strategy name)."""
    from lit_dtrain.strategies import EvenEpochsDDPStrategy, EvenEpochsFSDPStrategy

    timeout = _config_timeout(collective_timeout_s)
    connect = _config_timeout(connect_timeout_s, "connect_timeout_s")
    ours = {DDPStrategy: EvenEpochsDDPStrategy, FSDPStrategy: EvenEpochsFSDPStrategy}
    saved = {name: entry for name, entry in StrategyRegistry.items() if entry["strategy"] in ours}
    try:
        for name, entry in saved.items():
            init_params = {**entry["init_params"], "timeout": timeout, "connect_timeout": connect}
            StrategyRegistry[name] = {**entry, "strategy": ours[entry["strategy"]], "init_params": init_params}
        yield
    finally:
        StrategyRegistry.update(saved)
