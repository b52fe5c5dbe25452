"""Why a file given as a checkpoint does not load, read from its bytes (:mod:`lit_dtrain.checkpoint` words each
reason into ``checkpoint '<path>' <reason>``): cut short, bytes after its end, damaged inside (the CRC-32 torch
records for each zip member), or no torch file at all. Each reads the file and never writes."""

from __future__ import annotations

import contextlib
import os
import zipfile
from pathlib import Path

_ZIP_START = b"PK\x03\x04"  # a zip's first local file header: torch.save's format since torch 1.6
_ZIP_END = b"PK\x05\x06"  # the end-of-central-directory record, the last 22 bytes (+ a comment) of a zip
_ZIP_END_SIZE = 22


def _starts_like_zip(path: Path) -> bool:
    """Whether the file starts like a zip archive (True when it cannot be read: torch's own error says why)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_ZIP_START)) == _ZIP_START
    except OSError:
        return True


def _ends_a_zip(f, pos: int, record: bytes) -> bool:
    """Whether ``record``, a zip end record at ``pos`` in ``f``, closes the archive: the central directory it (or
    the zip64 record torch.save writes before it) points at ends where that record starts, with a directory entry."""
    cd_size, cd_offset, end = int.from_bytes(record[12:16], "little"), int.from_bytes(record[16:20], "little"), pos
    if pos >= 20:
        f.seek(pos - 20)
        locator = f.read(20)
        if locator[:4] == b"PK\x06\x07":  # the zip64 locator: its record holds the directory's 8-byte size, offset
            end = int.from_bytes(locator[8:16], "little")
            f.seek(end)
            record64 = f.read(56)
            if len(record64) < 56 or record64[:4] != b"PK\x06\x06":
                return False
            cd_size, cd_offset = int.from_bytes(record64[40:48], "little"), int.from_bytes(record64[48:56], "little")
    if cd_offset + cd_size != end:
        return False
    f.seek(cd_offset)
    return cd_size == 0 or f.read(4) == b"PK\x01\x02"


def _bytes_after_the_zip_end(path: str | os.PathLike) -> tuple[int, int | None] | None:
    """``(size, n)`` for a file that starts like a torch zip file: ``n`` bytes follow its zip end record (0: it ends
    there, whole), or ``n`` None when it has none (cut short). None when it does not start like one. Reads the first
    4 bytes and the last 64 KiB; only where no end record closes the archive there, the file backwards in 1 MiB
    chunks (bytes appended past 64 KiB; a file cut short is read whole). Never writes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_START))
        if not head or not _ZIP_START.startswith(head):
            return None
        start = max(0, size - _ZIP_END_SIZE - 0xFFFF)  # the record's comment is at most 0xFFFF bytes
        f.seek(start)
        tail = f.read()
        pos = tail.rfind(_ZIP_END)
        while pos >= 0:  # an end record's comment length takes it exactly to the end of the file
            comment, record = len(tail) - pos - _ZIP_END_SIZE, tail[pos : pos + _ZIP_END_SIZE]
            if comment >= 0 and int.from_bytes(tail[pos + 20 : pos + 22], "little") == comment and not (
                    # an empty archive's record (22 bytes) appended to a checkpoint ends the file too: taken for the
                    # end, the file passed as whole, torch failed ('archive does not contain any files'), and it
                    # was called 'a zip archive without data.pkl (it holds [])'. One that holds entries but points
                    # at no directory is damaged inside (damage_reason's), not followed by anything
                    record[10:12] == b"\0\0" and start + pos > 0 and not _ends_a_zip(f, start + pos, record)):
                return size, 0
            pos = tail.rfind(_ZIP_END, 0, pos)
        chunk, end = 1 << 20, size  # a whole end record with bytes after it (padding, an append), however many
        while end > 0:
            lo = max(0, end - chunk)
            f.seek(lo)
            block = f.read(end - lo + _ZIP_END_SIZE - 1)  # overlaps the next block up by a record less one byte
            pos = block.rfind(_ZIP_END)
            while pos >= 0:
                record = block[pos : pos + _ZIP_END_SIZE]
                after = size - lo - pos - _ZIP_END_SIZE - int.from_bytes(record[20:22], "little")
                if len(record) == _ZIP_END_SIZE and after > 0 and _ends_a_zip(f, lo + pos, record):
                    return size, after
                pos = block.rfind(_ZIP_END, 0, pos)
            end = lo
    return size, None


def truncation_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` is an incomplete torch checkpoint, for messages ``f"checkpoint {path!r} {reason}"``; None when
    it does not start like a torch zip file or has a zip end record (then it is whole, or damaged otherwise, or has
    bytes after it: :func:`trailing_bytes_reason`).

    torch finds a zip's table of contents from its end record, so a file cut short anywhere (a copy, download or
    write that was interrupted) fails as ``OSError: [Errno 22] Invalid argument`` (a seek before the start of the
    file), a miniz 'failed finding central directory', or, cut to a byte, a pickle error; none says so. Reads the
    first 4 bytes and the last 64 KiB of a whole file; a file cut short (or with bytes appended past that) backwards
    in 1 MiB chunks, never whole at once; never writes."""
    found = _bytes_after_the_zip_end(path)
    if found is None or found[1] is not None:
        return None
    return (
        f"is truncated: its {found[0]} bytes start like a torch checkpoint (a zip archive) but end without the zip "
        "end record that closes every complete one, so the file is incomplete (a copy, download or write cut short). "
        "It is left as it is; use a complete copy or another checkpoint"
    )


def trailing_bytes_reason(path: str | os.PathLike) -> str | None:
    """Why ``path``, a whole torch zip file with bytes after its end record (zeros a copy padded it with, an append),
    failed to load, for messages ``f"checkpoint {path!r} {reason}"``; None otherwise. How many such bytes torch reads
    past depends on the archive's size: a 1.6 kB file loaded with 16 and failed with 4096 (``OSError: [Errno 22]
    Invalid argument``), a 120 kB one and a ``nano`` ``last.ckpt`` loaded with 65537 and failed with 70000 (miniz's
    ``failed finding central directory``); the CRC-32 check passes either way: the archive itself is intact. Call it
    only after a load failed."""
    found = _bytes_after_the_zip_end(path)
    if found is None or not found[1]:
        return None
    size, after = found
    return (
        f"has {after} bytes after the zip end record that closes the archive (a copy that padded it, or bytes "
        f"appended to it), which torch.load cannot read past; its {size - after} bytes before them are intact. "
        f"Remove them (truncate -s {size - after} <file>) or use another copy"
    )


class _Upto:
    """A file read as if it ended at ``end`` (for ``zipfile``: the archive without the bytes appended to it)."""

    def __init__(self, f, end: int):
        self._f, self._end = f, end

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(self._end + offset if whence == 2 else offset, 0 if whence == 2 else whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._end - self._f.tell())
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def seekable(self) -> bool:
        return True


def damage_reason(path: str | os.PathLike) -> str | None:
    """Why ``path``, a torch checkpoint (a zip archive) with its end record, is damaged, for messages
    ``f"checkpoint {path!r} {reason}"``; None when it does not start like one or each of its members reads back
    whole with the CRC-32 its zip directory records.

    torch writes each member stored (uncompressed) with a CRC-32 but never checks one on load, so a changed byte
    (bit rot, a bad disk or copy) fails there as whatever the bytes now mean: a pickle opcode it calls an
    'Unsupported operand' (the message for a file holding code), a UnicodeDecodeError, a miniz error; in a
    tensor's bytes it loads without a word. Reads the whole file once, never writes (:func:`verify_checkpoint` runs
    it before each load)."""
    with open(path, "rb") as f:
        if f.read(len(_ZIP_START)) != _ZIP_START:
            return None
    keep = "It is left as it is; use an intact copy or another checkpoint"
    try:
        with contextlib.ExitStack() as stack:
            found = _bytes_after_the_zip_end(path)  # zipfile takes the last end record in the last 64 KiB: with
            if found and found[1]:  # bytes appended, read the archive they follow (an appended empty one was read)
                upto = _Upto(stack.enter_context(open(path, "rb")), found[0] - found[1])
                archive = stack.enter_context(zipfile.ZipFile(upto))
            else:
                archive = stack.enter_context(zipfile.ZipFile(path))
            for member in archive.infolist():
                try:
                    with archive.open(member) as f:
                        while f.read(1 << 20):  # ZipExtFile compares the CRC-32 once the member is read to its end
                            pass
                except Exception as e:  # a bad CRC, a local header unlike the directory's entry, a bad method ...
                    if "CRC-32" in str(e):
                        return (
                            f"is damaged: member {member.filename!r} fails its CRC-32 check: its bytes changed "
                            f"after torch wrote them (bit rot, a bad disk or copy). {keep}"
                        )
                    return f"is damaged: member {member.filename!r} cannot be read ({type(e).__name__}: {e}). {keep}"
    except Exception as e:  # BadZipFile, a name that is not UTF-8 ...: the directory itself is damaged
        return f"is damaged: its zip directory cannot be read ({type(e).__name__}: {e}). {keep}"
    return None


_LEGACY_START = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"  # torch.save's pre-1.6 format: a pickled magic number


def foreign_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a torch checkpoint at all, for messages ``f"checkpoint {path!r} {reason}"``; None when
    it starts like one (a zip archive holding a ``data.pkl``, or torch's legacy format), whatever else is wrong.

    torch tries such a file as its legacy pickle format, and the unpickler fails on whatever the first bytes mean
    to it: text starting 'he' was 'KeyError: 101', a CSV 'IndexError: pop from empty list', a JSON file
    'Unsupported operand 123' (the message for pickled code); none says the file is something else. Reads the
    first 64 bytes (and a zip's directory), never writes: call it only after a load failed."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(_ZIP_START):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except Exception:  # a damaged zip: damage_reason's to name
            return None
        if any(name.endswith("/data.pkl") for name in names):
            return None
        return (
            f"is not a torch checkpoint: it is a zip archive without the '<name>/data.pkl' torch.save writes "
            f"(it holds {names[:5]}{' ...' if len(names) > 5 else ''}); give a .ckpt written by train.py"
        )
    if head.startswith(_LEGACY_START):
        return None
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        what = f"a Python pickle (protocol {head[1]}) that torch.save did not write"
    else:
        text = head.decode("utf-8", errors="ignore")  # a multi-byte character cut at byte 64 is dropped
        printable = all(c.isprintable() or c in "\t\n\r" for c in text) and len(text) >= len(head) - 3
        what = f"text starting {text[:40]!r}" if head and printable else f"binary data starting {head[:8].hex(' ')}"
    return (
        f"is not a torch checkpoint: it is {what}, neither a zip archive (torch.save's format) nor torch's legacy "
        "format; give a .ckpt written by train.py"
    )
