"""Walking a corpus directory tree: every directory below a root once (symlinked ones too, a link back up the tree
being no loop), the files below it that match a pattern, and globs with ``**`` walked the same way."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from lit_dtrain.data._path_problems import unenterable
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.corpus")  # the corpus' logger, where this code was


def _dirs_below(root: Path, dot_dirs: list[Path] | None = None) -> Iterator[Path]:
    """``root`` and every directory below it, in sorted order, each real directory once (the first spelling that
    reaches it), symlinked directories entered too. With ``dot_dirs``, those below ``root`` whose name starts with
    '.' are not entered but appended to it. An unreadable directory is warned about and not entered."""
    entered, stack = set(), [root]
    while stack:
        directory = stack.pop()
        real = os.path.realpath(directory)
        if real in entered:
            continue
        entered.add(real)
        try:
            names = list(directory.iterdir())
        except OSError as e:  # unreadable directory: as rglob, which skips it (its files were never read); told by
            # rank 0 alone: every rank walks the same corpus (a 2-rank run printed it twice)
            yield directory  # (its glob finds nothing)
            log_once(log, logging.WARNING, "cannot list %s (%s): its files are left out", directory, e.strerror or e)
            continue
        if names and (why := unenterable(directory, names[0])) is not None:  # each stat: a PermissionError traceback
            log_once(log, logging.WARNING, "cannot enter %s (%s): its files are left out", directory, why)
            continue
        yield directory
        below = []
        for p in names:
            try:
                if p.is_dir():
                    below.append(p)
            except OSError as e:  # a link to a place it may not reach: that entry alone (it left out every sibling
                # dir, with a warning that the directory's files, which were kept, were left out); file or dir alike
                log_once(log, logging.WARNING, "cannot reach %s (%s): it is left out", p, e.strerror or e)
        below.sort(reverse=True)
        if dot_dirs is not None:
            dot_dirs.extend(p for p in below if p.name.startswith("."))
            below = [p for p in below if not p.name.startswith(".")]
        stack.extend(below)


def _files_below(root: Path, pattern: str, dangling: list[Path] | None = None,
                 dot_dirs: list[Path] | None = None) -> list[Path]:
    """The files matching ``pattern`` in ``root`` and every directory below it, as ``root.rglob(pattern)`` finds
    them, except that symlinked directories are entered too (rglob leaves them out, so a corpus dir assembled
    from links lost their files without a word). Each real directory is entered once: a link back up the tree
    is no loop. Matching symlinks whose target is missing are appended to ``dangling``. With ``dot_dirs``, the
    directories below ``root`` whose name starts with '.' are not entered but appended to it: a directory source
    leaves their files out, and listing a project's ``.venv`` and ``.git`` (60k files) took 1-2 s of every start."""
    while pattern.startswith("**/"):  # rglob(p) is glob("**/" + p): per directory, the rest of it
        pattern = pattern[3:]
    files = []
    for directory in _dirs_below(root, dot_dirs):
        for p in directory.glob(pattern):
            if unfollowable(p) is not None:  # _dirs_below named it, left out (it was then refused as a file)
                continue
            if p.is_file():
                files.append(p)
            elif dangling is not None and p.is_symlink() and not p.exists():
                dangling.append(p)
    return files


def unfollowable(path: Path) -> str | None:
    """Why ``path``, a symbolic link, cannot be followed to see what it is (``Permission denied``: its target is in
    a directory this user may not search), else None. A corpus walk leaves such a link out with a warning, as it does
    a link whose target is missing and a directory it cannot list: file or directory, its kind is unknown."""
    try:
        path.is_dir()  # (False, not an error, for a missing target or a loop of links: the dangling links' warning)
    except OSError as e:  # (not a link, or one in a dir it may not enter: the caller's own stat names that dir)
        return e.strerror or str(e) if os.path.islink(path) else None
    return None


def walk_glob(pattern: str) -> list[str]:
    """``glob.glob(pattern, recursive=True)``, except that a ``**`` walks the directories below it as
    :func:`_dirs_below` does (dot dirs left out, as glob leaves them out): glob follows symlinked directories
    without end, so a corpus dir with two links back up the tree (``a -> .``, ``b -> .``) made ``dir/**/*.txt``
    list 2^40 paths, a run that hung without a word (one link: each file 41 times)."""
    return list(iter_glob(pattern))


def iter_glob(pattern: str) -> Iterator[str]:
    """:func:`walk_glob`'s paths, one at a time, as it walks: a check whether a glob matches a file stops at the
    first (it listed the whole tree, which ``prepare_data`` lists again: 3.9 s for a ``**`` glob of 9k files)."""
    parts = pattern.split("/")
    if "**" not in parts:
        yield from glob.iglob(pattern)
        return
    at = parts.index("**")
    head = ("/".join(parts[:at]) or "/") if at else "."  # "/**/x": the root dir; "**/x": the working dir
    rest = "/".join(parts[at + 1 :])
    bases = glob.glob(head) if glob.has_magic(head) else [head]
    for base in (b for b in bases if os.path.isdir(b)):
        for directory in _dirs_below(Path(base), []):
            d = os.fspath(directory)  # relative under ".", as glob's
            if rest:
                yield from iter_glob(os.path.join(glob.escape(d), rest))
            else:  # "dir/**": every file and directory below ("**": not "." itself); "dir/**/": the directories
                yield from [d] if d != "." else []
                if not pattern.endswith("/"):
                    yield from (os.path.join(d, n) for n in os.listdir(d) if not n.startswith(".")
                                and os.path.isfile(os.path.join(d, n)))


def without_unfollowable_links(hits: list[Path], walked: bool) -> list[Path]:
    """The glob's ``hits`` without the links it cannot follow (:func:`unfollowable`), each left out with the warning
    a ``**`` walk gives (``walked``: it gave it already): a ``**`` glob warned that it left such a link out, then
    refused the run naming it as a file it matched, while a link to a directory was left out."""
    kept = []
    for p in hits:
        if (why := unfollowable(p)) is None:
            kept.append(p)
        elif not walked:
            log_once(log, logging.WARNING, "cannot reach %s (%s): it is left out", p, why)
    return kept
