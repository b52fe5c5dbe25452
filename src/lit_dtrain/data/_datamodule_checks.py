"""The checks ``LMDataModule`` runs on its sources as it builds them: a ``data.sources`` entry of the config, and (under
several ranks) that every rank read the same data."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from lit_dtrain.data._path_problems import missing_path_reason
from lit_dtrain.data._unwritable import path_in_the_way
from lit_dtrain.data.corpus import CorpusError, CorpusSource, check_source_name, default_source_name
from lit_dtrain.data.windows import _cache_key


def source_from_config(index: int, entry) -> CorpusSource:
    """``data.sources.<index>`` (a dict) as a :class:`CorpusSource`; its errors name the key, which
    CorpusSource itself cannot (it does not know its index)."""
    fields = [f.name for f in dataclasses.fields(CorpusSource)]
    if not isinstance(entry, Mapping):  # data.sources=[foo]: dict('foo') failed with a bare ValueError
        raise CorpusError(
            f"data.sources.{index} must be a mapping of a source's keys ({', '.join(fields)}), got {entry!r} "
            f"({type(entry).__name__})"
        )
    entry = dict(entry)
    unknown = [key for key in entry if key not in fields]
    if unknown:
        raise CorpusError(f"data.sources.{index} has an unknown key {unknown[0]!r} (keys: {', '.join(fields)})")
    name = entry.get("name")
    if name is None:
        name = default_source_name(entry.get("kind", CorpusSource.kind), entry.get("paths", []))
    name = check_source_name(name, f"data.sources.{index}.name")
    try:
        return CorpusSource(**entry)
    except CorpusError as e:
        message = str(e).replace(f"data source {name!r}", f"data.sources.{index} (data source {name!r})", 1)
        raise CorpusError(message.replace("data.sources.N.", f"data.sources.{index}.")) from None


def check_source_paths(datamodule) -> None:
    """Before the seed (``check_config``, which builds the datamodule once): a path of a ``files`` source that does
    not exist, and a token cache dir below a file or a link that leads nowhere, which no run can read or write. Both
    were refused in ``prepare_data``, after 'Seed set to ...', with the run dir's ``config_resolved.yaml`` written (and
    the whole corpus read first, for the cache dir). Globs are matched, and a cache dir that cannot be written to is
    refused, where the corpus is read: another user's cache dir is read-only, and its caches serve."""
    for index, source in enumerate(datamodule.sources):
        for raw in source.paths if source.kind == "files" else ():
            if (why := missing_path_reason(raw)) is not None:
                raise CorpusError(f"data.sources.{index} (data source {source.name!r}): path {raw!r} {why}")
    cache_dir = Path(os.path.expanduser(str(datamodule.cache_dir)))
    if (in_the_way := path_in_the_way(cache_dir)) is not None:
        reason, fix = in_the_way
        raise CorpusError(f"data.cache_dir={str(cache_dir)!r} cannot hold token caches: {reason}; {fix} or point "
                          "LIT_DTRAIN_CACHE (paths.cache_dir) elsewhere")


def check_every_rank_read_the_same_data(datamodule) -> None:
    """Under a Trainer of several ranks, refuse to train when the ranks read different data: each one reads the
    corpus itself (the token cache's key hashes the files' bytes), so another Python's standard library on
    another node, a corpus copy that differs, or a file edited while the ranks started gave each rank other
    windows under the same indices, and the run trained on a mix without a word. One all-gather of the
    sources' cache keys and sizes, in ``setup``, which Lightning calls on every rank."""
    trainer = datamodule.trainer
    if trainer is None or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return
    mine = (socket.gethostname(), [(s.name, _cache_key(s), len(s.train), len(s.val)) for s in datamodule.splits])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [rank for rank, (_, data) in enumerate(every) if data != every[0][1]]
    if differ:
        rank = differ[0]
        (host0, data0), (host, data) = every[0], every[rank]
        source, key0, key = next((a[0], a[1:], b[1:]) for a, b in zip(data0, data) if a != b)
        raise CorpusError(
            f"the ranks read different data: rank {rank} (host {host}) and rank 0 (host {host0}) have other token "
            f"caches of data source {source!r} ((key, train tokens, val tokens) {tuple(key)} vs {tuple(key0)}; "
            f"{len(differ)} rank(s) differ from rank 0): give every rank the same corpus files and data settings "
            "(the default corpus is the running Python's standard library, which differs between Python versions)"
        )
