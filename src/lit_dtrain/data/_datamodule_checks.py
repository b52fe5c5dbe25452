"""The checks ``LMDataModule`` runs on its sources as it builds them: a ``data.sources`` entry of the config, and (under
several ranks) that every rank read the same data."""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from lit_dtrain.data._path_problems import missing_path_reason
from lit_dtrain.data._unwritable import holds_a_cache_of, path_in_the_way, unwritable_reason
from lit_dtrain.data.corpus import CorpusError, CorpusSource, check_source_name, default_source_name, resolve_files
from lit_dtrain.data.walking import iter_glob
from lit_dtrain.data.windows import _cache_key
from lit_dtrain.utils.job_log import no_log_records


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
    the whole corpus read first, for the cache dir); so were a glob that matches no file and a cache dir that cannot
    be written to and holds no cache of a source (a read-only tmpfs, another user's dir). One that cannot be written
    to but holds caches of every source is left to ``prepare_data``: another user's read-only cache dir serves its
    caches, and which one a run needs is known only once the corpus is hashed."""
    for index, source in enumerate(datamodule.sources):
        for raw in source.paths if source.kind == "files" else ():
            if (why := missing_path_reason(raw)) is not None:
                raise CorpusError(f"data.sources.{index} (data source {source.name!r}): path {raw!r} {why}")
            _check_glob_matches_a_file(index, source, raw)
    cache_dir = Path(os.path.expanduser(str(datamodule.cache_dir)))
    if (in_the_way := path_in_the_way(cache_dir)) is not None:
        reason, fix = in_the_way
        raise CorpusError(f"data.cache_dir={str(cache_dir)!r} cannot hold token caches: {reason}; {fix} or point "
                          "LIT_DTRAIN_CACHE (paths.cache_dir) elsewhere")
    if (why := unwritable_reason(cache_dir)) is not None:
        for source in datamodule.sources:
            if not holds_a_cache_of(cache_dir, source.name):
                raise CorpusError(f"data.cache_dir={str(cache_dir)!r} holds no token cache of data source "
                                  f"{source.name!r} and cannot be written to ({why}); make it writable or point "
                                  "LIT_DTRAIN_CACHE (paths.cache_dir) elsewhere")


def _check_glob_matches_a_file(index: int, source: CorpusSource, raw) -> None:
    """A glob of ``data.sources.<index>.paths`` that matches no file, refused with ``resolve_files``'s own line (its
    hints: a ``[`` in a name, braces, a directory it cannot list, directories matched without their files). Listing
    the matches is cheap, reading them is not: a glob was refused in ``prepare_data``, after the seed."""
    path = os.path.expanduser(str(raw))
    if not glob.has_magic(path) or os.path.lexists(path):  # (a path that exists is that file or directory)
        return
    with no_log_records():  # a walk's warnings (a dir it cannot list) are the run's to give, once
        if any(os.path.isfile(hit) for hit in iter_glob(path)):  # to the first file
            return
        try:
            resolve_files(dataclasses.replace(source, paths=[raw]))
        except CorpusError as e:
            message = str(e).replace(f"data source {source.name!r}", f"data.sources.{index} (data source "
                                     f"{source.name!r})", 1)
            raise CorpusError(message) from None


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
