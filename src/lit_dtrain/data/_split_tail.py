"""The token cache's fallback split: the stream's tail as val, for a corpus of too few documents."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def _tokens(path: Path, count: int) -> np.ndarray:
    """The ``count`` uint16 tokens of ``path``, memory-mapped (np.memmap refuses an empty file)."""
    return np.memmap(path, dtype=np.uint16, mode="r") if count else np.zeros(0, np.uint16)


def _split_tail(tmp: Path, n_train: int, n_val: int, n_tail: int) -> tuple[int, int]:
    """Rewrite ``tmp/train.bin`` (``n_train`` tokens) and ``tmp/val.bin`` (``n_val``) as the stream ``train + val``
    split before its last ``n_tail`` tokens (all of it val when ``n_tail`` covers it). Only the tail is held in
    memory; returns the new (train, val) token counts."""
    total = n_train + n_val
    n_tail = min(n_tail, total)
    train, val = _tokens(tmp / "train.bin", n_train), _tokens(tmp / "val.bin", n_val)
    tail = np.concatenate([train[n_train - max(0, n_tail - n_val) :], val[max(0, n_val - n_tail) :]])
    if n_tail < n_val:  # the head of val joins the end of train
        with open(tmp / "train.bin", "ab") as f:
            for start in range(0, n_val - n_tail, 1 << 24):
                f.write(memoryview(np.ascontiguousarray(val[start : min(start + (1 << 24), n_val - n_tail)])))
    del train, val  # unmapped before the files are cut or rewritten
    if n_tail >= n_val:  # the tail of train joins val
        os.truncate(tmp / "train.bin", (total - n_tail) * np.dtype(np.uint16).itemsize)
    with open(tmp / "val.bin", "wb") as f:
        f.write(memoryview(tail))
    return total - n_tail, n_tail
