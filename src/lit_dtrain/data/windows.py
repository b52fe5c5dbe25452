"""Windows over token streams: :class:`WindowSet` (windows of ``block_size + 1`` tokens addressed by a global
index), the batch contract :func:`window_batch`, the validation windows with their zero-weight fillers, the token
counts of a stream, and :func:`dataset_key`, which names the training windows. Torch and NumPy, no Lightning;
:class:`~lit_dtrain.data.datamodule.LMDataModule` serves them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lit_dtrain.data.token_cache import TokenSplits

COUNT_CHUNK_TOKENS = 1 << 22  # tokens counted per np.bincount call (it makes an int64 copy: 32 MB)


def token_counts(stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in ``stream`` (int64), counted in chunks: ``np.bincount`` of a whole
    uint16 memmap copies it to int64 first, 8 bytes per token of the corpus."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(stream), COUNT_CHUNK_TOKENS):
        counts += np.bincount(stream[start : start + COUNT_CHUNK_TOKENS], minlength=vocab_size)
    return counts


class WindowSet:
    """Windows of ``block_size + 1`` tokens over one or more token streams, addressed by global index."""

    def __init__(self, streams: list[np.ndarray], block_size: int) -> None:
        self.streams, self.block_size = streams, block_size
        counts = [(len(s) - 1) // block_size for s in streams]
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, index: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, index, side="right") - 1

    def gather(self, indices) -> torch.Tensor:
        """Long tensor [len(indices), block_size + 1] of the windows at these global indices."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        src = self.source_of(idx)
        T = self.block_size
        out = np.empty((len(idx), T + 1), dtype=np.int64)
        for row, (i, s) in enumerate(zip(idx.tolist(), src.tolist())):
            start = (i - int(self.offsets[s])) * T
            out[row] = self.streams[s][start : start + T + 1]
        return torch.from_numpy(out)


def _cache_key(split: TokenSplits) -> str:
    """The content key of a source's token cache (the suffix of its dir name), or '' for a stream that is not one."""
    return Path(getattr(split.train, "filename", None) or "").parent.name.rpartition("-")[2]


def dataset_key(splits: list[TokenSplits]) -> str | None:
    """Which training windows a sampler's per-window state (its table, its exclusions) indexes: a hash of the
    sources' token-cache keys in order (each covers the files' bytes, the window length and val_fraction), or None
    when a stream is not a cache file. Recorded in the sampler's state, so a resume on another corpus is refused."""
    keys = [_cache_key(s) for s in splits]
    if not all(keys):
        return None
    return hashlib.sha256("|".join(keys).encode()).hexdigest()[:16]


def window_batch(windows: torch.Tensor, index: torch.Tensor) -> dict:
    """The batch contract: ``{"input_ids", "labels", "index"}`` from windows [B, T+1]."""
    return {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous(), "index": index}


class _ValWindows(Dataset):
    """The validation windows at ``indices``, then ``padding`` fillers: copies of the first windows whose
    ``loss_weight`` is 0 (a real window's is 1), so that a data-parallel split gives every rank as many."""

    def __init__(self, windows: WindowSet, indices: np.ndarray, padding: int = 0) -> None:
        self.windows, self.indices, self.padding = windows, indices, padding

    def __len__(self) -> int:
        return len(self.indices) + self.padding

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"validation item {i} out of range [0, {len(self)})")
        position = i % len(self.indices)  # a filler repeats a window, as torch's DistributedSampler pads
        w = self.windows.gather(self.indices[position : position + 1])
        b = window_batch(w, torch.as_tensor(self.indices[position : position + 1]))
        item = {k: v[0] for k, v in b.items()}
        item["loss_weight"] = torch.tensor(1.0 if i < len(self.indices) else 0.0)
        return item
