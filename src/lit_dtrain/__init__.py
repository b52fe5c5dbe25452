"""lit_dtrain: a modular Lightning + Hydra trainer for language models."""

__version__ = "0.1.0"
