"""lit_dtrain: a modular Lightning + Hydra trainer for language models."""

from lit_dtrain import config_resolvers as _config_resolvers  # noqa: F401  (registers ${lit.*} resolvers)

__version__ = "0.1.0"
