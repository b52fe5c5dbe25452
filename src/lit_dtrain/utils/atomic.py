"""Write a file whole or not at all: a temp file beside it, fsynced, renamed over it.

The one writer behind ``lit_dtrain.checkpoint.atomic_torch_save`` (checkpoints), ``lit_dtrain.loggers.
write_csv_atomically`` (``metrics.csv``) and ``lit_dtrain.utils.plots.write_atomically`` (the scripts' plots and
tables). A kill, a full disk or an I/O error at any point leaves the previous file at the path whole: the new bytes
go to ``.<name>.tmp-<pid>`` in the same directory (a rename is atomic only within one filesystem), are fsynced,
``os.replace``-d over the path, and the directory is fsynced so the rename itself survives a power loss. A failure
removes the temp file; only a kill (SIGKILL, power loss) can leave one behind, under a name that says whose it was
(``train()`` removes those of dead writers from its run dir at the next start: :func:`remove_killed_writes_temp_files`).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path


class AtomicWriteError(OSError):
    """An atomic write that failed on an OS error (disk full, I/O error, permissions); the message names the path
    and says what is left there (:func:`what_is_left`). ``errno`` and ``strerror`` are the underlying error's,
    ``filename`` the path."""

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.message = f"could not write {str(path)!r}: {self.strerror}; {what_is_left(path)}"

    def __str__(self) -> str:
        return self.message


def what_is_left(path: str | os.PathLike) -> str:
    """What a failed :func:`write_atomically` left at ``path``, for its error message: the previous file, whole, or
    nothing (a new file, such as a checkpoint's next step file, that was never there). Called after the failure, when
    ``path`` is as it was before the write."""
    if os.path.isdir(path) and not os.path.islink(path):
        return "a directory is in the way at that path: remove or rename it"
    return "the previous file at that path is intact" if os.path.lexists(path) else "no file was created at that path"


def temp_path(path: str | os.PathLike, keep_suffix: bool = False) -> Path:
    """The temp file :func:`write_atomically` writes before renaming it over ``path``: ``.<name>.tmp-<pid>``, hidden
    and owned by this process. With ``keep_suffix`` it ends in ``path``'s suffix too (matplotlib picks the format
    from it); without, a glob for ``*<suffix>`` (resume's ``*.ckpt`` scan) never sees a half-written file."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix if keep_suffix else ''}")


_TEMP_NAME = re.compile(r"\..+\.tmp-(?P<pid>\d+)(\.[^.]*)?")  # temp_path's names, with keep_suffix or without


def remove_killed_writes_temp_files(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temp files that writes killed midway (SIGKILL, OOM, power loss) left in ``run_dir`` and in its
    direct subdirectories (``csv/``, ``checkpoints/`` ...): :func:`temp_path`'s ``.<name>.tmp-<pid>[<suffix>]``
    whose pid is no live process, or is this process's (a previous process's pid reused, as in a container that
    restarts with the same pids: call this only where this process writes nothing there yet). A live writer's file
    stays. Returns the removed paths (none when ``run_dir`` does not exist)."""
    run_dir = Path(run_dir)
    try:
        subdirs = sorted(p for p in run_dir.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:  # missing or unreadable: nothing of ours to remove
        return []
    removed = []
    for directory in (run_dir, *subdirs):
        try:
            entries = sorted(directory.iterdir())
        except OSError:
            continue
        for tmp in entries:
            match = _TEMP_NAME.fullmatch(tmp.name)
            if match is None or tmp.is_symlink() or not tmp.is_file():
                continue
            pid = int(match["pid"])
            if pid == os.getpid() or not pid_alive(pid):
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:  # a pid no process can have
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e``: itself or one in its ``__cause__``/``__context__`` chain. On a full disk torch's
    zip writer can fail with a RuntimeError ("unexpected pos ...") raised while the failed write's OSError is being
    handled, and that OSError is what names the problem."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object], keep_suffix: bool = False) -> None:
    """Call ``write(tmp)`` to write the new contents to a temp file beside ``path`` (:func:`temp_path`), fsync it,
    rename it over ``path`` and fsync the directory: ``path`` is then the old file or the new one, whole, whatever
    happens meanwhile. The parent directory is created if needed.

    On any failure (also KeyboardInterrupt) the temp file is removed and the previous file left as it was; a
    failure on an OS error is raised as :class:`AtomicWriteError` naming ``path``, anything else (a bug in
    ``write``, an object that cannot be serialized) as it came."""
    path = Path(path)
    tmp = temp_path(path, keep_suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.open("wb").close()  # created (or a stale one emptied) here: a write that writes nothing gives an empty file
        write(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        reason = os_error(e) if isinstance(e, Exception) else None
        if reason is None or isinstance(reason, AtomicWriteError):
            raise
        raise AtomicWriteError(path, reason) from e
    _fsync_directory(path.parent)


def _fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk (fsync through a new descriptor reaches the same inode's dirty pages). An
    error is the write's error: the data may not be on the disk (EIO, ENOSPC on a delayed allocation)."""
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # Windows' fsync needs a writable handle
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable. Skipped where the platform cannot (Windows cannot open a directory;
    some filesystems refuse to fsync one): the rename is atomic all the same, only not yet durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unwritable_dir_reason(directory: str | os.PathLike) -> str | None:
    """Why files cannot be written in ``directory`` (created with its parents if missing), for messages
    ``f"{directory!r} {reason}"``; None when they can. Looks at the directory or its nearest existing ancestor
    without leaving anything made: a file in the way, a read-only file system (which ``os.access`` reports for root
    too, unlike a permission), no write permission, a dir in which nothing can be made (``/proc`` as root: a new
    dir is made and removed beside the missing one to tell)."""
    path = Path(directory).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    # a link on the way that leads nowhere (LIT_DTRAIN_OUTPUT on an unmounted scratch): the nearest existing dir
    # passed every check, and Hydra's mkdir ended in a traceback, 'FileExistsError: [Errno 17] File exists: <link>'
    broken = next((p for p in (path, *path.parents) if p.is_symlink()), None) if existing != path else None
    if broken is not None and broken not in (existing, *existing.parents):
        from lit_dtrain.data._path_problems import unreachable_reason

        return f"cannot be created: {str(broken)!r} {unreachable_reason(broken)}"
    where = "" if existing == path else f": its ancestor {str(existing)!r}"
    if not existing.is_dir():
        return f"cannot be created{where} is a file, not a directory"
    if hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"cannot be written{where or ': it'} is on a read-only file system"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be written{where or ': it'} is not writable by this user"
    if existing != path:  # where root may write but nothing can be made (/proc, /sys): Hydra's mkdir traceback
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".lit_dtrain-probe-", dir=existing))
        except OSError as e:
            return f"cannot be created{where} refuses a new directory ({e.strerror or e})"
    return None
