"""Tokenizer, corpus files (``corpus``, ``reading``) -> token cache (``token_cache``), windows, the LM datamodule, and
samplers."""

from lit_dtrain.data.corpus import CorpusError, CorpusSource, stdlib_files
from lit_dtrain.data.datamodule import LMDataModule
from lit_dtrain.data.token_cache import build_token_cache
from lit_dtrain.data.tokenizer import ByteTokenizer
from lit_dtrain.data.windows import WindowSet, window_batch

__all__ = [
    "ByteTokenizer",
    "CorpusError",
    "CorpusSource",
    "LMDataModule",
    "WindowSet",
    "build_token_cache",
    "stdlib_files",
    "window_batch",
]
