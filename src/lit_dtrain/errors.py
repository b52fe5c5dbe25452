"""lit_dtrain's error for a bad setting, importable from any module (``lit_dtrain.train`` imports them all).

``python train.py`` reports a :class:`ConfigError` as one line, ``error: <message>``, wherever it is raised:
while the config is checked, or later, when a callback or sampler finds a setting that does not fit the model or
the checkpoint (:func:`lit_dtrain.sweeps.user_error`).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid, or does not fit the model or checkpoint; the message names the key."""
