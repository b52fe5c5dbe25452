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
