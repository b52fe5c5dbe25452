"""Corpus sources -> memory-mapped token cache, with a deterministic train/val split by document.

Tokenization runs once: the token streams are written under ``cache_dir/<key>/`` where ``key`` hashes
the tokenizer, the split settings and every document's bytes. A changed corpus gets a new key (and is
rebuilt); an unchanged one is reused, once its files' sizes and CRC-32s match those in its ``meta.json``
(a damaged cache is rebuilt). Writes are atomic (temporary directory + rename), so an
interrupted build never leaves a half-written cache behind; a build stopped by SIGTERM or SIGHUP removes its temp
dir (:mod:`~lit_dtrain.data.build_signals`), and the temp dir of a killed build is removed by a
later build (see :func:`_remove_stale_temp_dirs`). A loaded cache is held (a shared lock) while it is in use, and a
source name's caches beyond its ``keep`` most recently used are removed (:mod:`~lit_dtrain.data.cache_pruning`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from lit_dtrain.data._split_tail import _split_tail
from lit_dtrain.data._unwritable import why_unwritable
from lit_dtrain.data.build_signals import unwound_by_stop_signals
from lit_dtrain.data.cache_integrity import cache_problem, crc32s, with_crc32s
from lit_dtrain.data.cache_pruning import CacheHold, discard_if_damaged, hold_cache, prune_caches
from lit_dtrain.data.corpus import CorpusError, CorpusSource, leave_out_dirs, resolve_files
from lit_dtrain.data.reading import _chunks, _hash_file, _not_utf8_at, wide_encoding
from lit_dtrain.data.split_report import warn_about_split
from lit_dtrain.data.tokenizer import ByteTokenizer, as_token_ids, eos_token
from lit_dtrain.utils.atomic import pid_alive
from lit_dtrain.utils.rank_zero import log_once

# the logger of lit_dtrain.data.corpus, where this code was: log records keep their name (and logging configs theirs)
log = logging.getLogger("lit_dtrain.data.corpus")

CACHE_FORMAT = 1  # bump when the cache layout changes
# A build holds its temp dir only while it writes and fsyncs the token files (seconds); one older than this,
# whose builder cannot be checked (another host, or a name from before the builder was recorded), is stale.
STALE_TEMP_SECONDS = 24 * 3600
# A temp dir whose builder's pid is gone from this host is stale once it is this old too: a builder in another
# pid namespace under the same host name (containers with --uts=host) looks dead from here, but writing its
# token files keeps changing the dir's files (a killed build's stop changing at once).
STALE_DEAD_OWNER_SECONDS = 600


@dataclass
class TokenSplits:
    """Train and val token streams (uint16 memmaps) of one source, plus what built them."""

    name: str
    train: np.ndarray
    val: np.ndarray
    meta: dict
    hold: CacheHold | None = field(default=None, repr=False, compare=False)  # the cache is in use while this lives


def corpus_id(source: CorpusSource) -> str:
    """Which corpus ``source`` is, apart from its content: a hash of its kind, absolute ``paths`` and ``pattern`` (the
    stdlib's: the running Python's stdlib dir), the ``corpus`` of its caches' ``meta.json``. Edits keep it; caches
    are pruned per source name and corpus."""
    paths = [sysconfig.get_paths()["stdlib"]] if source.kind == "stdlib" else source.paths
    spec = [source.kind, source.pattern, *sorted(os.path.abspath(os.path.expanduser(p)) for p in paths)]
    return hashlib.sha256("\0".join(spec).encode()).hexdigest()[:16]


def _is_val_doc(content_digest: bytes, val_fraction: float) -> bool:
    return int.from_bytes(content_digest[:8], "little") % 1_000_000 < val_fraction * 1_000_000


def build_token_cache(
    source: CorpusSource,
    cache_dir: str | os.PathLike,
    min_tokens: int,
    val_fraction: float = 0.01,
    tokenizer: ByteTokenizer | None = None,
    progress: bool = True,
    keep: int | None = None,
    exclude_dirs: Sequence[str | os.PathLike] = (),
    files: list[Path] | None = None,
) -> TokenSplits:
    """Tokenize ``source`` into ``cache_dir`` (or reuse a cache with the same content key).

    ``min_tokens`` is one training window (``block_size + 1``): each split must hold at least that.
    Documents go to val when a hash of their bytes falls under ``val_fraction``; if that leaves val (or
    train) too short, the tail of the token stream is used for val instead, so tiny corpora still work.
    ``keep``: the caches of this source's name kept in ``cache_dir`` (the most recently used; those another
    process holds too), None for all (see :mod:`~lit_dtrain.data.cache_pruning`). Files under ``cache_dir`` or
    ``exclude_dirs`` (the run outputs) are never read as corpus text. ``files``: ``resolve_files(source)``, when
    the caller has listed them already.
    """
    tokenizer = tokenizer or ByteTokenizer()
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    files = resolve_files(source) if files is None else files
    if source.kind == "files":
        never = {cache_dir: "token caches", **{d: "run outputs (data.exclude_dirs)" for d in exclude_dirs}}
        files = leave_out_dirs(source, files, never)
    # a tokenizer of one's own: its ids are cast to uint16 since 3c00409 (int64 ids were written as their bytes, each
    # id and three zeros), so its caches from before get another key and are rebuilt; ByteTokenizer's key is kept
    ids = "" if type(tokenizer) is ByteTokenizer else "|ids-as-uint16"
    key_hash = hashlib.sha256(f"{CACHE_FORMAT}|{tokenizer.name}{ids}|{val_fraction}|{min_tokens}".encode())
    docs: list[tuple[Path, bytes]] = []  # (file, sha256 of its bytes): the bytes are read again to tokenize
    sizes: dict[Path, int] = {}
    empty = 0
    total = _total_bytes(files)  # a bar of bytes: one huge file moves it too (one of files stood at 0/1)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"hashing corpus {source.name!r}", leave=False,
               disable=not progress or (len(files) < 50 and total < HASH_BAR_FROM_BYTES))
    binary: list[Path] = []
    wide: dict[str, list[Path]] = {}  # UTF-16/UTF-32 encoding -> its files
    not_utf8: list[tuple[Path, int, int]] = []  # (file, offset of its first byte that is not UTF-8, that byte)
    first_with: dict[bytes, Path] = {}  # content digest -> the first file with those bytes
    copies: list[tuple[Path, Path]] = []
    for path in files:
        digest, size, head, start = _hash_file(path, bar.update)
        if not size:
            empty += 1
            continue
        encoding = wide_encoding(head)
        if encoding is not None:
            wide.setdefault(encoding, []).append(path)
        elif b"\0" in head:
            binary.append(path)
        elif (bad := _not_utf8_at(head)) is not None:
            not_utf8.append((path, start + bad, head[bad]))  # an offset in the file, as `cmp`/`xxd` count
        if first_with.setdefault(digest, path) is not path:
            copies.append((path, first_with[digest]))
        key_hash.update(digest)
        docs.append((path, digest))
        sizes[path] = size
    bar.close()
    if not docs:
        raise CorpusError(
            f"data source {source.name!r} is empty: {len(files)} file(s), all empty (e.g. {str(files[0])!r})"
        )
    if empty:
        # the stdlib always holds empty files (__init__.py ...): expected, so not a warning on every run
        level = logging.INFO if source.kind == "stdlib" else logging.WARNING
        log_once(log, level, "data source %r: skipped %d empty file(s)", source.name, empty)
    if copies:  # kept: copies are the user's data; the by-content split holds them out together
        log_once(
            log, logging.INFO if source.kind == "stdlib" else logging.WARNING,
            "data source %r: %d file(s) have the same bytes as another file of the corpus, e.g. %s and %s; each "
            "copy is a document of its own (trained on as many times as it appears, held out together)",
            source.name,
            len(copies),
            str(copies[0][0]),
            str(copies[0][1]),
        )
    if binary:
        log_once(
            log, logging.WARNING,
            "data source %r: %d file(s) look binary (NUL bytes), e.g. %s; the byte tokenizer trains on "
            "them as they are (data.sources.N.pattern narrows a directory)", source.name, len(binary),
            str(binary[0]))
    for encoding, paths in wide.items():  # the tokenizer's contract: a file's bytes, as they are
        log_once(
            log, logging.WARNING,
            "data source %r: %d file(s) are %s text, e.g. %s; the byte tokenizer trains on their %s bytes as they are "
            "(a NUL byte beside each ASCII character), not on UTF-8 text: convert them first, e.g. "
            "iconv -f %s -t UTF-8 FILE > FILE.utf8",
            source.name,
            len(paths),
            encoding,
            str(paths[0]),
            encoding,
            encoding,
        )
    if not_utf8:  # Latin-1, cp1252 ...: the model would learn two encodings of each accented letter
        path, offset, byte = not_utf8[0]
        log_once(
            log, logging.INFO if source.kind == "stdlib" else logging.WARNING,
            "data source %r: %d file(s) are not UTF-8 text in their first 8 KiB, e.g. %s (byte 0x%02x at offset %d); "
            "the byte tokenizer trains on their bytes as they are: if they are Latin-1 or cp1252 text, convert them "
            "first, e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.utf8",
            source.name,
            len(not_utf8),
            str(path),
            byte,
            offset,
        )
    key = key_hash.hexdigest()[:24]
    out_dir = Path(cache_dir).expanduser() / f"{source.name}-{key}"
    _remove_stale_temp_dirs(out_dir.parent)
    for _ in range(3):  # again when another process prunes the cache between its check and the hold
        # a cache dir without meta.json is damaged too: a build renames its temp dir here with meta.json inside
        # truncated or damaged after it was built: never train on it (moved aside under its lock)
        if (problem := discard_if_damaged(out_dir, cache_problem, _discard)) is not None:
            if os.path.lexists(out_dir) and cache_problem(out_dir) is not None:  # not moved aside
                raise CorpusError(
                    f"the token cache {str(out_dir)!r} of data source {source.name!r} is damaged ({problem}) and "
                    f"cannot be moved aside to rebuild it (is {str(out_dir.parent)!r} read-only?): delete "
                    f"{str(out_dir)!r}, or point LIT_DTRAIN_CACHE (paths.cache_dir) at a writable directory"
                )
            log.warning("token cache %s is damaged (%s); rebuilding it", out_dir, problem)
        if not (out_dir / "meta.json").exists():
            _write_cache(out_dir, docs, tokenizer, val_fraction, min_tokens, source, progress)
        if (hold := hold_cache(out_dir)) is not None:  # in use: never pruned while this process holds it
            break
    else:
        raise CorpusError(f"the token cache {str(out_dir)!r} of data source {source.name!r} was removed by another "
                          "process each of the 3 times this one built it: is another run pruning its cache dir with "
                          "data.cache_keep that low?")
    meta = with_crc32s(out_dir, json.loads((out_dir / "meta.json").read_text()))
    train = np.memmap(out_dir / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(out_dir / "val.bin", dtype=np.uint16, mode="r")
    held_out = [(path, sizes[path]) for path, digest in docs if _is_val_doc(digest, val_fraction)]
    warn_about_split(source.name, meta, val_fraction, min_tokens, held_out)
    if keep is not None:
        prune_caches(out_dir, source.name, keep, _discard, corpus_id(source))
    return TokenSplits(source.name, train, val, meta, hold)


_TEMP_DIR = re.compile(r"\.\w[\w.+-]*-[0-9a-f]{24}\.(?P<suffix>[^.]+)")  # .<source name>-<key>.<suffix>
_OWNER = re.compile(r"build-(?P<host>[^-]+)-(?P<pid>\d+)-.*")


def _host() -> str:
    """This host's name without '.' or '-', so that it parses back out of a temp dir name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())


def _temp_tag() -> str:
    """``build-<host>-<pid>-``: names this process as the owner of a temp dir (see _remove_stale_temp_dirs)."""
    return f"build-{_host()}-{os.getpid()}-"


def _newest_mtime(path: Path) -> float:
    times = [path.lstat().st_mtime]
    for child in path.iterdir():
        times.append(child.lstat().st_mtime)
    return max(times)


def _remove_stale_temp_dirs(cache_dir: Path) -> None:
    """Remove the temp dirs (``.<cache name>.<suffix>``) of cache builds that were killed (SIGKILL, OOM, scancel:
    no ``finally`` ran), which would otherwise hold a copy of the token streams forever.

    Only names of that form count (other hidden entries are left alone). A temp dir is named
    ``.<cache name>.build-<host>-<pid>-<random>`` by its builder. It is stale when that
    builder is on this host, its process is gone and nothing in the dir changed for STALE_DEAD_OWNER_SECONDS
    (10 min); a temp dir whose builder cannot be checked (another host sharing the cache dir, or a name from
    before the owner was recorded) is stale once nothing in it changed for STALE_TEMP_SECONDS (a day). So the
    temp dir of a live concurrent builder is not removed (a recycled pid only keeps a dead builder's dir until
    it is a day old). A concurrent sweeper removing the same dir is harmless.
    """
    try:
        entries = [p for p in cache_dir.iterdir() if p.name.startswith(".") and p.is_dir() and not p.is_symlink()]
    except OSError:  # no cache dir yet, or unreadable: nothing to sweep (writing reports the real problem)
        return
    host, now = _host(), time.time()
    for path in entries:
        match = _TEMP_DIR.fullmatch(path.name)
        if match is None:  # not a token cache's temp dir (.snapshot, .git ...): not ours to remove
            continue
        owner = _OWNER.fullmatch(match["suffix"])
        owner_pid = int(owner["pid"]) if owner is not None and owner["host"] == host else None
        try:
            dead = owner_pid is not None and owner_pid != os.getpid() and not pid_alive(owner_pid)
            stale = now - _newest_mtime(path) > (STALE_DEAD_OWNER_SECONDS if dead else STALE_TEMP_SECONDS)
        except OSError:  # removed meanwhile by its builder or another sweeper
            continue
        if stale:
            log.info("removing %s: the temp dir of a token-cache build that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)


def _discard(out_dir: Path) -> None:
    """Move a damaged cache dir out of the way (atomically, so a concurrent reader never sees half of it)."""
    trash = out_dir.with_name(f".{out_dir.name}.{_temp_tag()}damaged")
    try:
        os.replace(out_dir, trash)
    except OSError:  # another process moved or rebuilt it first
        return
    shutil.rmtree(trash, ignore_errors=True)


def _write_cache(out_dir, docs, tokenizer, val_fraction, min_tokens, source, progress) -> None:
    def fill(tmp: Path) -> dict:
        return _tokenize_into(tmp, docs, tokenizer, val_fraction, min_tokens, source, progress)

    try:
        with unwound_by_stop_signals():  # SIGTERM/SIGHUP: the temp dir is removed before the process ends
            meta = _write_cache_files(out_dir, fill, tokenizer, source)
    except OSError as e:  # disk full, read-only or missing cache dir ...
        reason, fix = why_unwritable(e, out_dir.parent)
        raise CorpusError(
            f"cannot write the token cache of data source {source.name!r} under {str(out_dir.parent)!r}: {reason}; "
            f"{fix} or point LIT_DTRAIN_CACHE (paths.cache_dir) elsewhere"
        ) from e
    log.info("token cache %s: %s", out_dir, meta)


HASH_BAR_FROM_BYTES = 1 << 28  # a corpus of fewer than 50 files is hashed without a bar below this size (~0.2 s)


def _total_bytes(paths: list[Path]) -> int:
    """The size of ``paths`` together, for a progress bar (a file gone meanwhile is named when it is read)."""
    return sum(os.stat(path).st_size if os.path.isfile(path) else 0 for path in paths)


def _tokenize_into(tmp: Path, docs, tokenizer, val_fraction, min_tokens, source, progress) -> dict:
    """Tokenize ``docs`` into ``tmp/train.bin`` and ``tmp/val.bin``, one document in memory at a time (holding
    them all, then their tokens, then the concatenation took ~7x the corpus in RAM). Returns the meta fields."""
    n_train = n_val = 0
    eos = eos_token(tokenizer) if getattr(tokenizer, "bytewise", False) else None  # checked before any document
    total = _total_bytes([path for path, _ in docs])  # bytes: a bar of files stood at 0/1 for one huge file
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {source.name!r}", disable=not progress,
               leave=False)
    with bar, open(tmp / "train.bin", "wb") as train_file, open(tmp / "val.bin", "wb") as val_file:
        for path, digest in docs:
            held_out = _is_val_doc(digest, val_fraction)
            out, count, read_digest = (val_file if held_out else train_file), 0, hashlib.sha256()
            bom: list[int] = []  # a UTF-8 BOM's 3 bytes, left out of the text but in the bar's total
            if getattr(tokenizer, "bytewise", False):  # a chunk encodes as its part of the whole file does
                for chunk in _chunks(path, bom):
                    read_digest.update(chunk)
                    count += out.write(memoryview(as_token_ids(tokenizer.encode(chunk), tokenizer)))
                    bar.update(len(chunk))
                count += out.write(memoryview(eos))
            else:
                data = b"".join(_chunks(path, bom))
                read_digest.update(data)
                count += out.write(memoryview(as_token_ids(tokenizer.encode(data, add_eos=True), tokenizer)))
                bar.update(len(data))
                del data
            if bom:
                bar.update(sum(bom))
            if read_digest.digest() != digest:  # the cache key hashed other bytes
                raise CorpusError(
                    f"corpus file {str(path)!r} changed while the token cache of data source {source.name!r} was "
                    "built; run again once the corpus is not being written"
                )
            tokens = count // np.dtype(np.uint16).itemsize  # write() returns bytes
            if held_out:
                n_val += tokens
            else:
                n_train += tokens
    split, short = "by_document", {}
    if n_val < min_tokens or n_train < min_tokens:
        # Too few documents for a by-document split of this window size: split the stream instead.
        short = {"short_side": "val" if n_val < min_tokens else "train"}  # which fix the warning advises
        n_train, n_val = _split_tail(tmp, n_train, n_val, max(min_tokens, int((n_train + n_val) * val_fraction)))
        split = "by_tokens_tail"
    if n_train < min_tokens and n_train + n_val >= 2 * min_tokens:  # long enough: val_fraction holds out too much
        raise CorpusError(
            f"data source {source.name!r}: data.val_fraction={val_fraction} holds out {n_val} of its "
            f"{n_train + n_val} tokens for validation and leaves {n_train} to train on, less than one window of "
            f"block_size+1 = {min_tokens} tokens; lower data.val_fraction"
        )
    if n_train < min_tokens:
        raise CorpusError(
            f"data source {source.name!r} is too short: {n_train + n_val} tokens in {len(docs)} file(s) ("
            f"{'e.g. ' if len(docs) > 1 else ''}{str(docs[0][0])!r}), but train and val each need at least one window "
            f"of block_size+1 = {min_tokens} tokens, {2 * min_tokens} in all: add text or lower data.block_size"
        )
    return {"documents": len(docs), "split": split, **short, "train_tokens": n_train, "val_tokens": n_val}


def _write_cache_files(out_dir, fill, tokenizer, source) -> dict:
    """Create a temp dir beside ``out_dir``, have ``fill(tmp)`` write the token files into it (it returns the meta
    fields), fsync, rename; the temp dir never stays behind."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{_temp_tag()}", dir=out_dir.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would lock other users out of a shared cache
        meta = {"source": source.name, "corpus": corpus_id(source), "tokenizer": tokenizer.name, **fill(tmp)}
        meta["crc32"] = crc32s(tmp)  # checked at every load
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process won the race and built the same cache
            if not (out_dir / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta
