"""Tokenizer, corpus -> token cache, the LM datamodule, and samplers."""

from lit_dtrain.data.corpus import CorpusError, CorpusSource, build_token_cache, stdlib_files
from lit_dtrain.data.datamodule import LMDataModule, WindowSet, window_batch
from lit_dtrain.data.tokenizer import ByteTokenizer

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
