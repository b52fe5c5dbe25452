"""Why a path of a corpus or of the token cache cannot be read: a link that leads nowhere, a directory that cannot be
listed, a pipe or device in place of a file. Each answer completes an error line that names the path."""

from __future__ import annotations

import errno
import glob
import os
import stat
from pathlib import Path


def unreachable_reason(path: str | os.PathLike, _depth: int = 0) -> str:
    """Why ``path``, neither a file nor a directory to ``os.path``, cannot be read, for ``f"path {path!r} {reason}"``:
    a broken symbolic link (an unmounted disk, a moved corpus), a loop of links, a directory that cannot be searched
    or a file given as a directory; each was "does not exist", while ``ls`` listed the link or the file."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ENOENT and os.path.islink(path):
            hops, end = _hops(path)
            # the chain's last target behind a link on its way (scratch -> mnt/data, mnt -> /unmounted): named
            why = unreachable_reason(end, _depth + 1) if _depth < 8 else "does not exist"
            return f"is a broken symbolic link (to {hops}, which {why})"
        if e.errno == errno.ELOOP:
            return "cannot be reached: its symbolic links form a loop" + (
                f" ({path} -> {os.readlink(path)} -> ...)" if os.path.islink(path) else "")
        if e.errno != errno.ENOENT:  # Permission denied (a directory on the way), Not a directory ('file.txt/')
            return f"cannot be reached: {e.strerror or e}"
        # a link on the way that leads nowhere (/scratch -> an unmounted disk, for /scratch/corpus): "does not exist"
        broken = next((p for p in Path(path).parents if os.path.islink(p) and not os.path.exists(p)), None)
        if broken is not None:
            return f"cannot be reached: {str(broken)!r} {unreachable_reason(broken, _depth + 1)}"
    return "does not exist"


def missing_path_reason(raw: str | os.PathLike) -> str | None:
    """Why ``raw``, a path of a ``files`` corpus source, names nothing to read (``"does not exist"``, or
    :func:`unreachable_reason`'s reason), or None: it exists, or it is a glob (matched when the corpus is read). A path
    that exists is that file or directory, even when its name holds ``[``, ``*`` or ``?`` ("notes [v2].txt")."""
    path = os.path.expanduser(str(raw))
    if glob.has_magic(path) and not os.path.lexists(path) or os.path.exists(path):
        return None
    return unreachable_reason(path)


def _hops(link: str | os.PathLike) -> tuple[str, str]:
    """The targets of the chain of links from ``link`` to the path that does not exist: ``'b' -> '/nowhere'`` for
    a -> b -> /nowhere ("to 'b', which does not exist" named a link that ``ls`` lists), and that path."""
    hops, here = [os.readlink(link)], os.fspath(link)
    while len(hops) < 40:  # (the kernel's own limit; a loop is ELOOP, not here)
        here = os.path.join(os.path.dirname(here), hops[-1])
        if not os.path.islink(here):
            break
        hops.append(os.readlink(here))
    return " -> ".join(repr(h) for h in hops), here


def unlistable(directory: str) -> str | None:
    """Why ``directory`` cannot be listed (``Permission denied``: another user's 0700 dir), or None when it can or
    is no directory. Reads one entry, not the whole listing."""
    try:
        with os.scandir(directory) as entries:
            entry = next(entries, None)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return e.strerror or str(e)
    return unenterable(directory, entry)


def unenterable(directory: str | os.PathLike, entry: os.PathLike | None = None) -> str | None:
    """Why ``directory``, which can be listed, cannot be entered (read but no search permission: ``chmod -R 644``
    took the x off the dirs), else None; ``entry``: one of its entries, if listed already. Its names were listed, and
    the first stat of one was a ``PermissionError`` traceback (a directory source, a glob, a directory below)."""
    if entry is None:
        try:
            with os.scandir(directory) as entries:
                entry = next(entries, None)
        except OSError:
            return None
    if entry is None:  # (an empty directory: nothing to enter for)
        return None
    try:
        os.lstat(entry)  # needs search permission on the directory, not on the entry (not followed)
    except PermissionError as e:
        return f"{e.strerror} (it has read but no search (x) permission: chmod +x it)"
    except OSError:
        return None
    return None


def special_file_kind(path: str) -> str | None:
    """What ``path`` is when it exists but is no regular file or directory (a pipe, a device, a socket), else None."""
    mode = os.stat(path).st_mode
    for test, kind in (
        (stat.S_ISFIFO, "a pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None
