"""The argument checks of lit_dtrain's own callbacks and codecs, with the config checks, before the seed.

``callbacks.loss_spike.z_threshold=-1``, ``callbacks.throughput.window_size=0`` or
``strategy.compressor.matrix_approximation_rank=0`` are refused by the class's ``__init__``; the run built the
callbacks after 'Seed set to 1337', the datamodule and the model, and the strategy later still. :func:`check_own_builds`
builds each such node once and drops it. Only nodes whose every ``_target_`` is one of lit_dtrain's callbacks
(``lit_dtrain.callbacks.__all__``) or codecs / local-update rules (the classes of
``lit_dtrain.strategies.registry``) are built: their ``__init__`` checks and stores its arguments, draws no random
number and touches no file or signal handler (tests/unit/test_own_builds_check.py holds them to it). A user's
``_target_`` is built only where the run builds it: its ``__init__`` may draw from the seeded generators."""

from __future__ import annotations

import warnings

from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_dtrain.utils.job_log import no_log_records


def _targets(node) -> list[str]:
    """Every ``_target_`` in ``node`` (a config node, or its plain container), nested ones too."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):  # (a mapping without one: Lightning's Timer(duration={minutes: 30}))
        return ([str(node["_target_"])] if "_target_" in node else []) + [
            t for key, value in node.items() if key != "_target_" for t in _targets(value)]
    if isinstance(node, list):
        return [t for value in node for t in _targets(value)]
    return []


def own_callback_targets() -> set[str]:
    """The ``_target_`` spellings of lit_dtrain's callbacks: ``lit_dtrain.callbacks.<Name>``, and its module's."""
    import lit_dtrain.callbacks as callbacks

    return {spelling for name, module in callbacks._EXPORTS.items()
            for spelling in (f"lit_dtrain.callbacks.{name}", f"{module}.{name}")}


def own_codec_targets() -> set[str]:
    """The ``_target_`` spellings of the codecs and local-update rules that ``strategy.compressor`` and
    ``strategy.local_update`` name (the classes behind the registry's names)."""
    from lit_dtrain.strategies.registry import COMPRESSORS, LOCAL_UPDATES, _class_and_fixed

    classes = {_class_and_fixed(factory)[0] for factory in (*COMPRESSORS.values(), *LOCAL_UPDATES.values())}
    return {spelling for cls in classes
            for spelling in (f"lit_dtrain.strategies.{cls.__name__}", f"{cls.__module__}.{cls.__qualname__}")}


def own_nodes(cfg: DictConfig) -> list[DictConfig]:
    """The nodes :func:`check_own_builds` builds: ``callbacks.<name>`` and ``strategy.compressor`` /
    ``strategy.local_update`` whose every ``_target_`` is lit_dtrain's own."""
    nodes = []
    callback_targets = own_callback_targets()
    for node in (cfg.get("callbacks") or {}).values():
        if isinstance(node, DictConfig) and (found := _targets(node)) and set(found) <= callback_targets:
            nodes.append(node)
    logger = cfg.get("logger")  # logger=csv's (its __init__ writes nothing; Lightning's makes the dirs when it logs)
    if isinstance(logger, DictConfig) and "_target_" in logger and \
            _targets(logger) == ["lit_dtrain.loggers.ResumableCSVLogger"]:
        nodes.append(logger)
    strategy = cfg.get("strategy")
    if isinstance(strategy, DictConfig) and "_target_" in strategy:
        codec_targets = own_codec_targets()
        for key in ("compressor", "local_update"):
            node = strategy.get(key)
            if isinstance(node, DictConfig) and (found := _targets(node)) and set(found) <= codec_targets:
                nodes.append(node)
    return nodes


def check_own_builds(cfg: DictConfig) -> None:
    """Build :func:`own_nodes` once, as the run does (``instantiate``), and drop them: a bad argument raises the
    class's own error, which ``train.py`` reports as ``error: <node's key>: <message>`` (Hydra's ``full_key``).
    Warnings of the build, and its ``logging`` records, are the run's to give (it builds them again): WSDScheduler's
    'decay_fraction=0.2 of total_steps=2 rounds to 0 decay steps', logged, was printed twice."""
    from hydra.utils import instantiate

    from lit_dtrain._blocks_check import check_selective_checkpointing_blocks

    check_fourier_sampler_pairing(cfg)
    for node in own_nodes(cfg):
        with warnings.catch_warnings(), no_log_records():
            warnings.simplefilter("ignore")
            instantiate(node)
    check_selective_checkpointing_blocks(cfg)  # after the callbacks' argument checks (module_pattern=0)


def _located(target) -> type | None:
    """The class a ``_target_`` names, or None where it names none here (its build names it)."""
    from hydra._internal.utils import _locate  # hydra.utils.get_class logs an ERROR for a target that is no class

    try:
        found = _locate(str(target))
    except Exception:  # noqa: BLE001 - not importable here
        return None
    return found if isinstance(found, type) else None


def check_fourier_sampler_pairing(cfg: DictConfig) -> None:
    """``FourierSamplerCallback`` chosen (``callbacks=[default,fourier_sampler]``) where ``LMDataModule`` draws with
    another sampler (the default ``data/sampler=random``): a ``ConfigError`` naming ``data/sampler=fourier``. The
    callback found it in its ``setup``, inside fit: a TypeError traceback (45 lines) after the seed, the corpus's
    tokenization and ``config_resolved.yaml``. A datamodule of one's own is the callback's to check."""
    from lit_dtrain.callbacks.fourier_sampler import FourierSamplerCallback
    from lit_dtrain.data import LMDataModule
    from lit_dtrain.data.samplers import FourierSampler
    from lit_dtrain.errors import ConfigError

    data = cfg.get("data")
    if not isinstance(data, DictConfig) or _located(data.get("_target_")) is not LMDataModule:
        return
    sampler = data.get("sampler")
    cls = _located(sampler.get("_target_")) if isinstance(sampler, DictConfig) else None
    if cls is not None and issubclass(cls, FourierSampler):
        return
    for name, node in (cfg.get("callbacks") or {}).items():
        if isinstance(node, DictConfig) and (found := _located(node.get("_target_"))) is not None and \
                issubclass(found, FourierSamplerCallback):
            given = cls.__name__ if cls is not None else OmegaConf.to_container(sampler) \
                if isinstance(sampler, (DictConfig, ListConfig)) else sampler
            raise ConfigError(f"callbacks.{name} (FourierSamplerCallback) feeds a FourierSampler, and data.sampler is "
                              f"{given}: select data/sampler=fourier, or drop the callback")
