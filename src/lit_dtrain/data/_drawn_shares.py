"""Each source's share of the training windows a mixture has drawn so far, for TensorBoard (``data/share/<name>``).

Validation is per source (``val/<name>/loss``), but which share of the batches each source gave was not logged: a
user of ``experiment=cpt_replay`` could not see the replay share a run trained on. Every rank draws the whole global
batch of a micro-step (:meth:`LMDataModule.next_train_batch` takes its shard of it), so the counts here are every
rank's together with no collective, and are the same on every rank. They are counted on the host, from the indices the
sampler drew (a few microseconds a micro-batch: no device work), and kept in the datamodule's state, so a resumed run
goes on from its checkpoint's counts.
"""

from __future__ import annotations

import numpy as np
import torch

STATE_KEY = "drawn_per_source"  # the datamodule's state: {source name: windows drawn} (all ranks')


def count_drawn(datamodule, indices: torch.Tensor) -> None:
    """Add the global batch ``indices`` (every rank's windows of one micro-step) to the datamodule's per-source counts
    (kept only for a mixture of 2+ sources, and not after a resume from a checkpoint that lacks them)."""
    counts = datamodule.drawn_windows
    if counts is None or len(counts) < 2:
        return
    sources = datamodule.train_windows.source_of(indices.numpy())
    counts += np.bincount(sources, minlength=len(counts))


def drawn_state(datamodule) -> dict[str, int] | None:
    """The counts for the checkpoint: ``{name: windows drawn}``, or None where they are not known."""
    counts = datamodule.drawn_windows
    if counts is None:
        return None
    return {s.name: int(c) for s, c in zip(datamodule.sources, counts)}


def restore_drawn(datamodule, state: dict) -> None:
    """Take the checkpoint's counts. One that drew no batch starts from zero; one written before the counts were kept,
    or with other sources, leaves them unknown: no share is logged rather than shares of this run's draws alone."""
    saved, names = state.get(STATE_KEY), [s.name for s in datamodule.sources]
    if isinstance(saved, dict) and list(saved) == names:
        datamodule.drawn_windows = np.asarray([int(saved[n]) for n in names], dtype=np.int64)
    elif not int(state.get("micro_step", 0)):
        datamodule.drawn_windows = np.zeros(len(names), dtype=np.int64)
    else:
        datamodule.drawn_windows = None


def drawn_share_metrics(datamodule) -> dict[str, float]:
    """``{"data/share/<name>": windows drawn from the source / all windows drawn}`` of a mixture of 2+ sources with
    known counts and a drawn batch; else ``{}`` (one source, another datamodule, nothing drawn yet)."""
    counts = getattr(datamodule, "drawn_windows", None)
    if counts is None or len(counts) < 2 or not counts.sum():
        return {}
    total = float(counts.sum())
    return {f"data/share/{s.name}": float(c) / total for s, c in zip(datamodule.sources, counts)}
