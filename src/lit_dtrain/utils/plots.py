"""Where the scripts write their plots and tables: checked before any compute, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

from lit_dtrain.utils import atomic


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the flag and the path."""


def output_path(path: str | os.PathLike, flag: str, image: bool = False) -> Path:
    """``path`` checked for writing, before the work that produces it: not a directory (as given, before ``.png``
    is added, too, nor a path ending with a separator), its parent a directory that exists or can be made and is
    writable. With ``image``, a path without a suffix gets ``.png`` (matplotlib would append it itself, and the script
    would report a file it did not write) and another suffix must be a format matplotlib writes.
    :class:`OutputPathError` naming ``flag`` otherwise."""
    if not os.fspath(path):  # Path('') is '.': spectrum.py --out '' said "--out '' is a directory"
        raise OutputPathError(f"{flag} is empty; give a file path")
    out = Path(path).expanduser()
    if out.is_dir():  # before the suffix: '--out plots/' wrote plots.png beside the dir, and said so
        raise OutputPathError(f"{flag} {str(path)!r} is a directory; give a file path")
    if os.fspath(path).endswith(tuple(filter(None, ("/", os.sep, os.altsep)))):  # Path drops the trailing '/': a
        # dir not made yet, '--out plots/', wrote plots.png (and '--table tables/' a file named tables), exit 0
        raise OutputPathError(f"{flag} {str(path)!r} ends with a path separator, so it names a directory; give a "
                              "file path")
    if os.path.basename(os.fspath(path)) in (os.curdir, os.pardir):  # Path drops a trailing '/.' too: '--out
        # plots/.' wrote plots.png beside the missing dir, and '--out plots/..' a file named '...png' in it
        raise OutputPathError(f"{flag} {str(path)!r} ends with {os.path.basename(os.fspath(path))!r}, so it names a "
                              "directory; give a file path")
    if image:
        if not out.suffix:
            out = out.with_name(out.name + ".png")
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if out.suffix[1:].lower() not in formats:
            raise OutputPathError(f"{flag} {str(path)!r}: matplotlib cannot write {out.suffix!r} files; use one of "
                                  f"{sorted('.' + f for f in formats)}")
    if out.is_dir():
        raise OutputPathError(f"{flag} {str(path)!r} is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{flag} {str(path)!r}: cannot create its directory: {e.strerror or e}") from e
    if not os.access(out.parent, os.W_OK):
        raise OutputPathError(f"{flag} {str(path)!r}: its directory {str(out.parent)!r} is not writable")
    return out


def write_atomically(path: Path, write) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path`` (same suffix: matplotlib picks the format from it),
    then rename it over ``path``: an existing file is replaced whole, never left half written
    (:func:`lit_dtrain.utils.atomic.write_atomically`, which also fsyncs and names the path in its error)."""
    atomic.write_atomically(path, write, keep_suffix=True)
