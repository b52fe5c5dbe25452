"""Why a token cache could not be written under its cache dir, and what to do about it, for the error line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from lit_dtrain.data._path_problems import unreachable_reason
from lit_dtrain.data.cache_pruning import cache_source_name


def why_unwritable(error: OSError, cache_dir: Path) -> tuple[str, str]:
    """``(reason, fix)`` for ``error``, raised writing a token cache under ``cache_dir``: a file or a symbolic link that
    leads nowhere (an unmounted scratch disk) in the way names that path; a full disk and a read-only dir say so.
    A broken link in the way was "File exists; free space there", and any other error (a loop of links) advised
    freeing space too."""
    reason = error.strerror or str(error)
    if error.errno is None:  # numpy's tofile reports a short write as "N requested and M written"
        return reason + " (is the disk full?)", "free space there"
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return reason, "make it writable"
    if (in_the_way := path_in_the_way(cache_dir)) is not None:  # was "File exists; free space there"
        return in_the_way
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return reason, "free space there"
    return reason, "fix that"


def path_in_the_way(cache_dir: Path) -> tuple[str, str] | None:
    """``(reason, fix)`` where ``cache_dir`` or a dir above it is a file or a symbolic link that leads nowhere (an
    unmounted scratch disk), so that no token cache can be read or written there; else None."""
    for path in (cache_dir, *cache_dir.parents):
        if os.path.islink(path) and not os.path.exists(path):
            why = unreachable_reason(path)
            return f"{str(path)!r} {why}", "mount or create its target" if "broken" in why else "fix the link"
        if path.exists() and not path.is_dir():
            return f"{str(path)!r} is a file, not a directory", "move it away"
    return None


def unwritable_reason(cache_dir: Path) -> str | None:
    """Why no token cache can be written in ``cache_dir``, or below the dir above it that exists where it does not yet
    (``os.access``, which a read-only file system fails for root too): ``'Read-only file system'``, ``'Permission
    denied'`` or ``"'<dir above>' cannot be written to (...)"``; None where it can."""
    existing = next((p for p in (cache_dir, *cache_dir.parents) if os.path.isdir(p)), None)
    if existing is None or os.access(existing, os.W_OK | os.X_OK):
        return None
    read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
    why = "Read-only file system" if read_only else "Permission denied"
    return why if existing == cache_dir else f"{str(existing)!r} cannot be written to: {why}"


def holds_a_cache_of(cache_dir: Path, source_name: str) -> bool:
    """Whether ``cache_dir`` holds a token cache named for ``source_name`` (``<name>-<key>``; the key hashes the corpus,
    so which one is known only when it is read). The name is matched whole: a prefix let source ``text`` past on a
    cache of source ``text-2`` (or any ``text-...`` entry), to ``prepare_data``'s refusal after the seed."""
    try:
        return any(cache_source_name(entry.name) == source_name for entry in os.scandir(cache_dir))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # not listable (search permission alone): its caches may still serve
        return True
