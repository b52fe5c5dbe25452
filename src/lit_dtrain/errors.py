"""lit_dtrain's error for a bad setting, importable from any module (``lit_dtrain.train`` imports them all).

``python train.py`` reports a :class:`ConfigError` as one line, ``error: <message>``, wherever it is raised:
while the config is checked, or later, when a callback or sampler finds a setting that does not fit the model or
the checkpoint (:func:`lit_dtrain.sweeps.user_error`).
"""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """A configuration value is invalid, or does not fit the model or checkpoint; the message names the key."""


def unset_env_var(e: BaseException) -> ConfigError | None:
    """``${oc.env:NAME}`` of an unset variable, in a config or an override: OmegaConf's traceback ended
    "Environment variable 'NAME' not found" (from lit_dtrain's own reading of the overrides too)."""
    from omegaconf.errors import InterpolationResolutionError

    found = re.search(r"Environment variable '([^']*)' not found", str(e))
    if not isinstance(e, InterpolationResolutionError) or found is None:
        return None
    name = found.group(1)
    return ConfigError(f"environment variable {name} is not set (read by ${{oc.env:{name}}}): set it, or give a "
                       f"default, ${{oc.env:{name},<default>}}")


def interpolation_error(e: BaseException, cfg=None) -> ConfigError:
    """One line for an interpolation that cannot be resolved while the config is checked: a required key's first
    line (``${lit.required:...}``), or the key holding ``${nope}`` that names no key of the config
    (``'+trainer.max_time={seconds:${nope}}'``, ``trainer.max_steps=${nope}``: OmegaConf's traceback). The key is
    looked up in ``cfg`` where OmegaConf left it out (a check's ``node.get(...)``)."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    key = getattr(e, "full_key", None) or _key_raising(e, cfg)
    if type(e).__name__ == "UnsupportedInterpolationType" and key:  # '${oc.evn:HOME}': Hydra's traceback
        return ConfigError(f"{key}: {first[:1].lower()}{first[1:]}: no resolver has that name; "
                           f"{_resolver_hint(first.rpartition(' ')[2])}")
    if type(e).__name__ != "InterpolationKeyError" or not key:
        return ConfigError(first)
    return ConfigError(f"{key}: {first[:1].lower()}{first[1:]}: an interpolation names a key the config does not "
                       f"hold; fix it, or give {key} a value")


def _key_raising(e: BaseException, cfg) -> str | None:
    """The first key of ``cfg`` whose value fails as ``e`` did, or None. OmegaConf sets no ``full_key`` on an error
    raised through ``DictConfig.get`` (the checks of trainer.precision, trainer.accelerator, the callbacks' keys): a
    line of its own words alone, 'error: Interpolation key 'nope' not found', naming no key, nor the fix."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return None

    def interpolated(node, prefix=""):  # the keys whose raw value holds an interpolation, in the config's order
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, value in items:
            if isinstance(value, (dict, list)):
                yield from interpolated(value, f"{prefix}{name}.")
            elif isinstance(value, str) and "${" in value:
                yield f"{prefix}{name}"

    for key in interpolated(OmegaConf.to_container(cfg, resolve=False)):
        try:
            OmegaConf.select(cfg, key)
        except type(e) as found:
            if str(found).splitlines()[:1] == str(e).splitlines()[:1]:
                return getattr(found, "full_key", None) or key
        except Exception:  # noqa: BLE001 - another key's failure: not the one asked for
            continue
    return None


_RESOLVERS = ("oc.env", "oc.select", "oc.decode", "oc.create", "oc.deprecated", "oc.dict.keys", "oc.dict.values",
              "now", "hydra", "lit.required", "lit.warmup", "lit.run_dir", "lit.env_dir", "lit.launch_run_name")


def _resolver_hint(name: str) -> str:
    """'did you mean oc.env?' for a resolver name with a registered one close to it, else the names to pick from."""
    import difflib

    from omegaconf import OmegaConf

    from lit_dtrain.utils.omegaconf_registry import registered_resolvers

    known = [r for r in _RESOLVERS if OmegaConf.has_resolver(r)]
    # and those the user's code registered (${my.scal:2} for my.scale was offered none, its list left it out)
    known += [r for r in registered_resolvers() if r not in known and not r.startswith("_")]
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {close[0]}?" if close else (f"fix its name, or register it before train() checks the "
                                                      f"config (resolvers here: {', '.join(known)})")
