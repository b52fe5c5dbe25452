"""Why a file given as a checkpoint does not load, read from its bytes (:mod:`lit_dtrain.checkpoint` words each
reason into ``checkpoint '<path>' <reason>``): cut short, bytes after its end, damaged inside (the CRC-32 torch
records for each zip member), or no torch file at all. Each reads the file and never writes."""

from __future__ import annotations

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


def _bytes_after_the_zip_end(path: str | os.PathLike) -> tuple[int, int | None] | None:
    """``(size, n)`` for a file that starts like a torch zip file: ``n`` bytes follow its zip end record (0: it ends
    there, whole), or ``n`` None when it has none (cut short). None when it does not start like one. Reads the first
    4 bytes and at most the last 64 KiB, never writes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_START))
        if not head or not _ZIP_START.startswith(head):
            return None
        f.seek(max(0, size - _ZIP_END_SIZE - 0xFFFF))  # the record's comment is at most 0xFFFF bytes
        tail = f.read()
    pos, after = tail.rfind(_ZIP_END), None
    while pos >= 0:  # an end record's comment length takes it exactly to the end of the file
        comment = len(tail) - pos - _ZIP_END_SIZE
        declared = int.from_bytes(tail[pos + 20 : pos + 22], "little")
        if comment >= 0 and declared == comment:
            return size, 0
        if after is None and 0 <= declared < comment:  # a whole end record with bytes after it (padding, an append)
            after = comment - declared
        pos = tail.rfind(_ZIP_END, 0, pos)
    return size, after


def truncation_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` is an incomplete torch checkpoint, for messages ``f"checkpoint {path!r} {reason}"``; None when
    it does not start like a torch zip file or has a zip end record (then it is whole, or damaged otherwise, or has
    bytes after it: :func:`trailing_bytes_reason`).

    torch finds a zip's table of contents from its end record, so a file cut short anywhere (a copy, download or
    write that was interrupted) fails as ``OSError: [Errno 22] Invalid argument`` (a seek before the start of the
    file), a miniz 'failed finding central directory', or, cut to a byte, a pickle error; none says so. Reads the
    first 4 bytes and at most the last 64 KiB, never writes."""
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
    failed to load, for messages ``f"checkpoint {path!r} {reason}"``; None otherwise. torch loads one with a few such
    bytes (16 did), and fails past that as ``OSError: [Errno 22] Invalid argument`` (4096 did); the CRC-32 check
    passes either way: the archive itself is intact. Call it only after a load failed."""
    found = _bytes_after_the_zip_end(path)
    if found is None or not found[1]:
        return None
    size, after = found
    return (
        f"has {after} bytes after the zip end record that closes the archive (a copy that padded it, or bytes "
        f"appended to it), which torch.load cannot read past; its {size - after} bytes before them are intact. "
        f"Remove them (truncate -s {size - after} <file>) or use another copy"
    )


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
        with zipfile.ZipFile(path) as archive:
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
