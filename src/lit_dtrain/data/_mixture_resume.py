"""The mixture weights a checkpoint's run drew its batches with, recorded in the datamodule's state and compared at a
resume: another replay share (``data.sources.0.weight=50`` after ``20``) drew another share of each source from the
resumed step on without a word, where another data seed or batch size is warned about."""

from __future__ import annotations

import logging
import math

from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.corpus")


def mixture_shares(sources) -> dict[str, float]:
    """``{name: weight / sum of weights}`` of the sources (one source: ``{name: 1.0}``)."""
    total = float(sum(s.weight for s in sources))
    return {s.name: (float(s.weight) / total if total > 0 else 0.0) for s in sources}


def warn_if_the_mixture_changed(saved: dict | None, now: dict[str, float]) -> None:
    """Warn when the checkpoint's shares differ from this run's for the same sources (other sources: the dataset key's
    warning says so). A checkpoint without the record (older ones) passes."""
    if not saved or list(saved) != list(now):
        return
    if all(math.isclose(float(saved[k]), now[k], rel_tol=1e-9, abs_tol=1e-12) for k in now):
        return
    # 4 digits, or as many as tell the shares apart; the advice exact (Python's shortest repr): with 4 digits, a
    # checkpoint of weights 1 and 2 advised 'data.sources.0.weight=0.3333 data.sources.1.weight=0.6667', which,
    # followed, warned again of '(stdlib 0.3333, text 0.6667)' against '(stdlib 0.3333, text 0.6667)'
    digits = next(d for d in range(4, 18) if [f"{float(v):.{d}g}" for v in saved.values()]
                  != [f"{v:.{d}g}" for v in now.values()] or d == 17)
    fmt = ", ".join
    old = fmt(f"{k} {float(v):.{digits}g}" for k, v in saved.items())
    new = fmt(f"{k} {v:.{digits}g}" for k, v in now.items())
    keep = " ".join(f"data.sources.{i}.weight={float(v)!r}" for i, v in enumerate(saved.values()))
    log_once(
        log, logging.WARNING,
        "the checkpoint drew its batches with the mixture shares (%s), and this run's data.sources weights give (%s): "
        "from here on each source's share of the batches is another one, so the run is not the interrupted one's "
        "continuation (%s continues it)", old, new, keep)
