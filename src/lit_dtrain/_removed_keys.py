"""``~key`` on the command line (Hydra's deletion) of a key lit_dtrain needs: one line naming it and the fix.

A removed section failed later with OmegaConf's ``Key 'optimizer' is not in struct`` traceback; a removed value of a
section that is instantiated (``~optimizer.lr``, ``~data.batch_size``, ``~model.n_layer``, ``~data.sources``) trained
silently with the class's own default instead (AdamW's lr 1e-3 for the config's 3e-3: val loss 5.5324 for 5.4665 after
one tiny step; ``~data.sources`` of ``data=textfiles`` trained on the stdlib corpus), and ``~trainer.max_steps`` was
refused as ``got -1``, Lightning's default. Removing what is meant to be optional stays allowed: ``~scheduler``,
``~sample``, ``~logger``, ``~callbacks.<name>``, ``~strategy.compressor`` (re-added with ``+``) and ``_target_``-style
keys. A primary config without a section lit_dtrain needs (``--config-name experiment/wsd_vs_cosine``, a partial
config: OmegaConf's ``Key 'optimizer' is not in struct`` traceback) is refused in one line too.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from lit_dtrain.errors import ConfigError

_SECTIONS = {"model": "choose an option instead (model=nano)", "data": "choose an option instead (data=stdlib)",
             "optimizer": "choose an option instead (optimizer=adamw)",
             "trainer": "choose an option instead (trainer=default)",
             "paths": "leave it in and set its keys (LIT_DTRAIN_OUTPUT, LIT_DTRAIN_CACHE)",
             "module": "leave it in and set its keys (module.compile=true)", "seed": "set it instead (seed=1337)"}
_LEAVES_OF = ("model", "data", "optimizer", "trainer")  # instantiated: a removed value is the class's own default
_ABSENT = object()


def _removed(override: str) -> str | None:
    if not override.startswith("~"):
        return None
    return override[1:].split("=", 1)[0].strip()


def check_removed_keys(cfg: DictConfig) -> None:
    """Refuse a ``~key`` override (this start's Hydra overrides) of a key lit_dtrain needs that is still missing
    from ``cfg`` (not re-added with ``+key=...``); a no-op outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # '${oc.env:X}' kept as text
    for key in filter(None, map(_removed, overrides)):
        try:
            if OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False) is not _ABSENT:
                continue  # re-added
        except Exception:
            continue
        section, _, leaf = key.partition(".")
        if not leaf and section in _SECTIONS:
            raise ConfigError(f"~{key} removes the '{key}' config, which lit_dtrain needs: {_SECTIONS[section]}")
        if section in _LEAVES_OF and leaf and not leaf.split(".")[-1].startswith("_") and "." not in leaf:
            raise ConfigError(f"~{key} removes a value the config sets: {key} would silently take the class's own "
                              f"default; set it instead ({key}=<value>)")
    missing = [section for section in _SECTIONS if section not in cfg]
    if missing:  # `--config-name experiment/wsd_vs_cosine`: a partial config as the primary one
        name = HydraConfig.get().job.config_name
        raise ConfigError(f"the config {name!r} has no {', '.join(missing)}: it is not a whole config (lit_dtrain's "
                          f"is 'train'); apply an experiment with experiment=<name>, not --config-name, or start a "
                          f"config of your own with 'defaults: [train, _self_]'")
