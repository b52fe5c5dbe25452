"""What a source's train/val split holds that ``data.val_fraction`` does not say, warned about at every load of its
token cache (a reused cache too): a split by token offset, which cuts a document in two, and a split by document that
held out far more of the text than ``val_fraction``, because whole documents go to val and one large file can be
most of a corpus."""

from __future__ import annotations

import logging
from pathlib import Path

from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.corpus")  # the token cache's logger


def held_out_share_limit(val_fraction: float) -> float:
    """The share of a source's tokens in val above which its by-document split is warned about: twice
    ``val_fraction``, and at least ``val_fraction + 0.1`` (one file of a few dozen is some percent by chance)."""
    return max(2 * val_fraction, val_fraction + 0.1)


def warn_about_split(name: str, meta: dict, val_fraction: float, min_tokens: int,
                     held_out: list[tuple[Path, int]]) -> None:
    """Warn when the split in ``meta`` (a token cache's) is not the by-document split of about ``val_fraction`` of the
    text that the config asks for. ``held_out``: the (file, size in bytes) of the documents whose content hash put
    them in val."""
    n_train, n_val = int(meta["train_tokens"]), int(meta["val_tokens"])
    if meta.get("split") == "by_tokens_tail":
        # the side the by-document split left under one window; it advised a larger val_fraction for a short train
        # side too (data.val_fraction=0.99, every document held out). A cache built before it was recorded: neither
        short = meta.get("short_side")
        fix = {"val": "more or larger files, or a larger data.val_fraction, give",
               "train": "more or larger files, or a smaller data.val_fraction, give"}.get(short,
                                                                                        "more or larger files give")
        if int(meta.get("documents", 0)) == 1:  # each val_fraction it advised sent the one file to the other side
            fix = "one file is never split by document, whatever data.val_fraction: more files give"
        log_once(
            log, logging.WARNING,
            "data source %r: too few documents for a by-document val split (val_fraction=%s, windows of %d "
            "tokens), so val is the last %d tokens of the stream: that cuts a document in two, and its start "
            "is trained on (%s a clean split)",
            name, val_fraction, min_tokens, n_val, fix)
        return
    share = n_val / max(n_train + n_val, 1)
    if share <= held_out_share_limit(val_fraction) or not held_out:
        return
    largest, size = max(held_out, key=lambda item: item[1])
    log_once(
        log, logging.WARNING,
        "data source %r: data.val_fraction=%s holds out whole documents (chosen by a hash of their bytes), and the %d "
        "held out are %.1f%% of its tokens (%d of %d): training keeps %.1f%%; the largest held out is %s (%d bytes). "
        "Split large files into smaller ones for a split closer to data.val_fraction",
        name, val_fraction, len(held_out), 100 * share, n_val, n_train + n_val, 100 * (1 - share),
        str(largest), size,
    )
