"""How many token caches a cache dir keeps: each load marks its cache as used (its dir's mtime) and holds a shared
lock on it while it is in use; then the caches of the same source name beyond the ``keep`` most recently used are
removed, except those that another process holds (a run training on it, a build that just finished).

Each edit of a corpus gives it a new cache (about twice the corpus' size, the key hashes every byte), and nothing
removed the old ones: ten edits of a 5 GB corpus left 100 GB under the cache dir. Caches are counted per source
name and corpus (its ``paths`` and ``pattern``, recorded as ``corpus`` in ``meta.json``), so the caches of other
corpora (a mixture's other sources, another project's, also one with the same source name: ``data=textfiles`` names
every corpus ``text``) never push each other out; a cache built before the corpus was recorded counts as the same
corpus. A sweep over ``data.block_size`` or ``data.val_fraction`` makes one cache per value, which ``keep`` should
cover. A corpus given other ``paths`` (moved) counts as another: its old caches stay until removed by hand.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
import weakref
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("lit_dtrain.data.corpus")  # the token cache's logger

_CACHE_DIR = re.compile(r"(?P<name>\w[\w.+-]*)-[0-9a-f]{24}")  # <source name>-<key>: a built cache's dir


class CacheHold:
    """A shared ``flock`` on a cache dir, held while this object lives (a :class:`TokenSplits` keeps it): a pruner
    in another process takes an exclusive one first, so it never removes a cache in use. On a file system without
    locks the hold is empty (and a pruner, unable to lock either, removes nothing)."""

    def __init__(self, fd: int | None) -> None:
        self._finalizer = weakref.finalize(self, os.close, fd) if fd is not None else None

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __reduce__(self):  # a copy (pickled to a spawned process, deepcopied) holds nothing: the lock is this one's
        return CacheHold, (None,)


def hold_cache(out_dir: Path) -> CacheHold | None:
    """Hold the built cache in ``out_dir`` and mark it used now; None when it is gone (another process pruned or
    discarded it between its check and this lock: the caller builds it again)."""
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    hold = CacheHold(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a pruner moves it aside
    except OSError:  # no locks here (some network file systems): nothing to protect it with
        pass
    try:
        here, held = os.stat(out_dir), os.fstat(fd)
        same = (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino) and (out_dir / "meta.json").exists()
    except OSError:
        same = False
    if not same:  # moved aside while this process waited for the lock
        hold.release()
        return None
    try:
        os.utime(out_dir)  # the last use, which pruning orders by
    except OSError:  # a shared cache dir of another user: its order stays that of its last writer
        pass
    return hold


def discard_if_damaged(out_dir: Path, problem_of: Callable[[Path], str | None],
                       discard: Callable[[Path], None]) -> str | None:
    """What is wrong with the cache in ``out_dir`` (``problem_of``), which is then moved aside (``discard``); None
    where it is intact or gone. The dir is opened before it is checked and locked before it is moved, exclusively as a
    pruner locks it (shared where a run holds it: a cache damaged under a run is moved aside as before, the run keeps
    its mapped pages), and only the dir checked is moved. Two processes that found one damaged cache at once each
    moved aside whatever was there: the later one moved the earlier one's rebuild, held and in use (the second paused
    between its check and its move: two rebuilds, the first one's cache deleted under it)."""
    for _ in range(3):  # again when another process's rebuild replaced the dir checked
        try:
            fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # gone, or not a dir (a file, a dead link: no lock to take, moved aside as it is)
            problem = problem_of(out_dir) if os.path.lexists(out_dir) else None
            if problem is not None:
                discard(out_dir)
            return problem
        try:
            if (problem := problem_of(out_dir)) is None:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a run holds it, or another process moves it aside now: wait for that one
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError:  # no locks on this file system: the dir's identity alone is checked
                pass
            try:
                here, held = os.stat(out_dir), os.fstat(fd)
            except OSError:  # moved aside by another process meanwhile
                continue
            if (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
                discard(out_dir)
                return problem
        finally:
            os.close(fd)
    return None


def _size(path: Path) -> int:
    total = 0
    for child in path.iterdir():
        try:
            total += child.lstat().st_size
        except OSError:
            pass
    return total


def _corpus_of(path: Path) -> str | None:
    """The ``corpus`` recorded in the ``meta.json`` of the cache in ``path`` (None: none recorded, or unreadable)."""
    try:
        corpus = json.loads((path / "meta.json").read_text()).get("corpus")
    except (OSError, ValueError, AttributeError):
        return None
    return corpus if isinstance(corpus, str) else None


def cache_source_name(dir_name: str) -> str | None:
    """The source name of a built token cache's dir, ``<source name>-<24 hex digits of key>``; None for any other
    name (a name is matched whole: source ``text``'s caches are not ``text-2``'s)."""
    match = _CACHE_DIR.fullmatch(dir_name)
    return match["name"] if match else None


def prune_caches(
    out_dir: Path, name: str, keep: int, discard: Callable[[Path], None], corpus: str | None = None
) -> None:
    """Remove the caches of source ``name`` and ``corpus`` beside ``out_dir`` (the one this process just loaded, always
    kept) that are not among the ``keep`` most recently used and that no live process holds; ``discard`` moves one
    aside atomically and deletes it. A cache that records another corpus is not counted (one that records none is).
    Logs what was removed, and what was left because it is in use."""
    others = []
    try:
        for path in out_dir.parent.iterdir():
            # a dir of that name without meta.json is no cache (a build renames its temp dir with meta.json inside):
            # a user's dir text-<24 hex digits> holding files of one's own was deleted as a cache of source 'text'
            if (cache_source_name(path.name) == name and path.name != out_dir.name and not path.is_symlink()
                    and (path / "meta.json").is_file() and _corpus_of(path) in (None, corpus)):
                try:
                    others.append((path.stat().st_mtime, path))
                except OSError:
                    continue
    except OSError:
        return
    others.sort(reverse=True)
    removed, freed, in_use, unlockable = [], 0, [], []
    for mtime, path in others[max(keep - 1, 0) :]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # removed meanwhile, or not a directory
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by a live process
                in_use.append(path.name)
                continue
            except OSError as e:  # no locks on this file system (NFS: EBADF): whether it is in use cannot be told
                unlockable.append(f"{path.name} ({e.strerror or e})")
                continue
            size = _size(path)
            discard(path)
            if not os.path.lexists(path):
                used = time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime))
                removed.append(f"{path.name} ({size / 1e6:.1f} MB, last used {used})")
                freed += size
        finally:
            os.close(fd)
    if removed:
        log.info(
            "token caches of data source %r: removed %d not among the %d most recently used (data.cache_keep), "
            "freeing %.1f MB: %s", name, len(removed), keep, freed / 1e6, ", ".join(removed),
        )
    if in_use:
        log.info("token caches of data source %r: kept %d in use by another process beyond data.cache_keep=%d: %s",
                 name, len(in_use), keep, ", ".join(in_use))
    if unlockable:
        log.info("token caches of data source %r: kept %d beyond data.cache_keep=%d, which cannot be locked here to "
                 "tell whether a process uses them: %s", name, len(unlockable), keep, ", ".join(unlockable))
