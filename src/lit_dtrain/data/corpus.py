"""Corpus sources and their files: which files a source reads, each once, in a fixed order.

A :class:`CorpusSource` is the running Python's standard library (``kind='stdlib'``) or files, directories and
globs (``kind='files'``); :func:`resolve_files` lists its files, sorted, each file once however many paths reach
it. Reading those files is :mod:`lit_dtrain.data.reading`; tokenizing them into the memory-mapped train/val
streams, cached by content, is :mod:`lit_dtrain.data.token_cache`, whose names are importable from here too.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lit_dtrain.data._path_problems import (
    missing_path_reason,
    special_file_kind,
    unenterable,
    unlistable,
    unreachable_reason,
)
from lit_dtrain.data.walking import _files_below, walk_glob, without_unfollowable_links
from lit_dtrain.utils.args import is_number, type_name
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger(__name__)  # also the token cache's: its modules log under this name


def _printable(arg):
    """``arg`` as a log record argument that any handler can write: a file name that is not UTF-8 (``caf\\xe9.txt``,
    a Latin-1 name) decodes to lone surrogates, which a UTF-8 stream refuses (``--- Logging error ---``, a traceback,
    and the warning lost); those bytes are written as ``\\xe9``."""
    text = os.fspath(arg) if isinstance(arg, os.PathLike) else arg
    if not isinstance(text, str):
        return arg
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:  # the bytes of the name, as `ls -b` shows them
            return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return arg


def _printable_args(record: logging.LogRecord) -> bool:
    if isinstance(record.args, tuple):
        record.args = tuple(_printable(arg) for arg in record.args)
    return True


log.addFilter(_printable_args)


class CorpusError(ValueError):
    """Bad corpus input: a missing path, an unreadable or empty corpus, too few tokens."""


_SOURCE_NAME = re.compile(r"\w[\w.+-]*")  # \w: any Unicode letter or digit, and '_'


def check_source_name(name, key: str = "data source name") -> str:
    """``name`` as a source name, or :class:`CorpusError` naming ``key``. A source name becomes the metric
    ``val/<name>/loss`` and the cache dir ``<name>-<key>``: a ``/`` would nest both one level deeper, a leading
    ``.`` hide the cache dir, a space or ``:`` trouble loggers and shells. An int (YAML ``name: 2024``) is its
    decimal string."""
    if is_number(name, integer=True):
        name = str(name)
    if not isinstance(name, str) or not _SOURCE_NAME.fullmatch(name):
        fixed = re.sub(r"[^\w.+-]", "_", str(name)).lstrip(".+-") or "source"
        raise CorpusError(
            f"{key}={name!r}: a source name must be letters, digits, '_', '.', '+' or '-', starting with a letter, "
            f"digit or '_' (it names the metric val/<name>/loss and the token cache dir); e.g. {fixed!r}"
        )
    return name


def default_source_name(kind: str, paths) -> str:
    """The name of a source given none: ``stdlib`` for the standard library (its token caches keep their dir names);
    for files, the last part of the first path before any glob (``~/corpus/*.txt`` -> ``corpus``, ``/data/prose`` ->
    ``prose``), made a valid name (``files`` where none comes out). Every unnamed source was ``stdlib``, so a mixture of
    the stdlib and an unnamed ``kind='files'`` source failed with "names must be unique"."""
    if kind != "files":
        return "stdlib"
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths if isinstance(paths, Sequence) else ():
        if not isinstance(path, (str, os.PathLike)):
            continue
        parts = Path(os.path.abspath(os.path.expanduser(os.fspath(path)))).parts
        plain = parts[: next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))]
        name = re.sub(r"[^\w.+-]", "_", plain[-1] if len(plain) > 1 else "").lstrip(".+-")
        if name:
            return name
    return "files"


@dataclass
class CorpusSource:
    """One corpus of a (possibly weighted) mixture.

    ``kind='stdlib'`` reads the ``.py`` files of the running Python's standard library (found through
    ``sysconfig``, site-packages excluded) and takes no ``paths``; ``kind='files'`` reads ``paths``: files,
    directories (every file below them that matches ``pattern``, dot files and dot dirs left out) and glob
    patterns (a path that exists is read as it is, even with ``[``, ``*`` or ``?`` in its name).
    """

    name: str | None = None  # None: default_source_name (stdlib, or from the first path)
    kind: str = "stdlib"  # stdlib | files
    paths: list[str] = field(default_factory=list)
    weight: float = 1.0  # sampling weight in a mixture (normalized over sources); 0 = validation only
    pattern: str = "*"  # file-name pattern used when a path is a directory

    def __post_init__(self) -> None:
        self.name = check_source_name(default_source_name(self.kind, self.paths) if self.name is None else self.name)
        if self.kind not in ("stdlib", "files"):
            raise CorpusError(f"data source {self.name!r}: kind must be 'stdlib' or 'files', got {self.kind!r}")
        if isinstance(self.paths, (str, os.PathLike)):  # paths=/my/corpus without brackets: one path, not its chars
            self.paths = [os.fspath(self.paths)]
        elif not isinstance(self.paths, Sequence):
            raise CorpusError(f"data source {self.name!r}: paths must be a list of files, directories or globs, "
                              f"got {self.paths!r} ({type(self.paths).__name__})")
        for i, path in enumerate(self.paths):  # None was read as the path 'None': "path None does not exist"
            if path is None:
                raise CorpusError(f"data source {self.name!r}: paths[{i}] is null: in YAML a bare ~ is null, not the "
                                  "home directory; quote it ('~', '~/corpus')")
            if isinstance(path, (bool, Sequence, Mapping)) and not isinstance(path, str):
                raise CorpusError(f"data source {self.name!r}: paths[{i}] must be one file, directory or glob, got "
                                  f"{path!r} ({type_name(path)})")
        if self.kind == "stdlib" and self.paths:  # CorpusSource(paths=[...]) without kind: the stdlib, paths unread
            raise CorpusError(
                f"data source {self.name!r}: kind='stdlib' reads the running Python's standard library and takes no "
                f"paths, got paths={list(self.paths)!r}; to read them set kind='files' (data=textfiles)"
            )
        if self.kind == "stdlib" and self.pattern != "*":  # +data.sources.0.pattern=...: read every .py file, silently
            raise CorpusError(
                f"data source {self.name!r}: kind='stdlib' reads every .py file of the standard library and takes no "
                f"pattern, got pattern={self.pattern!r}; to pick files set kind='files' and paths (data=textfiles)"
            )
        if self.kind == "files" and not self.paths:
            raise CorpusError(
                f"data source {self.name!r}: kind='files' needs a non-empty 'paths' list of files, directories or "
                "globs, e.g. 'data.sources.N.paths=[\"~/corpus\"]'"
            )
        if not isinstance(self.pattern, str) or not self.pattern:  # was an AttributeError or pathlib's ValueError
            raise CorpusError(
                f"data source {self.name!r}: pattern must be one glob for the files below a directory (e.g. '*.txt'), "
                f"got {self.pattern!r}; for several, give globs in paths: paths=['DIR/**/*.txt', 'DIR/**/*.md']"
            )
        if not is_number(self.weight):
            raise CorpusError(f"data source {self.name!r}: weight must be a number, got {self.weight!r} "
                              f"({type_name(self.weight)})")
        if not 0 <= self.weight < float("inf"):  # inf made the mixture's probabilities NaN
            raise CorpusError(f"data source {self.name!r}: weight must be finite and >= 0, got {self.weight}")


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library, sorted, without site-packages.

    The left-out dirs are not entered: ``rglob`` listed every file of site-packages (43k of the 51k files below
    the stdlib of a Python with torch installed there) to drop them, 0.7-1.1 s of every start on every rank,
    ten times what hashing the corpus takes; this walk takes 0.04 s."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


def resolve_files(source: CorpusSource) -> list[Path]:
    """Every file of ``source``, sorted and de-duplicated. Raises :class:`CorpusError` naming a bad path."""
    if source.kind == "stdlib":
        files = stdlib_files()
        if not files:
            root = sysconfig.get_paths()["stdlib"]
            raise CorpusError(f"data source {source.name!r}: found no .py files under {root}")
        return files
    out: list[Path] = []  # in the order of source.paths; each path's matches sorted
    globbed_dirs: list[tuple] = []  # (glob, directories it matched without their files, a glob for those)
    for raw in source.paths:
        path = os.path.expanduser(str(raw))
        if (why := missing_path_reason(raw)) is not None:  # (refused before the seed too: check_source_paths)
            raise CorpusError(f"data source {source.name!r}: path {raw!r} {why}")
        if glob.has_magic(path) and not os.path.lexists(path):  # (a path that exists is that file or directory)
            hits = [Path(m) for m in walk_glob(path)]
            hits = without_unfollowable_links(hits, walked="**" in path.split("/"))
            try:  # a dir with read but no search permission lists its names, and each stat is refused
                matches = [p for p in hits if p.is_file()]
                _warn_dangling(source, raw, [p for p in hits if p.is_symlink() and not p.exists()])
                # directories the glob matched without any file below them (a ** glob matches the dirs of its files)
                dirs = [p for p in hits if p.is_dir()]
            except PermissionError as e:  # was the PermissionError's traceback
                parent = os.path.dirname(e.filename)
                why = f"{parent!r} cannot be entered: {unenterable(parent)}" if unenterable(parent) else e.strerror
                raise CorpusError(f"data source {source.name!r}: glob {raw!r} matched {e.filename!r}, which cannot be "
                                  f"reached: {why}") from None
            covered = _dirs_of(matches) if dirs else set()  # real paths: only where a directory was matched
            dirs = [p for p in dirs if not _covered(p, covered, path) and any(f.is_file() for f in p.rglob("*"))]
            every_file = f"{str(raw).rstrip('/')}/**/*"  # ** also matches no directory: files at any depth
            if not matches and dirs:
                raise CorpusError(
                    f"data source {source.name!r}: glob {raw!r} matched {len(dirs)} directories but no files (e.g. "
                    f"{str(dirs[0])!r}), and a glob takes files only; for every file below them use {every_file!r}"
                )
            if not matches:
                hint = ""
                if "[" in str(raw):  # "run[1]/*.txt": '[1]' is a character class in a glob
                    hint = (f" ('[' starts a character class in a glob; for a '[' in a file or directory name write "
                            f"'[[]': {str(raw).replace('[', '[[]')!r})")
                hint += _brace_hint(str(raw))
                head = os.path.dirname(path.split("*")[0].split("?")[0].split("[")[0]) or "."  # before any magic
                if (why := unlistable(head)) is not None:
                    hint += f" ({head!r} cannot be listed: {why})"
                elif not os.path.isdir(head) and (why := unreachable_reason(head)) != "does not exist":
                    hint += f" ({head!r} {why})"  # a broken link on the way (an unmounted disk)
                raise CorpusError(f"data source {source.name!r}: glob {raw!r} matched no files{hint}")
            if dirs:
                globbed_dirs.append((raw, dirs, every_file))
            out.extend(sorted(matches))
        elif os.path.isdir(path):
            if (why := unlistable(path)) is not None:  # was "has no files matching '*'", after a warning
                raise CorpusError(f"data source {source.name!r}: directory {raw!r} cannot be listed: {why}")
            dangling: list[Path] = []
            dot_dirs: list[Path] = []  # not entered
            try:
                found = _files_below(Path(path), source.pattern, dangling, dot_dirs)
            except PermissionError as e:  # a link to a file it may not reach: was the PermissionError's traceback
                raise CorpusError(f"data source {source.name!r}: {e.filename!r} (in directory {raw!r}) "
                                  f"{unreachable_reason(e.filename)}") from None
            # hidden files and dirs (.git, .venv, editor swap files) are not corpus text
            matches = [p for p in found if not _hidden_below(p, path)]
            _warn_dangling(source, raw, [p for p in dangling if not _hidden_below(p, path)])
            if len(matches) < len(found) or dot_dirs:
                log_once(
                    log, logging.INFO,
                    "data source %r: left out %d hidden file(s) and %d hidden dir(s) under %s (dot files and "
                    "dot dirs)", source.name, len(found) - len(matches), len(dot_dirs), raw)
            if not matches:
                found += [f for d in dot_dirs for f in _files_below(d, source.pattern)]  # for the message
                hidden = ""
                if found:  # all of them dot files or in dot dirs: say so, not only in an INFO line
                    hidden = (f" except {len(found)} hidden one(s) (dot files or in dot dirs, e.g. "
                              f"{str(found[0])!r}), which a directory source leaves out; to read them list them as "
                              "files or a glob such as 'dir/.*'")
                hidden += _brace_hint(f"{str(raw).rstrip('/')}/**/{source.pattern}")
                raise CorpusError(
                    f"data source {source.name!r}: directory {raw!r} has no files matching {source.pattern!r}{hidden}"
                )
            out.extend(sorted(matches))
        else:  # a file
            kind = special_file_kind(path)
            if kind is not None:
                raise CorpusError(
                    f"data source {source.name!r}: path {raw!r} is {kind}, not a regular file: a corpus is read twice "
                    "(hashed for the token cache's key, then tokenized), so write it to a file first (e.g. "
                    "'zcat corpus.gz > corpus.txt' instead of <(zcat corpus.gz))"
                )
            out.append(Path(path))
    covered = _dirs_of(out) if globbed_dirs else set()
    for raw, dirs, every_file in globbed_dirs:
        left_out = [d for d in dirs if not _covered(d, covered, os.path.expanduser(str(raw)))]  # another path's?
        if left_out:
            log_once(
                log, logging.WARNING,
                "data source %r: glob %r also matched %d directories (e.g. %s), left out with the files below them: "
                "a glob takes files only; add %r to paths for every file below them",
                source.name,
                raw,
                len(left_out),
                left_out[0],
                every_file,
            )
    return _one_path_per_file(source, out)


def _dirs_of(files: list[Path]) -> set[Path]:
    """The directories above ``files``, as spelled and as their real paths: a directory reached through a link (``latest
    -> v2``) holds the files read under the other spelling."""
    # each directory's real path once, and a symbolic link's own: a real path per file took 50k files' resolution
    # from 4.0 s to 9.4 s (a directory source, at every start on every rank)
    real = {Path(os.path.realpath(d)) for d in {f.parent for f in files}}
    real |= {Path(os.path.realpath(f)).parent for f in files if f.is_symlink()}
    return {parent for f in files for parent in f.parents} | {p for d in real for p in (d, *d.parents)}


def _covered(directory: Path, dirs: set[Path], pattern: str) -> bool:
    """Whether ``directory`` is one of ``dirs`` (:func:`_dirs_of`) by its spelling or its real path: a glob over
    ``corpus/`` with ``latest -> v2`` reads v2's files as ``latest/...``, and v2, matched too, was warned about as
    'left out with the files below them', with a fix that added nothing."""
    return directory in dirs or not _links_up(directory, pattern) and Path(os.path.realpath(directory)) in dirs


def _links_up(directory: Path, pattern: str) -> bool:
    """Whether ``directory`` is a link back up the tree (``v2/up -> ..``) to a dir that the glob ``pattern`` did not
    walk with its ``**``: its real path is above the files read, so it passed for a dir read through a link, and
    ``v2/*`` left the other files below it out without a word (``corpus/**/*`` walks them: no warning)."""
    real, parent = Path(os.path.realpath(directory)), Path(os.path.realpath(directory.parent))
    if real not in parent.parents:  # a link to its own dir (current -> .) holds the files beside it: those read, and
        return False  # its subdirs each matched (it was warned of as left out, c/* reading every file of c)
    parts = pattern.split("/")
    if "**" not in parts:
        return True
    head = "/".join(parts[: parts.index("**")]) or ("/" if pattern.startswith("/") else ".")
    walked = [Path(os.path.realpath(b)) for b in (glob.glob(head) if glob.has_magic(head) else [head])]
    return not any(real == base or base in real.parents for base in walked)


def _brace_hint(pattern: str) -> str:
    """A hint for a glob with shell braces (``*.{md,txt}``), which Python's glob takes as the characters ``{md,txt}``
    (so it matched nothing): the globs to list in ``paths`` instead; '' for a glob without them."""
    braces = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if braces is None:
        return ""
    globs = [pattern[: braces.start()] + alt + pattern[braces.end() :] for alt in braces[1].split(",")]
    return f" (a glob has no {{a,b}} alternatives, as a shell's braces are; list one glob for each in paths: {globs!r})"


def _hidden_below(path: Path, root: str) -> bool:
    """Whether ``path`` is a dot file or lies in a dot dir below ``root``."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _warn_dangling(source: CorpusSource, raw, links: list[Path]) -> None:
    """Warn about symlinks that ``raw`` matched whose target is missing (an unmounted disk, a moved corpus) or that
    form a loop of links (``a -> b -> a``, said to be missing): no file to read, but their text is missing."""
    if links:
        log_once(
            log, logging.WARNING,
            "data source %r: left out %d symlink(s) under %s whose target does not exist or is a loop, e.g. %s -> %s",
            source.name, len(links), raw, links[0], os.readlink(links[0]))


def _one_path_per_file(source: CorpusSource, paths: list[Path]) -> list[Path]:
    """``paths`` sorted, each file once: a file reached by two spellings (``corpus`` and ``/abs/corpus``, a
    directory and a glob inside it), through a symlink or a hard link was read once per spelling, a document
    counted twice. The file keeps its first spelling that is not a symlink. Files with equal bytes are distinct
    documents."""
    chosen: dict[object, Path] = {}
    for path in paths:
        identity = _file_identity(path)
        kept = chosen.get(identity)
        if kept is None or (kept.is_symlink() and not path.is_symlink()):
            chosen[identity] = path
    spellings = set(paths)
    if len(spellings) > len(chosen):
        kept = set(chosen.values())
        example = next(p for p in sorted(spellings) if p not in kept)
        log_once(
            log, logging.INFO,
            "data source %r: left out %d path(s) that reach a file already in the corpus (reached more than once: "
            "another spelling, a symlink or a hard link), e.g. %s is %s",
            source.name,
            len(spellings) - len(chosen),
            example,
            chosen[_file_identity(example)],
        )
    return sorted(chosen.values())


def _file_identity(path: Path) -> object:
    """What makes two paths one file: its inode when it has hard links (``st_nlink > 1``), else its real path.
    The inode only then: some network and FUSE file systems make up inode numbers, but not link counts."""
    try:
        st = os.stat(path)
    except OSError:  # gone meanwhile: reading it names it
        return os.path.realpath(path)
    return (st.st_dev, st.st_ino) if st.st_nlink > 1 else os.path.realpath(path)


def leave_out_dirs(source: CorpusSource, files: list[Path], dirs: dict[str, str]) -> list[Path]:
    """``files`` without those under the directories ``dirs`` (``{directory: what it holds}``, e.g. the token cache dir:
    'token caches'), each left out with a warning; :class:`CorpusError` when nothing else is left.

    A token cache dir inside a corpus directory (``paths=[~/work]``, ``LIT_DTRAIN_CACHE=~/work/cache``) made each
    run train on the token files of the run before it (as 'UTF-16LE text': a uint16 token stream), a new cache every
    run of a corpus three times larger; a run output dir inside it (``paths=[.]`` from the project dir) put the
    previous runs' checkpoints and logs in the corpus, and the run's own ``train.log``, written while the corpus was
    read, failed the build with 'changed while the token cache ... was built; run again', which no rerun fixes."""
    kept, real = list(files), {f: os.path.realpath(f) for f in files}
    for directory, what in dirs.items():
        top = os.path.realpath(os.path.expanduser(os.fspath(directory)))
        inside = [f for f in kept if os.path.commonpath([top, real[f]]) == top]
        if not inside:
            continue
        kept = [f for f in kept if os.path.commonpath([top, real[f]]) != top]
        if not kept:
            raise CorpusError(
                f"data source {source.name!r}: its {len(files)} file(s) are all under {top!r} (e.g. "
                f"{str(inside[0])!r}), which holds {what}, not corpus text"
            )
        log_once(
            log, logging.WARNING,
            "data source %r: left out %d file(s) under %s (%s, not corpus text), e.g. %s", source.name,
            len(inside), top, what, inside[0])
    return kept
